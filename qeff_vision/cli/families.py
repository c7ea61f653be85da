"""``qeff-vision families``: the supported families and their feature matrix."""

from __future__ import annotations

import click

from qeff_vision import api


@click.command()
def families() -> None:
    """List supported model families, the architectures they accept and every feature."""
    click.echo(api.families_table())
