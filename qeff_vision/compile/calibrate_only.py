"""The precision plans of a spec over an export, alone: the calibration a compile runs, nothing compiled.

Apart from :mod:`qeff_vision.compile.precision` because it plans the spec's programs
(:mod:`qeff_vision.compile.inputs`), which import the plan type from there: one direction only.
"""

from __future__ import annotations

from pathlib import Path

from qeff_vision.compile.inputs import given_export, plan_inputs
from qeff_vision.compile.precision import PrecisionPlan, resolve_plans


def calibrate(spec_path: Path, export_dir: Path, out_dir: Path, say=None) -> dict[str, PrecisionPlan]:
    """The precision plan of every program of a spec over an export, as ``compile`` resolves it.

    Only the calibration runs (prompts through the runtime, the generated input of every
    specialization); nothing is compiled or verified. The plans and their records are written
    under ``out_dir/<program>/`` as ``compile`` writes them (benchmarks/calibration_memory.py).
    """
    from qeff_vision.spec import build_specializations, load_spec

    spec = load_spec(spec_path)
    export = given_export(spec, Path(export_dir))
    plans = plan_inputs(build_specializations(spec, layout="flat"), spec, Path(out_dir), export)
    resolve_plans(plans, spec, export.directory, export.manifest, dry_run=False, say=say or (lambda _: None))
    return {name: plan.precision for name, plan in plans.items()}
