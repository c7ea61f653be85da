"""What a compile reads and writes before any compiler runs: the export and each program's inputs.

:func:`locate_export` finds the export to compile (``--export DIR``, checked against the spec, or
``OUT/export``, exported now when absent or stale); :func:`plan_inputs` says where each program's
compiler inputs go under OUT (:class:`ProgramPlan`), :func:`write_inputs` writes them and
:func:`check_graphs` checks the specializations against the exported graphs. The compile driver
(:mod:`qeff_vision.compile.driver`) runs the compilers on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qeff_vision.compile.argv import PARTITION_FILE_NAME, mdp_partition_config
from qeff_vision.compile.graph_io import read_graph_io, symbol_problems
from qeff_vision.compile.precision import PrecisionPlan
from qeff_vision.compile.single_program import SINGLE_FILE, single_program_path
from qeff_vision.compile_record import MANIFEST_FILE
from qeff_vision.contract.attention_blocking import AttentionBlocking, for_spec
from qeff_vision.contract.tasks import GENERATE
from qeff_vision.errors import SpecError, UserError
from qeff_vision.export_record import (
    EXPORT_FILE,
    PATCH_BUCKETS,
    config_hash,
    read_export,
    recorded_symbols,
    vision_mode,
)
from qeff_vision.fsutil import atomic_write_json
from qeff_vision.hub import HubCheckpoint, hub_record
from qeff_vision.spec import write_specializations
from qeff_vision.spec.compile_options import LANGUAGE, VISION, ProgramOptions

EXPORT_SUBDIR = "export"
# Section name in the spec's compile: block -> directory under OUT (and key in export.json).
SECTIONS = {VISION: "vision", LANGUAGE: "lang"}

Progress = Callable[[str], None]


@dataclass
class ProgramPlan:
    """One program's inputs, as written under OUT."""

    program: str  # directory name: vision | lang
    section: str  # compile: section name: vision | language
    options: ProgramOptions
    directory: Path
    onnx: Path
    specializations: list[dict[str, Any]]  # [{"name", "symbols"}], symbols as the file has them
    specializations_file: Path
    custom_io_file: Path | None
    partition_file: Path | None
    precision: PrecisionPlan | None = None
    # The export's graph ``onnx`` is derived from (a kv_cache_prefix copy), written after the checks.
    source_onnx: Path | None = None

    def symbol_values(self) -> list[dict[str, int]]:
        """Specializations as symbol -> int."""
        return [{k: int(v) for k, v in entry["symbols"].items()} for entry in self.specializations]

    def image_sizes(self) -> list[tuple[int, int] | None]:
        """Per specialization, the (height, width) of the image it was built from (None: no image)."""
        from qeff_vision.spec.specializations import specialization_image_size

        return [specialization_image_size(entry.get("name", "")) for entry in self.specializations]


@dataclass
class Export:
    """The export a compile reads: its directory and its ``export.json``."""

    directory: Path
    manifest: dict[str, Any] | None  # None: not exported yet (dry run)
    hub: HubCheckpoint | None = None  # the snapshot this compile downloaded and exported, if any

    def onnx(self, program: str) -> Path:
        """The ONNX file of ``program`` (``vision`` or ``lang``); its future path before export."""
        if self.manifest is None:
            return self.directory / program / "model.onnx"
        return self.directory / self.manifest["programs"][program]["path"]


def _run_export(
    model_dir: Path,
    directory: Path,
    say: Progress | None,
    ccl: bool,
    buckets: bool,
    cb: bool,
    full_kv: bool,
    sampler,
    hub: HubCheckpoint | None,
    blocking: AttentionBlocking,
    spec: Any = None,
) -> dict[str, Any]:
    from qeff_vision.exporter import export_model

    if hub is not None:  # the weights come down only when an export needs them
        if say is not None:  # a log shows why nothing else moves for minutes
            say(f"weights: {hub.repo_id} commit {hub.commit[:12]}, downloading what the cache lacks")
        hub.with_weights(quiet=say is None)
    return export_model(
        model_dir,
        directory,
        force=True,
        comp_ctx_lengths=ccl,
        patch_buckets=buckets,
        continuous_batching=cb,
        retain_full_kv=full_kv,
        sampler=sampler,
        progress=say,
        hub=hub.record() if hub else None,
        # How the spec stores weights (its ``weights`` key and compile dtype); float32 without a spec.
        weight_dtype=spec.weight_dtypes() if spec is not None else "float32",
        keep_quantized=spec.weights.keep_quantized if spec is not None else False,
        attention_blocking=blocking,
        task=spec.task if spec is not None else GENERATE,
        subfunctions=spec.compile.language.subfunctions if spec is not None else False,
    ).manifest


def weights_of(spec: Any) -> dict[str, dict]:
    """The export manifest's record of how the spec wants weights stored, per program."""
    keep = spec.weights.keep_quantized
    return {program: {"dtype": d, "keep_quantized": keep} for program, d in spec.weight_dtypes().items()}


def recorded_weights(manifest: Mapping[str, Any]) -> dict[str, dict]:
    """How an export stored its weights (an export from before the ``weights`` record: float32)."""
    plain = {"dtype": "float32", "keep_quantized": False}
    return manifest.get("weights") or {"vision": plain, "lang": plain}


def blocking_of(spec: Any) -> AttentionBlocking:
    """The attention-blocking policy a spec's export takes: its bound, largest prefill and ctx_len."""
    return for_spec(spec.compile.max_activation_bytes, spec.prefill.seq_lens, spec.ctx_len)


def _sampler_of(spec: Any) -> dict | None:
    """The export manifest's record of the spec's on-device sampler (None: the program returns logits)."""
    sampler = spec.compile.language.sampler
    return sampler.to_dict() if sampler is not None else None


def _former_symbol(spec: Any, manifest: Mapping[str, Any]) -> str | None:
    """The first symbol the export records under a name its family has since changed, or None."""
    from qeff_vision.families import get_family

    return get_family(spec.family).former_symbol_note(recorded_symbols(dict(manifest)))


def given_export(spec: Any, export_dir: Path, hub: HubCheckpoint | None = None) -> Export:
    """The export ``--export DIR`` names, checked against the spec; reads only, writes nothing.

    Raises:
        UserError: Not an export, an export of another family or of another commit of the
            spec's Hugging Face id (``hub``), or one without (or with) the
            compute-context-length input, the vision program mode (per resolution or patch
            buckets), the continuous-batching IO or the full-length ring caches the spec needs.
    """
    manifest = read_export(export_dir)
    if manifest.get("family") != spec.family:
        raise UserError(
            f"{export_dir}: exported family {manifest.get('family')!r}, spec says {spec.family!r}"
        )
    recorded = hub_record(manifest)
    if hub is not None and recorded is not None and recorded["commit"] != hub.commit:
        raise UserError(
            f"{export_dir}: exported from {recorded['id']} commit {recorded['commit'][:12]}, but the spec's "
            f"model resolves to commit {hub.commit[:12]}; export it again (`qeff-vision export`)"
        )
    former = _former_symbol(spec, manifest)
    if former:
        raise UserError(f"{export_dir}: exported with {former}; export it again (`qeff-vision export`)")
    _check_table_positions(spec, manifest, export_dir)
    ccl = spec.compile.comp_ctx_lengths is not None
    if bool(manifest.get("comp_ctx_lengths")) != ccl:
        wanted = "with" if ccl else "without"
        raise UserError(
            f"{export_dir}: the spec needs an export {wanted} the comp_ctx_lengths input "
            f"(`qeff-vision export{' --comp-ctx-lengths' if ccl else ''}`)"
        )
    buckets = bool(spec.vision.patch_buckets)
    if (vision_mode(manifest) == PATCH_BUCKETS) != buckets:
        raise UserError(
            f"{export_dir}: the spec needs an export with the "
            f"{'patch-bucket' if buckets else 'per-resolution'} vision program "
            f"(`qeff-vision export{' --patch-buckets' if buckets else ''}`)"
        )
    cb = spec.full_batch_size is not None
    if bool(manifest.get("continuous_batching")) != cb:
        wanted = "with" if cb else "without"
        raise UserError(
            f"{export_dir}: the spec needs an export {wanted} continuous batching "
            f"(`qeff-vision export{' --continuous-batching' if cb else ''}`)"
        )
    full_kv = spec.deployment.retain_full_kv
    if bool(manifest.get("retain_full_kv")) != full_kv:
        wanted = "with" if full_kv else "without"
        raise UserError(
            f"{export_dir}: the spec needs an export {wanted} full-length caches on ring layers "
            f"(`qeff-vision export{' --retain-full-kv' if full_kv else ''}`)"
        )
    task = manifest.get("task", GENERATE)
    if task != spec.task:
        raise UserError(
            f"{export_dir}: exported for task {task}, the spec says task {spec.task} "
            f"(`qeff-vision export --task {spec.task}`)"
        )
    functions = spec.compile.language.subfunctions
    if bool(manifest.get("subfunctions")) != functions:
        wanted = "with" if functions else "without"
        raise UserError(
            f"{export_dir}: the spec needs an export {wanted} decoder layers as ONNX functions "
            f"(`qeff-vision export{' --subfunctions' if functions else ''}`)"
        )
    sampler = _sampler_of(spec)
    if manifest.get("sampler") != sampler:
        wanted = f"the on-device sampler {sampler}" if sampler else "no on-device sampler"
        flags = "".join(
            f" --sampler {key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in (sampler or {}).items()
        )
        raise UserError(f"{export_dir}: the spec needs an export with {wanted} (`qeff-vision export{flags}`)")
    return Export(export_dir, manifest)


def locate_export(
    spec: Any,
    out_dir: Path,
    export_dir: Path | None,
    *,
    dry_run: bool,
    say: Progress,
    hub: HubCheckpoint | None = None,
    quiet: bool = False,
) -> Export:
    """The export to compile: ``export_dir``, else ``OUT/export`` (exported now if absent or stale).

    With ``hub`` (the spec's Hugging Face id as the cache holds it), an export that records
    another commit is stale even when its config is the same: the weights differ. A Hub id is
    resolved through the network (:func:`qeff_vision.hub.resolve`) only when an export must run,
    and its weights are downloaded then; the returned export names that snapshot (``hub``).
    """
    ccl = spec.compile.comp_ctx_lengths is not None
    buckets = bool(spec.vision.patch_buckets)
    cb = spec.full_batch_size is not None
    full_kv = spec.deployment.retain_full_kv
    if export_dir is not None:
        return given_export(spec, export_dir, hub)
    directory = out_dir / EXPORT_SUBDIR
    manifest = read_export(directory) if (directory / EXPORT_FILE).is_file() else None
    stale = (
        manifest is not None
        and spec.model_dir is not None
        and (spec.model_dir / "config.json").is_file()
        and manifest.get("config_hash") != config_hash(spec.model_dir)
    )
    if manifest is not None and manifest.get("family") != spec.family:
        stale = True
    if manifest is not None and bool(manifest.get("comp_ctx_lengths")) != ccl:
        stale = True  # the spec added or dropped compute-context lengths
    if manifest is not None and (vision_mode(manifest) == PATCH_BUCKETS) != buckets:
        stale = True  # the spec switched between resolutions and patch buckets
    if manifest is not None and bool(manifest.get("continuous_batching")) != cb:
        stale = True  # the spec added or dropped full_batch_size
    if manifest is not None and bool(manifest.get("retain_full_kv")) != full_kv:
        stale = True  # the spec added or dropped retain_full_kv
    if manifest is not None and manifest.get("task", GENERATE) != spec.task:
        stale = True  # the spec switched between generate and a pooling task
    if manifest is not None and bool(manifest.get("subfunctions")) != spec.compile.language.subfunctions:
        stale = True  # the spec added or dropped compile.language.subfunctions
    if manifest is not None and manifest.get("sampler") != _sampler_of(spec):
        stale = True  # the spec added, dropped or changed compile.language.sampler
    if manifest is not None and manifest.get("attention_blocking") != blocking_of(spec).to_dict():
        stale = True  # attention blocks sized for another bound, prefill or ctx_len (or none)
    if manifest is not None and _former_symbol(spec, manifest):
        stale = True  # exported before the family took QEfficient's symbol names
    if manifest is not None and recorded_weights(manifest) != weights_of(spec):
        stale = True  # the spec's weights key (or its compile dtype) asks another storage form
    recorded = hub_record(manifest)
    if recorded is not None and hub is not None and recorded["commit"] != hub.commit:
        stale = True  # another commit: other weights, maybe the same config
    if manifest is not None and not stale:
        _check_table_positions(spec, manifest, directory)
        return Export(directory, manifest)
    if dry_run:
        say(f"dry run: {directory} is {'stale' if stale else 'not exported yet'}; nothing is exported")
        return Export(directory, None)
    if spec.model_dir is None:  # a Hub id the cache does not hold (yet)
        from qeff_vision.hub import resolve

        hub = resolve(spec.model, spec.revision, weights=False, quiet=quiet)
        spec = replace(spec, model_dir=hub.directory)
    if manifest is not None:
        # The export a previous manifest names is replaced now: that manifest stops being true.
        (out_dir / MANIFEST_FILE).unlink(missing_ok=True)
    source = f"{hub.repo_id} commit {hub.commit[:12]} ({spec.model_dir})" if hub else spec.model_dir
    say(f"exporting {source} to {directory}" + (" (the previous export is stale)" if stale else ""))
    sampler = spec.compile.language.sampler
    manifest = _run_export(
        spec.model_dir,
        directory,
        None if quiet else say,
        ccl,
        buckets,
        cb,
        full_kv,
        sampler,
        hub,
        blocking_of(spec),
        spec,
    )
    _check_table_positions(spec, manifest, directory)
    return Export(directory, manifest, hub)


def _check_table_positions(spec: Any, manifest: Mapping[str, Any], directory: Path) -> None:
    """A bf16 language program's rotary tables cover ``ctx_len`` positions; else a UserError.

    The tables hold at most :data:`~qeff_vision.export.rotary_tables.MAX_TABLE_ROWS` positions
    (a model may declare ten million).
    """
    positions = manifest.get("rotary_table_positions")
    if positions is not None and spec.ctx_len > positions:
        raise UserError(
            f"{directory}: the language program reads rotary cos/sin from tables of {positions} "
            f"positions (bf16, ai200), fewer than ctx_len {spec.ctx_len}"
        )


def write_inputs(generated: Any, spec: Any, out_dir: Path, export: Export) -> dict[str, ProgramPlan]:
    """Write specializations, custom IO and partition files under OUT; return each program's plan."""
    write_specializations(generated, out_dir)
    if spec.deployment.kv_cache_prefix and export.manifest is not None:
        from qeff_vision.compile.kv_prefix import write_prefixed_language

        write_prefixed_language(export.onnx(SECTIONS[LANGUAGE]), spec.deployment.kv_cache_prefix)
    if spec.deployment.table.encoder_inside and export.manifest is not None:
        _write_single(export)  # again each time: the export may have been redone since
    plans = plan_inputs(generated, spec, out_dir, export)
    for plan in plans.values():
        partition = plan.directory / PARTITION_FILE_NAME
        if plan.partition_file is not None:
            options = plan.options
            atomic_write_json(partition, mdp_partition_config(options.num_devices, options.num_cores))
        else:
            partition.unlink(missing_ok=True)
    return plans


def plan_inputs(generated: Any, spec: Any, out_dir: Path, export: Export) -> dict[str, ProgramPlan]:
    """Each program's plan: where its inputs go under OUT (nothing is written).

    The programs are the spec's deployment's (``generated.programs``): ``vision`` and ``lang``,
    or ``vision``, ``lang_prefill`` and ``lang_decode`` compiled from the one language graph (its
    KV-renamed copy beside it with a ``kv_cache_prefix``).
    """
    from qeff_vision.compile.deployment import program_options
    from qeff_vision.compile.kv_prefix import prefixed_language

    plans = {}
    for files in generated.programs or (generated.vision, generated.language):
        program = files.directory
        section = files.program
        options = program_options(spec.compile, spec.deployment, program)
        directory = out_dir / program
        custom_io_file = directory / "custom_io.yaml"
        has_custom_io = bool(files.custom_io)
        partition = directory / PARTITION_FILE_NAME
        onnx = source = export.onnx(SECTIONS[section])
        if spec.deployment.table.encoder_inside:  # the vision graph composed into the language graph
            onnx = source = single_program_path(export.directory)
        if section == LANGUAGE and spec.deployment.kv_cache_prefix:
            onnx = prefixed_language(source, spec.deployment.kv_cache_prefix)
        plans[program] = ProgramPlan(
            program=program,
            section=section,
            options=options,
            directory=directory,
            onnx=onnx,
            specializations=[{"name": s.name, "symbols": dict(s.symbols)} for s in files.specializations],
            specializations_file=directory / "specializations.json",
            custom_io_file=custom_io_file if has_custom_io else None,
            partition_file=partition if options.num_devices > 1 else None,
            source_onnx=source if source != onnx else None,
        )
    return plans


def _write_single(export: Export) -> Path:
    """Compose the export's two graphs into its single program (``single.onnx``, beside them)."""
    from qeff_vision.compile.single_program import write_single_program

    return write_single_program(export.directory, export.onnx("vision"), export.onnx("lang"))


def check_graphs(plans: Mapping[str, ProgramPlan], source: str, *, outputs_required: bool) -> None:
    """Every specialization binds exactly its graph's symbols; a SpecError listing all problems if not."""
    problems = []
    for plan in plans.values():
        # The renamed KV copy binds the same symbols as its source (checked before it is written).
        if plan.onnx.name == SINGLE_FILE and not plan.onnx.is_file():
            _write_single(Export(plan.onnx.parent, read_export(plan.onnx.parent)))
        written = plan.source_onnx is None or plan.onnx.is_file()
        graph = read_graph_io(plan.onnx if written else plan.source_onnx)
        problems += symbol_problems(
            graph, plan.symbol_values(), plan.program, outputs_required=outputs_required
        )
    if problems:
        raise SpecError(source, problems)
