"""Golden files: every spec under a directory regenerated in memory and compared with its committed output.

Layout: ``<root>/**/<spec>.yaml`` (any depth, ``<root>/golden`` excluded) and
``<root>/golden/<spec name>/{vision,lang}/{specializations.json,custom_io.yaml}`` and
``<root>/golden/<spec name>/vllm_serve.txt`` (the vLLM commands ``compile --print-serve``
prints; for a ``single`` or ``disaggregated`` deployment ``compile_commands.txt``, every program's
compiler command line, instead) and ``<root>/golden/<spec name>/activation.txt`` (the attention
score bytes per specialization ``validate`` prints). ``auto`` layouts are generated as ``flat``
here so golden files never depend on the machine's SDK.
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from qeff_vision.compile.vllm_handoff import GOLDEN_FILE, golden_serve_text
from qeff_vision.errors import SpecError
from qeff_vision.fsutil import atomic_write_text
from qeff_vision.spec.activation_estimate import GOLDEN_FILE as ACTIVATION_FILE
from qeff_vision.spec.activation_estimate import golden_text as activation_text
from qeff_vision.spec.loader import find_specs, load_spec
from qeff_vision.spec.specializations import build_specializations

GOLDEN_DIR = "golden"
COMMANDS_FILE = "compile_commands.txt"  # specs with a deployment other than dual


@dataclass
class GoldenReport:
    """Outcome of a golden check or update.

    Attributes:
        specs: Spec files looked at.
        diffs: Unified diffs, golden file first, one per differing file.
        problems: Spec errors, missing or stale golden files, duplicate spec names.
        written: Golden files written or removed by an update.
    """

    specs: list[Path] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No diff and no problem."""
        return not self.diffs and not self.problems


def _diff(golden_path: Path, golden: str, fresh: str, spec_path: Path) -> str:
    lines = difflib.unified_diff(
        golden.splitlines(keepends=True),
        fresh.splitlines(keepends=True),
        fromfile=f"{golden_path} (golden)",
        tofile=f"{golden_path} (regenerated from {spec_path})",
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def check_golden(root: str | Path, *, update: bool = False) -> GoldenReport:
    """Regenerate every spec under ``root`` and compare with (or, with ``update``, rewrite) its golden files.

    Args:
        root: The specs directory (``specs/``).
        update: Rewrite differing or missing golden files and remove stale ones instead of
            reporting them. Spec errors are reported either way, and when there is any the
            update changes nothing: a broken spec's golden files stay (they are not stale, the
            spec is), and so do every other spec's.

    Returns:
        The report; ``report.ok`` is the check's verdict.
    """
    from qeff_vision.compile.deployment import golden_commands  # it reads spec.deployment: import late

    root = Path(root)
    golden_root = root / GOLDEN_DIR
    report = GoldenReport(specs=find_specs(root))
    owners: dict[str, Path] = {}
    writes: dict[Path, str] = {}
    removals: list[Path] = []
    for spec_path in report.specs:
        try:
            spec = load_spec(spec_path)
        except SpecError as exc:
            report.problems += [f"{spec_path}: {problem}" for problem in exc.problems]
            continue
        if spec.name in owners:
            report.problems.append(f"{spec_path}: name {spec.name!r} is also used by {owners[spec.name]}")
            continue
        owners[spec.name] = spec_path
        files = build_specializations(spec).files()
        files[ACTIVATION_FILE] = activation_text(spec)  # what validate prints, per specialization
        if spec.deployment.table.vllm_forms:
            files[GOLDEN_FILE] = golden_serve_text(spec)  # the vLLM commands compile prints
        else:  # the programs' command lines (vLLM's forms for these modes are not generated yet)
            files[COMMANDS_FILE] = golden_commands(spec)
        spec_golden = golden_root / spec.name
        for relative, fresh in files.items():
            golden_path = spec_golden / relative
            golden = golden_path.read_text(encoding="utf-8") if golden_path.is_file() else None
            if golden == fresh:
                continue
            if update:
                writes[golden_path] = fresh
            elif golden is None:
                report.problems.append(f"{golden_path}: missing golden file for {spec_path}")
            else:
                report.diffs.append(_diff(golden_path, golden, fresh, spec_path))
        expected = {spec_golden / relative for relative in files}
        for stale in sorted(p for p in spec_golden.rglob("*") if p.is_file() and p not in expected):
            _stale(report, removals, stale, update, f"not generated from {spec_path}")
    if golden_root.is_dir():
        for directory in sorted(p for p in golden_root.iterdir() if p.name not in owners):
            _stale(report, removals, directory, update, "no spec has this name")
    if update and not report.problems:  # all or nothing: a spec that failed owns no golden now
        for path, text in writes.items():
            atomic_write_text(path, text)
            report.written.append(path)
        for path in removals:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            report.written.append(path)
    return report


def _stale(report: GoldenReport, removals: list[Path], path: Path, update: bool, reason: str) -> None:
    if update:
        removals.append(path)
    else:
        report.problems.append(f"{path}: stale golden ({reason})")
