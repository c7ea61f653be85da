"""The precision plan of each program: resolved from ``compile.node_precision`` and written under OUT.

``auto`` (the default when converting to fp16) runs the fp32 graph once per specialization on
calibration inputs and keeps in fp32 what would leave fp16's range
(:func:`qeff_vision.numerics.plan.auto_plan`); ``none`` passes no plan; a path is a plan file in
the compiler's format, checked against the graph's node outputs. The plan the compiler reads is
always ``OUT/<program>/node_precision.yaml`` (absent when nothing needs fp32), and its hash is part
of the program's cache key and manifest entry, so a changed plan recompiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.compile.graph_io import read_graph_io
from qeff_vision.compile.onnxruntime_backend import bound_shape, generated_input
from qeff_vision.numerics.device import Bf16Values
from qeff_vision.numerics.layer_functions import expanded_plan, folded_plan, load_flat_graph
from qeff_vision.numerics.plan import (
    PLAN_FILE,
    Overflow,
    auto_plan,
    check_plan_names,
    first_overflow,
    non_matmul_outputs,
    plan_hash,
    read_plan,
    value_ranges,
    write_plan,
)
from qeff_vision.spec.compile_options import (
    DEFAULT_MAX_PROMPT_TOKENS,
    NODE_PRECISION_AUTO,
    NODE_PRECISION_NONE,
    ProgramOptions,
)
from qeff_vision.spec.hardware import AI200

# The plan mode of a program the device computes in bfloat16 (ai200).
BF16 = "bf16"


@dataclass
class PrecisionPlan:
    """One program's plan.

    Attributes:
        mode: ``auto``, ``none``, ``path``, ``fp32`` (no ``-convert-to-fp16``: nothing to plan) or
            ``bf16`` (ai200 computes bfloat16, fp32's range: nothing to plan, no calibration).
        path: The plan file the compiler reads, or ``None`` when there is none.
        names: Node outputs kept in fp32 (``None`` for a dry run of ``auto``: not computed).
        non_matmul_outputs: Size of the "every non-matmul output" plan, for comparison.
        source: The user's plan file (mode ``path``).
        overflow: For a plan not computed here (``none`` or a path), the first node output outside
            it that the calibration prompts drove beyond fp16's range.
    """

    mode: str
    path: Path | None = None
    names: list[str] | None = field(default_factory=list)
    non_matmul_outputs: int | None = None
    source: Path | None = None
    overflow: Overflow | None = None

    @property
    def device_values(self) -> list[str] | None:
        """What device-precision sessions keep in fp32; ``None`` when the program runs in fp32.

        On ai200 (``bf16``) a :class:`~qeff_vision.numerics.device.Bf16Values`: nothing kept fp32,
        every value rounded to bfloat16.
        """
        if self.mode == BF16:
            return Bf16Values()
        return None if self.mode == "fp32" else list(self.names or [])

    def to_dict(self, relative) -> dict[str, Any]:
        """Manifest entry; ``relative`` maps a path to its manifest spelling."""
        return {
            "mode": self.mode,
            "path": relative(self.path) if self.path else None,
            "sha256": plan_hash(self.path) if self.path and self.path.is_file() else None,
            "nodes": None if self.names is None else len(self.names),
            "non_matmul_outputs": self.non_matmul_outputs,
        }


def calibration_feeds(
    onnx_path: Path,
    specializations: Sequence[Mapping[str, int]],
    seed: int = 0,
    image_sizes: Sequence[tuple[int, int] | None] | None = None,
):
    """One generated input set per specialization (the shapes the program is compiled for).

    ``image_sizes``: per specialization, the image it was built from (see ``generated_input``).
    """
    graph = read_graph_io(onnx_path)
    rng = np.random.default_rng(seed)
    for index, values in enumerate(specializations):
        where = f"calibration of specialization {index}"
        slots = int(values.get(symbols.FULL_BATCH_SIZE, 0))
        image_size = image_sizes[index] if image_sizes else None
        yield {
            tensor.name: generated_input(tensor, bound_shape(tensor, values, where), rng, slots, image_size)
            for tensor in graph.inputs
        }


def resolve_plan(
    onnx_path: Path,
    options: ProgramOptions,
    specializations: Sequence[Mapping[str, int]],
    directory: Path,
    spec_dir: Path,
    *,
    exported: bool,
    dry_run: bool,
    prompt_ranges: Mapping[str, float] | None = None,
    image_sizes: Sequence[tuple[int, int] | None] | None = None,
    on_slice=None,
    generated_included: bool = False,
) -> PrecisionPlan:
    """Write (or remove) ``directory/node_precision.yaml`` for this program and describe the plan.

    A dry run (or a run before export) computes nothing: an ``auto`` plan keeps the file a previous
    compile wrote, if any. A user's plan is checked against the graph when it is exported.
    ``prompt_ranges`` (from :func:`qeff_vision.compile.calibration.prompt_ranges`) join the ranges
    of the generated per-specialization inputs (``image_sizes``: each one's image, if any), unless
    ``generated_included``: those inputs were recorded in the prompts' pass already.
    """
    target = directory / PLAN_FILE
    if options.aic_hw_version == AI200:
        target.unlink(missing_ok=True)
        return PrecisionPlan(BF16)
    if not options.convert_to_fp16:
        target.unlink(missing_ok=True)
        return PrecisionPlan("fp32")
    if options.node_precision == NODE_PRECISION_NONE:
        target.unlink(missing_ok=True)
        return _checked(PrecisionPlan(NODE_PRECISION_NONE), onnx_path, prompt_ranges)
    if options.node_precision == NODE_PRECISION_AUTO:
        if dry_run or not exported:
            return PrecisionPlan(NODE_PRECISION_AUTO, target if target.is_file() else None, None)
        generated = None if generated_included else (specializations, image_sizes)
        return _auto(onnx_path, target, prompt_ranges or {}, generated, on_slice)
    source = Path(options.node_precision)
    source = source if source.is_absolute() else spec_dir / source
    names = read_plan(source)
    if exported:
        import onnx

        model = onnx.load(str(onnx_path), load_external_data=False)
        check_plan_names(model, names, str(source))
    write_plan(target, names)
    return _checked(PrecisionPlan("path", target, names, source=source), onnx_path, prompt_ranges)


def _checked(plan: PrecisionPlan, onnx_path: Path, ranges: Mapping[str, float] | None) -> PrecisionPlan:
    """Record the first node outside a given plan that calibration saw beyond fp16's range."""
    if ranges:
        model = load_flat_graph(onnx_path)  # the ranges name each layer call's values apart
        plan.overflow = first_overflow(model, ranges, expanded_plan(model, plan.names or []))
    return plan


def _auto(
    onnx_path: Path,
    target: Path,
    prompt_ranges: Mapping[str, float],
    generated=None,
    on_slice=None,
) -> PrecisionPlan:
    """The ``auto`` plan; ``generated`` (specializations, image sizes): their inputs' pass to run."""
    model = load_flat_graph(onnx_path)  # every call of a layer function calibrated on its own
    ranges: dict[str, float] = {}
    if generated is not None:  # every specialization's generated input in one pass over the slices
        specializations, image_sizes = generated
        feeds = calibration_feeds(onnx_path, specializations, image_sizes=image_sizes)
        ranges = value_ranges(model, onnx_path.parent, feeds, on_slice)
    for name, peak in prompt_ranges.items():
        ranges[name] = max(ranges.get(name, 0.0), peak)
    # A layer function's value is kept for every call when one call needs it (one compiled body).
    names = folded_plan(auto_plan(model, ranges))
    if names:
        write_plan(target, names)
    else:
        target.unlink(missing_ok=True)
    return PrecisionPlan(NODE_PRECISION_AUTO, target if names else None, names, non_matmul_outputs(model))


def resolve_plans(
    plans: Mapping[str, Any],
    spec: Any,
    export_dir: Path,
    export_manifest: Mapping[str, Any] | None,
    *,
    dry_run: bool,
    say,
) -> list[str]:
    """Set ``plan.precision`` of every program (an inputs ``ProgramPlan``); return lines for the user.

    Programs converted to fp16 are calibrated once for both: prompts through the runtime
    (:mod:`qeff_vision.compile.calibration`) when the export's checkpoint is here, plus, for ``auto``,
    the generated inputs of every specialization. A plan not computed here (``none``, a path) is
    checked against the prompts' ranges (``PrecisionPlan.overflow``).
    """
    exported = export_manifest is not None
    spec_dir = Path(spec.source).resolve().parent
    calibrated = [p for p in plans.values() if p.options.convert_to_fp16 and exported and not dry_run]
    keys = _calibration_keys(calibrated, spec, spec_dir, say)
    reused = {p.program: _reuse(p, keys[p.program]) for p in calibrated}
    prompts: dict[str, dict[str, float]] = {}
    included: set[str] = set()
    stage = None
    if any(found is None for found in reused.values()):
        from qeff_vision.progress import SliceCounter, StageProgress

        say("calibrating device precision: fp32 runs with every node output recorded")
        stage = StageProgress("calibration", 0, unit="slices", say=say)
        counter = SliceCounter(stage)
        try:
            auto = {name for name, found in reused.items() if found is None and _is_auto(plans[name])}
            prompts, included = _prompt_ranges(plans, spec, export_dir, export_manifest, say, counter, auto)
        except BaseException:
            stage.close()
            raise
    try:
        notes = _resolved_notes(plans, reused, keys, spec_dir, exported, dry_run, prompts, stage, included)
    finally:
        if stage is not None:
            stage.close()
    return notes


def _resolved_notes(plans, reused, keys, spec_dir, exported, dry_run, prompts, stage, included) -> list[str]:
    """Resolve each program's plan not reused (its generated inputs' pass unless ``included``)."""
    from qeff_vision.progress import SliceCounter

    counter = SliceCounter(stage) if stage is not None else None
    notes = []
    for plan in plans.values():
        precision = reused.get(plan.program)
        if precision is None:
            precision = resolve_plan(
                plan.onnx,
                plan.options,
                plan.symbol_values(),
                plan.directory,
                spec_dir,
                exported=exported,
                dry_run=dry_run,
                prompt_ranges=prompts.get(plan.program),
                image_sizes=plan.image_sizes(),
                on_slice=counter,
                generated_included=plan.program in included,
            )
            if plan.program in keys:
                _remember(plan.directory, keys[plan.program], precision)
        plan.precision = precision
        if precision.mode == BF16:
            notes.append(
                f"{plan.program}: ai200 computes bfloat16, which has fp32's range: no precision plan "
                "and no calibration run"
            )
            continue
        if precision.mode in ("fp32", NODE_PRECISION_NONE):
            continue
        target = precision.path or plan.directory / PLAN_FILE
        if precision.names is None:
            notes.append(
                f"{plan.program}: node precision plan {target} ({precision.mode}: computed from "
                "calibration runs when compiling; no flag when no node needs fp32)"
            )
            continue
        kept = f"{len(precision.names)} node output(s) kept in fp32"
        if precision.non_matmul_outputs is not None:
            kept += f" (every non-matmul output would be {precision.non_matmul_outputs})"
        notes.append(
            f"{plan.program}: node precision plan {target if precision.path else '(none needed)'}: {kept}"
        )
    return notes


def _is_auto(plan) -> bool:
    """Whether ``plan``'s program gets an ``auto`` plan computed here (its generated inputs run)."""
    options = plan.options
    return (
        options.aic_hw_version != AI200
        and options.convert_to_fp16
        and options.node_precision == NODE_PRECISION_AUTO
    )


def _prompt_ranges(
    plans, spec, export_dir: Path, export_manifest, say, on_slice=None, auto=frozenset()
) -> tuple[dict[str, dict[str, float]], set[str]]:
    """Calibration prompts through the runtime (needs the checkpoint's processor; else none).

    The generated inputs of the programs in ``auto`` join the prompts' pass over their graph
    where that graph is the one the prompts run (not a renamed copy, not shared by two programs);
    also returned: the programs whose generated inputs were recorded so.
    """
    from qeff_vision.compile.calibration import prompt_ranges
    from qeff_vision.errors import UserError

    model = export_manifest.get("model")
    if not model or not (Path(model) / "config.json").is_file():
        return {}, set()
    if "vision" not in plans:
        # deployment single: one composed program; its plan comes from the generated inputs of
        # every specialization (encode ones run the tower), not from prompts through two programs.
        return {}, set()
    calibration = spec.compile.calibration
    spec_dir = Path(spec.source).resolve().parent
    images = [spec_dir / image for image in calibration.images] if calibration else []
    for image in images:
        if not image.is_file():
            raise UserError(f"compile.calibration.images: {image} does not exist")
    # A disaggregated deployment's two language programs are one graph: calibrate it once with
    # both programs' specializations, and give each the ranges.
    languages = [plan for name, plan in plans.items() if name != "vision"]
    generated, included = {}, set()
    graphs = {key: export_dir / entry["path"] for key, entry in export_manifest["programs"].items()}
    for key, plan in [("vision", plans["vision"]), *(("lang", p) for p in languages if len(languages) == 1)]:
        if plan.program in auto and Path(plan.onnx).resolve() == graphs.get(key, Path()).resolve():
            generated[key] = list(
                calibration_feeds(plan.onnx, plan.symbol_values(), image_sizes=plan.image_sizes())
            )
            included.add(plan.program)
    ranges = prompt_ranges(
        export_dir,
        plans["vision"].symbol_values(),
        [values for plan in languages for values in plan.symbol_values()],
        [(image.height, image.width) for image in spec.vision.images if not image.video],  # stills only
        images=images,
        prompts=list(calibration.prompts) if calibration else [],
        max_prompt_tokens=calibration.max_prompt_tokens if calibration else DEFAULT_MAX_PROMPT_TOKENS,
        say=say,
        processor_options=dict(spec.vision.image_processor),
        on_slice=on_slice,
        generated=generated,
    )
    language = ranges["lang"]
    prefix = spec.deployment.kv_cache_prefix
    if prefix:  # the programs compile the renamed copy: its KV outputs carry the prefix
        from qeff_vision.contract.slot_names import with_kv_prefix_name

        language = {with_kv_prefix_name(name, prefix): value for name, value in language.items()}
    return {"vision": ranges["vision"], **{plan.program: language for plan in languages}}, included


# What a calibration found, next to the plan: reused while its inputs are unchanged, so a cached
# compile does not run the fp32 graphs again.
RECORD_FILE = "node_precision.record.json"


def _calibration_keys(plans, spec, spec_dir: Path, say=None) -> dict[str, str]:
    """Per program, a hash of everything a calibration result depends on."""
    from qeff_vision import __version__
    from qeff_vision.compile import cache
    from qeff_vision.numerics.plan import SAFETY_MARGIN
    from qeff_vision.numerics.recording import MASK_SENTINEL

    if not plans:
        return {}
    out_dir = plans[0].directory.parent  # OUT's staging directory: memo paths relative to it
    hasher = cache.ContentHasher(out_dir / cache.HASH_MEMO_FILE, root=out_dir, say=say)
    calibration = spec.compile.calibration
    images = [spec_dir / image for image in calibration.images] if calibration else []
    common = {
        "tool": __version__,
        "rule": [SAFETY_MARGIN, MASK_SENTINEL],
        "resolutions": [[image.height, image.width] for image in spec.vision.images if not image.video],
        "images": [hasher.file(image) if image.is_file() else str(image) for image in images],
        "prompts": list(calibration.prompts) if calibration else [],
        "max_prompt_tokens": calibration.max_prompt_tokens if calibration else DEFAULT_MAX_PROMPT_TOKENS,
        "onnx": {p.program: hasher.onnx(p.onnx) for p in plans},
    }
    keys = {}
    for plan in plans:
        mode = plan.options.node_precision
        user_plan = None
        if mode not in (NODE_PRECISION_AUTO, NODE_PRECISION_NONE):
            source = Path(mode) if Path(mode).is_absolute() else spec_dir / mode
            user_plan = hasher.file(source) if source.is_file() else str(source)
        keys[plan.program] = cache.program_key(
            {**common, "specializations": plan.specializations, "mode": mode, "user_plan": user_plan}
        )
    hasher.save()
    return keys


def _remember(directory: Path, key: str, precision: PrecisionPlan) -> None:
    from qeff_vision.compile import plan_store
    from qeff_vision.fsutil import atomic_write_json

    overflow = precision.overflow
    record = {
        "key": key,
        "mode": precision.mode,
        "names": precision.names,
        "non_matmul_outputs": precision.non_matmul_outputs,
        "overflow": [overflow.node, overflow.output, overflow.peak] if overflow else None,
        "source": str(precision.source) if precision.source else None,
    }
    atomic_write_json(directory / RECORD_FILE, record)
    plan_store.save(key, record)


def _reuse(plan, key: str) -> PrecisionPlan | None:
    """The recorded result when its key matches and the plan file it wrote is still there.

    Without one in OUT, a record of the same key in the plan store (another OUT's calibration of
    the same program) writes the plan file and OUT's record again.
    """
    from qeff_vision.compile import plan_store
    from qeff_vision.fsutil import atomic_write_json, read_record_json

    target = plan.directory / PLAN_FILE
    record = read_record_json(plan.directory / RECORD_FILE)
    names = record.get("names") if record else None
    if record is None or record.get("key") != key or names is None or (bool(names) and not target.is_file()):
        record = plan_store.load(key)
        names = record.get("names") if record else None
        if record is None or not isinstance(names, list):
            return None
        plan.directory.mkdir(parents=True, exist_ok=True)
        if names:
            write_plan(target, names)
        else:
            target.unlink(missing_ok=True)
        atomic_write_json(plan.directory / RECORD_FILE, record)
    if names and read_plan(target) != names:
        return None
    overflow = Overflow(*record["overflow"]) if record.get("overflow") else None
    source = Path(record["source"]) if record.get("source") else None
    return PrecisionPlan(
        record["mode"], target if names else None, names, record.get("non_matmul_outputs"), source, overflow
    )
