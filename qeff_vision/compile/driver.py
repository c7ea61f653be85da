"""``compile SPEC -o OUT``: export if needed, specialize, then compile (or verify) both programs.

Layout of OUT::

    OUT/export/                     the export (unless --export DIR points elsewhere)
    OUT/vision/specializations.json, custom_io.yaml     compiler inputs (spec package writes them)
    OUT/vision/compile.log          everything the compiler printed
    OUT/vision/qpc-<key>/           programqpc.bin + qeff_program.json (the cache record, last)
    OUT/lang/...                    the same, plus mdp_partition.json when it spans devices
    OUT/manifest.json               written last: OUT is complete only when it exists

Which export is compiled and where each program's inputs go are decided by
:mod:`qeff_vision.compile.inputs`; this module runs the stages in order and writes the manifest.
Everything is written in a staging directory beside OUT (:func:`qeff_vision.fsutil.staged_directory`:
hard links to OUT's files, OUT's export used in place) that replaces OUT only when every stage
succeeded, under a lock beside OUT; the compilers' logs live in a temporary directory until then,
and stay there (named by the error) when a compiler fails. So a failed or interrupted compile
leaves OUT absent or byte for byte as it was. The two compilers run concurrently. With
``backend="onnxruntime"`` no compiler runs: every specialization is executed on the exported
graphs instead, and the manifest points at the ONNX files.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from qeff_vision.compile import cache
from qeff_vision.compile import sdk as sdk_lookup
from qeff_vision.compile.argv import (
    ProgramFiles,
    argv_without_paths,
    build_argv,
    format_command,
)
from qeff_vision.compile.backends import compile_backend
from qeff_vision.compile.inputs import (
    EXPORT_SUBDIR,
    Export,
    ProgramPlan,
    Progress,
    check_graphs,
    given_export,
    locate_export,
    plan_inputs,
    write_inputs,
)
from qeff_vision.compile.precision import resolve_plans
from qeff_vision.compile.runner import Job, JobResult, StatusLine, run_jobs
from qeff_vision.compile.sdk import SdkInfo, detect_sdk, find_compiler
from qeff_vision.compile_record import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    QAIC,
    relative_to,
    spec_hash,
    tool_name,
)
from qeff_vision.contract.attention_blocking import DEVICE_ITEM_BYTES
from qeff_vision.contract.tasks import is_pooling
from qeff_vision.errors import UserError
from qeff_vision.fsutil import (
    atomic_write_json,
    check_output_dir,
    disk_full_text,
    no_space_left,
    staged_directory,
)
from qeff_vision.hub import HubCheckpoint, hub_record
from qeff_vision.hub import cached as hub_cached
from qeff_vision.spec import build_specializations, load_spec, resolve_layout
from qeff_vision.spec.compile_options import ProgramOptions

LOG_FILE = "compile.log"

# Default of ``status_stream``: the sys.stderr of the call (tests and embedders replace it).
STDERR = object()


def _stderr(message: str) -> None:
    print(f"[qeff-vision] {message}", file=sys.stderr, flush=True)


class CompileFailed(UserError):
    """A compiler failed or timed out; ``tail`` holds the last lines of its log."""

    def __init__(self, message: str, tail: list[str], log_path: Path):
        super().__init__(message)
        self.tail = tail
        self.log_path = log_path


@dataclass
class CompileOutcome:
    """What ``compile_spec`` did.

    Attributes:
        out_dir: The output directory.
        backend: ``qaic`` or ``onnxruntime``.
        dry_run: Nothing was compiled.
        commands: Program -> shell command line (qaic backend).
        cached: Program -> reused from the cache.
        manifest: The manifest written (``None`` for a dry run).
        notes: Lines worth showing the user.
    """

    out_dir: Path
    backend: str
    dry_run: bool
    commands: dict[str, str] = field(default_factory=dict)
    cached: dict[str, bool] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    activation: list[str] = field(default_factory=list)  # one line per program and specialization


@dataclass
class _Run:
    """One :func:`compile_spec` call: what every stage after the inputs are written reads."""

    spec: Any
    spec_path: Path
    out_dir: Path  # the staging directory everything is written in
    final_dir: Path  # OUT, which the staging directory becomes
    export: Export
    sdk: SdkInfo | None
    manifest: dict
    outcome: CompileOutcome
    env: Mapping[str, str]
    say: Progress


def _timeout(options: ProgramOptions, override: float | None) -> float | None:
    return override if override is not None else options.timeout


def _copy_runtime_files(spec: Any, export: Export, out_dir: Path, outcome: CompileOutcome) -> str | None:
    """Copy the checkpoint's runtime files into OUT (spec's checkpoint, else the export's)."""
    from qeff_vision.compile.runtime_files import copy_first_checkpoint, set_image_processor_options

    recorded = (export.manifest or {}).get("model")
    copied = copy_first_checkpoint((spec.model_dir, recorded), out_dir)
    if copied is None:
        outcome.notes.append("no local checkpoint to copy into OUT; `run` needs the one the export names")
    elif spec.vision.image_processor:
        set_image_processor_options(out_dir / copied, dict(spec.vision.image_processor))
    return copied


def _recorded_hub(export: Export) -> dict[str, Any]:
    recorded = hub_record(export.manifest)
    return {"hub": recorded} if recorded else {}


def _common_manifest(
    spec: Any, out_dir: Path, export: Export, backend: str, sdk: SdkInfo | None, hub: HubCheckpoint | None
) -> dict:
    manifest = {
        "format": MANIFEST_FORMAT,
        "tool": tool_name(),
        "backend": backend,
        "model": spec.model,
        "model_dir": str(spec.model_dir.resolve()) if spec.model_dir else None,
        # The id and commit of the weights: this run's snapshot, else what a reused export recorded.
        **({"hub": hub.record()} if hub else _recorded_hub(export)),
        "family": spec.family,
        "spec": {"path": str(Path(spec.source).resolve()), "name": spec.name},
        "spec_hash": spec_hash(Path(spec.source), spec.config_path),
        "sdk": sdk.to_dict() if sdk else None,
        # The target (ai100 / ai200) and, for aic_hw_version: auto, what qaic-util said.
        "hardware": spec.compile.hardware_record(),
        "deployment": spec.deployment.mode,
        "kv_cache_prefix": spec.deployment.kv_cache_prefix,
        "export": {
            "dir": relative_to(export.directory, out_dir),
            "config_hash": (export.manifest or {}).get("config_hash"),
        },
        "shapes": {
            "batch_size": spec.batch_size,
            "ctx_len": spec.ctx_len,
            "prefill_seq_lens": list(spec.prefill.seq_lens),
            "images": [{"height": i.height, "width": i.width} for i in spec.vision.images if not i.video],
            "patch_buckets": list(spec.vision.patch_buckets),
            "max_images": spec.vision.max_images,
            "vision_size": str(spec.vision.vision_size),
            "specialization_layout": None,
        },
    }
    if spec.vision.video_pruning_rate:  # absent at 0: a manifest without pruning is unchanged
        manifest["shapes"]["video_pruning_rate"] = spec.vision.video_pruning_rate
    return manifest


def _program_entry(plan: ProgramPlan, out_dir: Path, path: Path) -> dict[str, Any]:
    return {
        "path": relative_to(path, out_dir),
        "onnx": relative_to(plan.onnx, out_dir),
        "specializations": plan.specializations,
        "specializations_file": relative_to(plan.specializations_file, out_dir),
        "custom_io_file": relative_to(plan.custom_io_file, out_dir) if plan.custom_io_file else None,
        "partition_file": relative_to(plan.partition_file, out_dir) if plan.partition_file else None,
        "options": plan.options.to_dict(),
        "node_precision": plan.precision.to_dict(lambda p: relative_to(p, out_dir))
        if plan.precision
        else None,
    }


def compile_spec(
    spec_path: str | Path,
    out_dir: str | Path,
    *,
    backend: str = QAIC,
    compiler: str | None = None,
    export_dir: str | Path | None = None,
    dry_run: bool = False,
    force: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    progress: Progress | None = _stderr,
    status_stream: Any = STDERR,
    revision: str | None = None,
) -> CompileOutcome:
    """Compile (or verify) both programs of ``spec_path`` into ``out_dir``.

    Args:
        spec_path: The YAML spec.
        out_dir: Output directory (see the module docstring for its layout).
        backend: ``qaic`` (the SDK compiler) or ``onnxruntime`` (run every specialization on CPU).
        compiler: Explicit compiler path (before ``QAIC_COMPILER`` and the SDK defaults).
        export_dir: Use this export instead of ``OUT/export``.
        dry_run: Write the compiler inputs and return the command lines; compile nothing.
        force: Rebuild programs even when the cache holds them.
        timeout: Seconds per program compile, overriding the spec's ``compile.*.timeout``.
        env: Environment for compiler lookup and the compiler processes.
        progress: One-line progress messages (``None`` for silence).
        status_stream: Where the live status line goes (``None`` for none; stderr by default).
        revision: Replaces the spec's ``revision:`` of a Hugging Face id.

    Raises:
        SpecError: The spec is invalid, or its specializations do not match the exported graphs.
        CompileFailed: A compiler failed or timed out (the message names its log).
        UserError: No compiler, no export possible, or a similar environment problem.
    """
    target = compile_backend(backend)
    say = progress or (lambda message: None)
    env = os.environ if env is None else env
    out_dir = check_output_dir(out_dir)
    spec = load_spec(spec_path, revision=revision, fetch_model=not dry_run)
    for warning in spec.warnings:
        say(f"warning: {warning}")
    # A Hub id as the cache holds it now (never the network): its commit decides whether an
    # export is stale. It is downloaded only when an export must run (inputs.locate_export).
    hub = hub_cached(spec.model, spec.revision) if spec.model_dir is None else None
    if hub is not None:  # from here on the spec's model is that snapshot of the cache
        spec = replace(spec, model_dir=hub.directory)
    # The SDK and the compiler as this module finds them (tests replace detect_sdk here).
    sdk, compiler_path = target.resolve_sdk(
        lambda: detect_sdk(compiler, env), lambda: find_compiler(compiler, env), dry_run
    )
    layout = resolve_layout(spec.layout, sdk.specialization_layout if sdk else None)
    generated = build_specializations(spec, layout=layout)
    outcome = CompileOutcome(out_dir, backend, dry_run)
    # Inputs are checked before OUT is touched: an export of another model or a corrupt graph
    # must not leave a fresh OUT (lock, specializations) behind, nor disturb a valid one.
    export = given_export(spec, Path(export_dir), hub) if export_dir else None
    if export is not None:
        plans = plan_inputs(generated, spec, out_dir, export)
        check_graphs(plans, str(spec_path), outputs_required=target.outputs_required)
    # OUT is built in a staging directory beside it (starting as hard links to the current OUT's
    # files, so cached programs are reused) and swapped in only when everything succeeded: a
    # failed or interrupted compile leaves OUT absent or exactly as it was.
    lock = partial(cache.output_lock, out_dir, say)
    shared = (EXPORT_SUBDIR,)  # read in place (onnx refuses hard-linked external data); replaced if stale
    with staged_directory(out_dir, start_from_final=True, shared=shared, lock=lock) as staging:
        say = (lambda message: progress(_as_out(message, staging, out_dir))) if progress else say
        if export is None:
            export = locate_export(
                spec, staging, None, dry_run=dry_run, say=say, hub=hub, quiet=progress is None
            )
            if export.hub is not None:  # the export just ran from a snapshot it downloaded
                hub, spec = export.hub, replace(spec, model_dir=export.hub.directory)
            plans = write_inputs(generated, spec, staging, export)
            if export.manifest is not None:
                check_graphs(plans, str(spec_path), outputs_required=target.outputs_required)
        else:
            plans = write_inputs(generated, spec, staging, export)
        # Before the calibration runs: a graph over the bound is refused without minutes of work.
        activation = _activation_memory(plans, spec, export, outcome, say)
        outcome.notes += resolve_plans(
            plans, spec, export.directory, export.manifest, dry_run=dry_run, say=say
        )
        manifest = _common_manifest(spec, staging, export, backend, sdk, hub)
        if activation is not None:
            manifest["activation_memory"] = activation
        if not dry_run:
            manifest["runtime_model"] = _copy_runtime_files(spec, export, staging, outcome)
        manifest["shapes"]["specialization_layout"] = layout
        run = _Run(spec, Path(spec_path), staging, out_dir, export, sdk, manifest, outcome, env, say)
        if target.verifies_on_host:
            _verify(run, plans)
        else:
            _compile(run, plans, compiler_path, force=force, timeout=timeout, status_stream=status_stream)
        if not dry_run:
            atomic_write_json(staging / MANIFEST_FILE, manifest)
            outcome.manifest = manifest
        outcome.notes = [_as_out(note, staging, out_dir) for note in outcome.notes]
    return outcome


def _activation_memory(plans, spec: Any, export: Export, outcome: CompileOutcome, say=None) -> dict | None:
    """Measure every specialization's activation memory on the graphs; refuse one above the bound.

    Nothing to measure before an export exists (a dry run of a spec never exported). Shape
    inference on a full-depth graph takes seconds per specialization: progress goes to ``say``.

    Raises:
        UserError: A largest intermediate exceeds ``compile.max_activation_bytes``.
    """
    from qeff_vision.compile.activation_memory import bound_problem, measure_plans, report_lines

    if export.manifest is None:
        return None
    from qeff_vision.progress import StageProgress

    count = sum(len(plan.specializations) for plan in plans.values())
    with StageProgress("activation memory", count, unit="specializations", say=say) as stage:
        measured = measure_plans(plans, on_done=stage.update)
    outcome.activation = report_lines(measured)
    bound = spec.compile.max_activation_bytes
    problem = bound_problem(measured, bound)
    if problem:
        raise UserError(problem)
    return {"bound": bound, "device_item_bytes": DEVICE_ITEM_BYTES, "programs": measured}


def _as_out(text: str, staging: Path, out_dir: Path) -> str:
    """``text`` (a message, a compiler argument) with the staging directory written as OUT."""
    return text.replace(str(staging), str(out_dir))


def _verify(run: _Run, plans: Mapping[str, ProgramPlan]) -> None:
    """Run every specialization of both programs once on onnxruntime; record them in the manifest."""
    from qeff_vision.compile.onnxruntime_backend import verify_program
    from qeff_vision.numerics.device import MxEmulation

    programs = {}
    for plan in plans.values():
        if run.outcome.dry_run:
            run.outcome.notes.append(
                f"{plan.program}: would run {len(plan.specializations)} specialization(s) of {plan.onnx}"
            )
            continue
        if plan.precision and plan.precision.overflow:
            raise UserError(plan.precision.overflow.describe(plan.program, "on the calibration prompts"))
        start = time.perf_counter()
        checks = verify_program(
            plan.program,
            plan.onnx,
            plan.symbol_values(),
            source=str(run.spec_path),
            progress=run.say,
            device_values=plan.precision.device_values if plan.precision else None,
            mx=MxEmulation.from_options(
                plan.options.mxfp6_matmul, plan.options.kv_cache_dtype, plan.options.state_dtype
            ),
            image_sizes=plan.image_sizes(),
        )
        entry = _program_entry(plan, run.out_dir, plan.onnx)
        entry["verification"] = {
            "seconds": round(time.perf_counter() - start, 3),
            "runs": [check.to_dict() for check in checks],
        }
        for spec_entry, check in zip(entry["specializations"], checks):
            spec_entry["latency_ms"] = round(check.latency_ms, 3)
        programs[plan.program] = entry
    run.manifest["programs"] = programs
    run.manifest["vllm"] = {"available": False, "reason": "onnxruntime backend: there are no QPCs to serve"}


def _compile(
    run: _Run,
    plans: Mapping[str, ProgramPlan],
    compiler_path: Path | None,
    *,
    force: bool,
    timeout: float | None,
    status_stream: Any,
) -> None:
    """Compile the programs the cache does not hold, concurrently; record them in the manifest."""
    sdk, outcome = run.sdk, run.outcome
    compiler_name = sdk.compiler_name if sdk and sdk.compiler else "qaic-exec"
    argv0 = compiler_path or sdk_lookup.DEFAULT_COMPILERS[0]
    hasher = cache.ContentHasher(run.out_dir / cache.HASH_MEMO_FILE, root=run.out_dir, say=run.say)
    jobs, records, entries, binary_dirs = [], {}, {}, {}
    for plan in plans.values():
        if plan.precision and plan.precision.overflow:
            outcome.notes.append(
                "warning: " + plan.precision.overflow.describe(plan.program, "on the calibration prompts")
            )
        key, key_inputs, job_argv, binary_dir = _program_command(run, plan, argv0, compiler_name, hasher)
        argv = [_as_out(a, run.out_dir, run.final_dir) for a in job_argv]  # what OUT's files will say
        outcome.commands[plan.program] = format_command(argv)
        entry = _program_entry(plan, run.out_dir, binary_dir)
        entry.update(argv=argv, cache_key=key, log=relative_to(plan.directory / LOG_FILE, run.out_dir))
        entries[plan.program] = entry
        binary_dirs[plan.program] = binary_dir
        records[plan.program] = {"program": plan.program, "key": key, "key_inputs": key_inputs, "argv": argv}
        if outcome.dry_run:
            continue
        if not force and cache.cached_program(binary_dir, key) is not None:
            run.say(f"{plan.program}: cached ({run.final_dir / relative_to(binary_dir, run.out_dir)})")
            outcome.cached[plan.program] = True
            entry["cached"] = True
            continue
        cache.discard(binary_dir)  # stale, forced, or a leftover (links to OUT's files: OUT keeps them)
        outcome.cached[plan.program] = False
        entry["cached"] = False
        jobs.append(
            Job(plan.program, job_argv, Path(plan.program) / LOG_FILE, _timeout(plan.options, timeout))
        )
    hasher.save()
    if outcome.dry_run:
        if run.export.manifest is None:
            outcome.notes.append(
                "the ONNX files are not exported yet: each qpc-<hash> directory is named by the content "
                "hash of its inputs, known after export"
            )
        if compiler_path is None:
            outcome.notes.append(f"no SDK compiler found; the command lines show {argv0}")
        return
    if jobs:
        _run_compilers(run, jobs, binary_dirs, records, entries, status_stream)
    run.manifest["programs"] = entries
    run.manifest["vllm"] = _handoff(run.spec, run.manifest, entries)


def _run_compilers(run: _Run, jobs: list[Job], binary_dirs, records, entries, status_stream: Any) -> None:
    """Run the compilers with their logs in a temporary directory outside OUT.

    On success the logs move into the staging directory beside their programs. When a compiler
    fails, the logs stay where they are (the error names them) and the staging directory goes:
    OUT keeps the logs that describe its own programs. Ctrl-C removes them too.
    """
    logs = Path(tempfile.mkdtemp(prefix=f"qeff-vision-compile-{run.final_dir.name}-"))
    jobs = [replace(job, log_path=logs / job.log_path) for job in jobs]
    try:
        stream = sys.stderr if status_stream is STDERR else status_stream  # resolved now, not at import
        results = run_jobs(jobs, StatusLine(stream), run.env)
        _finish(results, jobs, binary_dirs, records, entries, run.final_dir)
    except CompileFailed:
        raise
    except BaseException:
        shutil.rmtree(logs, ignore_errors=True)
        raise
    for job in jobs:
        target = run.out_dir / job.program / LOG_FILE
        target.unlink(missing_ok=True)  # a link to OUT's log: replace it, never write into it
        shutil.move(job.log_path, target)
    shutil.rmtree(logs, ignore_errors=True)


def _program_command(run: _Run, plan: ProgramPlan, argv0, compiler_name: str, hasher) -> tuple:
    """(cache key, its inputs, compiler argv, binary directory) of one program."""
    sdk, exported = run.sdk, run.export.manifest is not None
    hw_version = sdk.hw_version_flag_value(plan.options.aic_hw_version) if sdk else None
    plan_file = plan.precision.path if plan.precision else None
    # A pooling language program (task embed/score) keeps nothing on the device between calls.
    retained = False if is_pooling(run.spec.task) else None
    key_inputs = {
        "onnx": hasher.onnx(plan.onnx) if exported else None,
        "argv": argv_without_paths(
            plan.program,
            plan.options,
            has_custom_io=plan.custom_io_file is not None,
            compiler_name=compiler_name,
            hw_version=hw_version,
            has_plan=plan_file is not None,
            retained_state=retained,
        ),
        "specializations": plan.specializations_file.read_text(encoding="utf-8"),
        "node_precision": plan_file.read_text(encoding="utf-8") if plan_file else None,
        "custom_io": plan.custom_io_file.read_text(encoding="utf-8") if plan.custom_io_file else None,
        "partition": plan.partition_file.read_text(encoding="utf-8") if plan.partition_file else None,
        "sdk_version": sdk.version if sdk else None,
    }
    key = cache.program_key(key_inputs)
    binary_dir = plan.directory / (cache.binary_dir_name(key) if exported else "qpc-<hash>")
    files = ProgramFiles(
        plan.onnx, plan.specializations_file, plan.custom_io_file, plan.partition_file, binary_dir, plan_file
    )
    argv = build_argv(
        argv0,
        plan.program,
        files,
        plan.options,
        compiler_name=compiler_name,
        hw_version=hw_version,
        retained_state=retained,
    )
    return key, key_inputs, argv, binary_dir


def _handoff(spec: Any, manifest: Mapping[str, Any], entries: Mapping[str, dict]) -> dict:
    """The vLLM hand-off block of the manifest for compiled QPCs (paths relative to OUT)."""
    from qeff_vision.compile.vllm_handoff import handoff_for_spec

    model = manifest.get("runtime_model")
    if not spec.deployment.table.vllm_forms:
        return {
            "available": False,
            "reason": f"deployment {spec.deployment.mode}: no vLLM serve form generated yet",
        }
    return handoff_for_spec(spec, entries["vision"]["path"], entries["lang"]["path"], model)


def _finish(results: Mapping[str, JobResult], jobs, binary_dirs, records, entries, final_dir: Path) -> None:
    """Record every program (the record is its last write), or raise for the first failure."""
    failures = [result for result in results.values() if not result.ok]
    if failures:
        first = next((r for r in failures if r.state in ("failed", "timeout", "error")), failures[0])
        timeout = next(job.timeout for job in jobs if job.program == first.program)
        message = first.describe(timeout)
        if any(disk_full_text(line) for line in first.tail) or no_space_left(binary_dirs[first.program]):
            # The compiler wrote into OUT's staging directory until the disk filled: say that first
            # (the one guard's wording, fsutil.staged_directory), the log says how it failed.
            message = f"{final_dir}: no space left on device while compiling ({message})"
        raise CompileFailed(message, first.tail, first.log_path)
    for job in jobs:
        binary_dir = binary_dirs[job.program]
        if not (binary_dir / cache.QPC_FILE).is_file():
            raise CompileFailed(
                f"{job.program}: the compiler exited 0 but wrote no {cache.QPC_FILE} (log: {job.log_path})",
                results[job.program].tail,
                job.log_path,
            )
        entries[job.program]["compile_seconds"] = round(results[job.program].seconds, 3)
        cache.write_record(binary_dir, records[job.program])
