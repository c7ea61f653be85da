"""``qeff-vision specialize``: specializations and custom IO from a spec; golden-file check and update."""

from __future__ import annotations

from pathlib import Path

import click

from qeff_vision.errors import UserError
from qeff_vision.spec import LAYOUTS

HELP = {
    "paths": "A spec file; with --check/--update-golden, spec directories (default: specs/).",
    "output": "Write vision/ and lang/ specializations.json and custom_io.yaml here.",
    "check": "Regenerate every spec under each directory in memory and diff against DIR/golden/.",
    "update_golden": "Rewrite DIR/golden/ from every spec under each directory.",
    "layout": "Override the spec's specialization_layout (auto: what the installed SDK reads, else flat).",
}


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path, file_okay=False), help=HELP["output"])
@click.option("--check", is_flag=True, help=HELP["check"])
@click.option("--update-golden", is_flag=True, help=HELP["update_golden"])
@click.option("--layout", type=click.Choice(LAYOUTS), help=HELP["layout"])
def specialize(
    paths: tuple[Path, ...], output: Path | None, check: bool, update_golden: bool, layout: str | None
) -> None:
    """Write the compiler's specializations and custom IO for SPEC and print a table of them.

    Without -o the table is printed and nothing is written.
    """
    from qeff_vision import api
    from qeff_vision.spec import specialization_table

    if check or update_golden:
        if check and update_golden:
            raise UserError("--check and --update-golden are exclusive")
        if output is not None or layout is not None:
            raise UserError("-o/--layout do not apply to --check/--update-golden")
        _golden(paths or (Path("specs"),), update_golden, api.check_golden)
        return
    if len(paths) != 1:
        raise UserError("specialize takes exactly one SPEC (or --check/--update-golden with directories)")
    result = api.specialize(paths[0], output, layout=layout)
    click.echo(specialization_table(result))
    if output is not None:
        for relative in result.files():
            click.echo(f"wrote {output / relative}")


def _golden(roots: tuple[Path, ...], update: bool, check_golden) -> None:
    failures = 0
    for root in roots:
        if not root.is_dir():
            raise UserError(f"{root}: not a directory of specs")
        report = check_golden(root, update=update)
        for diff in report.diffs:
            click.echo(diff, nl=False)
        for problem in report.problems:
            click.echo(problem, err=True)
        for path in report.written:
            click.echo(f"updated {path}")
        failures += len(report.diffs) + len(report.problems)
        click.echo(
            f"{root}: {len(report.specs)} spec(s), {len(report.diffs)} golden diff(s), "
            f"{len(report.problems)} problem(s)",
            err=True,
        )
    if failures:
        action = (
            "fix the spec(s); no golden file was changed"
            if update
            else "run `qeff-vision specialize --update-golden` (make golden)"
        )
        raise UserError(f"golden check failed with {failures} finding(s); review them, then {action}")
