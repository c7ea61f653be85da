"""``qeff-vision validate``: every problem of every spec file, exit code 2 if any."""

from __future__ import annotations

from pathlib import Path

import click

from qeff_vision.errors import SpecError, UserError


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
def validate(paths: tuple[Path, ...]) -> None:
    """Check SPEC files (directories are searched recursively) and print every problem, one per line."""
    from qeff_vision.spec import find_specs, load_spec

    files = [spec for path in paths for spec in (find_specs(path) if path.is_dir() else [path])]
    if not files:
        raise UserError("no spec files found in " + ", ".join(map(str, paths)))
    bad = problems = 0
    for path in files:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            bad += 1
            problems += len(exc.problems)
            for problem in exc.problems:
                click.echo(f"{path}: {problem}", err=True)
            continue
        for warning in spec.warnings:
            click.echo(f"{path}: warning: {warning}", err=True)
        click.echo(f"{path}: ok")
    if bad:
        raise UserError(f"{problems} problem(s) in {bad} of {len(files)} spec file(s)")
