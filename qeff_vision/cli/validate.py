"""``qeff-vision validate``: every problem of every spec file, exit code 2 if any."""

from __future__ import annotations

from pathlib import Path

import click

from qeff_vision.errors import UserError


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
def validate(paths: tuple[Path, ...]) -> None:
    """Check SPEC files (directories are searched recursively) and print every problem, one per line."""
    from qeff_vision import api
    from qeff_vision.spec import find_specs

    files = [spec for path in paths for spec in (find_specs(path) if path.is_dir() else [path])]
    if not files:
        raise UserError("no spec files found in " + ", ".join(map(str, paths)))
    bad = count = 0
    reported: list[str] = []
    for path in files:
        problems, warnings = api.validate(path)
        reported += [f"{path}: {problem}" for problem in problems]
        for problem in problems if len(files) > 1 or len(problems) > 1 else ():
            click.echo(f"{path}: {problem}", err=True)
        for warning in warnings:
            click.echo(f"{path}: warning: {warning}", err=True)
        if problems:
            bad, count = bad + 1, count + len(problems)
        else:
            click.echo(f"{path}: ok")
            for note in api.deployment_notes(path):
                click.echo(f"{path}: note: {note}", err=True)
            for note in api.config_notes(path):
                click.echo(f"{path}: note: {note}", err=True)
            for line in api.memory_fit(path):  # figures for the target; the fit is not judged here
                click.echo(f"{path}: note: {line}", err=True)
            for line in api.bucket_admission(path):
                click.echo(f"{path}: {line}")
            for line in api.activation_estimate(path):  # the bound is checked on the graphs at compile
                click.echo(f"{path}: {line}")
                if "above the" in line:
                    click.echo(f"{path}: warning: {line}", err=True)
    if bad == len(files) == count == 1:  # one problem in one file: the error line is the problem
        raise UserError(reported[0])
    if bad:
        raise UserError(f"{count} problem(s) in {bad} of {len(files)} spec file(s)")
