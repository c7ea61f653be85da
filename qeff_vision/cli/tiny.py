"""``qeff-vision tiny FAMILY -o DIR``: a random-weight checkpoint for tests and demos."""

from __future__ import annotations

import click

from qeff_vision import api
from qeff_vision.families import all_families


@click.command()
@click.argument("family", type=click.Choice([f.name for f in all_families()]))
@click.option(
    "-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory."
)
@click.option("--seed", default=0, show_default=True, help="Random seed of the weights.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
def tiny(family: str, out_dir: str, seed: int, force: bool) -> None:
    """Write a tiny random-weight checkpoint of FAMILY (config, safetensors, tokenizer, processor)."""
    path = api.tiny(family, out_dir, seed=seed, force=force)
    click.echo(f"wrote tiny {family} checkpoint to {path}")
