"""Export both programs of a family to ONNX with the TorchScript exporter (``dynamo=False``).

Generic: the family supplies an :class:`~qeff_vision.export.adapter.ExportAdapter` and declares its
IO axes as data; this module traces with small example shapes (export memory does not depend on
image resolution), attaches the KV-cache ONNX functions, stores weights as external data, checks
the graphs and writes ``export.json``. Every RMSNorm exports as the compiler-known ``CustomRMSNorm``
function (:mod:`qeff_vision.export.rms_norm`). Everything is written to a staging directory and renamed
into place at the end, so an interrupted export never leaves a model.onnx that looks complete.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import external_data_helper

from qeff_vision import __version__, symbols
from qeff_vision.bad_input import reading
from qeff_vision.contract.full_kv import has_rings
from qeff_vision.contract.language_io import DType, LanguageIO
from qeff_vision.contract.sampler_io import SamplerOptions, sampler_dims, with_sampler
from qeff_vision.contract.tasks import GENERATE, is_pooling, pooled_io
from qeff_vision.errors import UserError
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.attention import use_grouped_attention
from qeff_vision.export.blocked_attention import AttentionBlocking, blocking
from qeff_vision.export.gated_delta import attach_gated_delta
from qeff_vision.export.kv_ops import DOMAIN, DOMAIN_VERSION, attach_functions
from qeff_vision.export.opset_upgrade import upgrade_opset
from qeff_vision.export.pooled import PooledDecoder, checked_task
from qeff_vision.export.rms_norm import attach_rms_norm, use_custom_rms_norm
from qeff_vision.export.rotary_tables import use_rotary_tables
from qeff_vision.export.sampler import SamplerDecoder
from qeff_vision.export.subfunctions import (
    exporting_functions,
    hoist_weight_transposes,
    internal_name,
    layer_calls,
    layer_classes,
    restore_output_names,
)
from qeff_vision.export.weight_forms import (
    BFLOAT16,
    QUANTIZED_OPSET,
    WeightForm,
    WrittenWeights,
    program_forms,
)
from qeff_vision.export.weights import (
    DTYPES,
    WeightPlan,
    append_tensor,
    buffers_as_constants,
    build_without_weights,
    dense_placeholder_linears,
    parameter_inputs,
    write_weights,
)
from qeff_vision.export_record import (
    EXPORT_FILE,
    PATCH_BUCKETS,
    RESOLUTIONS,
    VISION_MODE,
    config_hash,
    read_export,
)
from qeff_vision.families import Family, describe_checkpoint, family_for
from qeff_vision.families.base import ModelDescription
from qeff_vision.fsutil import (
    atomic_write_json,
    check_output_dir,
    is_nonempty_dir,
    release_memory,
    staged_directory,
)
from qeff_vision.graph_file import described_values, external_attributes, inline_attributes
from qeff_vision.progress import bar as progress_bar
from qeff_vision.transformers_version import require_supported_transformers

OPSET = 17
# Example sizes for tracing the language program: small on purpose (the axes are symbolic).
EXAMPLE_SEQ_LEN = 8
EXAMPLE_VISION_ROWS = 4
EXAMPLE_CTX_LEN = 16
# A ring layer's length in the example (window or chunked): shorter than the example chunk, so
# tracing covers S > R.
EXAMPLE_RING_LEN = 6
# Elements of the example ``comp_ctx_lengths`` (fewer than the example context).
EXAMPLE_CCL = 12
# Every generic symbol of the language table at trace size.
EXAMPLE_SYMBOLS = {
    symbols.BATCH_SIZE: 1,
    symbols.SEQ_LEN: EXAMPLE_SEQ_LEN,
    symbols.VISION_BATCH_SIZE: 1,
    symbols.VISION_SIZE: EXAMPLE_VISION_ROWS,
    symbols.CTX_LEN: EXAMPLE_CTX_LEN,
    symbols.SLIDING_WINDOW: EXAMPLE_RING_LEN,
    symbols.CHUNK_CTX_LEN: EXAMPLE_RING_LEN,
    symbols.COMP_CTX_LENGTHS: EXAMPLE_CCL,
    # KV slots of a continuous-batching example (the call itself has batch 1, as a prefill does).
    symbols.FULL_BATCH_SIZE: 4,
}
# Initializers of at least this many bytes go to model.onnx.data; smaller ones (and every node
# attribute, a Constant's value included) stay in the graph.
EXTERNAL_THRESHOLD = 1024

Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    """Default progress sink: one prefixed line per stage on stderr."""
    print(f"[qeff-vision] {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass


@dataclass
class ExportResult:
    """What an export produced: paths, the manifest written to export.json, and stage timings."""

    out_dir: Path
    manifest: dict
    timings: dict[str, float] = field(default_factory=dict)

    def program_path(self, program: str) -> Path:
        """Absolute path of ``vision`` or ``lang`` model.onnx."""
        return self.out_dir / self.manifest["programs"][program]["path"]


def load_adapter(family: Family) -> ExportAdapter:
    """The family's export adapter (its registered loader imports the torch side)."""
    return family.adapter()


def _load_model(adapter: ExportAdapter, model_dir: Path, dtype: torch.dtype):
    require_supported_transformers()
    with reading(model_dir, "a checkpoint whose weights load"):
        return adapter.empty_model(model_dir, dtype)


def _torch_export(
    module, example: tuple, path: Path, input_names, output_names, dynamic_axes, custom, functions=None
) -> None:
    # export_params=False: weights become graph inputs (the module holds placeholders, see
    # export/weights.py); no constant folding, which would materialise transposed weight copies.
    # ``functions``: module classes exported as ONNX local functions (export/subfunctions.py).
    patched = exporting_functions(module) if functions else contextlib.nullcontext()
    with warnings.catch_warnings(), torch.no_grad(), patched:
        warnings.simplefilter("ignore")  # TracerWarnings about shape arithmetic are expected here
        torch.onnx.export(
            module,
            example,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes={name: dict(axes) for name, axes in dynamic_axes.items() if axes},
            custom_opsets={DOMAIN: DOMAIN_VERSION} if custom else None,
            export_params=False,
            # Placeholders of equal shape have equal (zero) values: keep the tracer from merging them.
            keep_initializers_as_inputs=True,
            do_constant_folding=False,
            **({"export_modules_as_functions": set(functions)} if functions else {}),
        )


def _pin_static_dims(model: onnx.ModelProto, example_outputs, axes: Mapping[str, Mapping[int, str]]) -> None:
    """Give every output dim its declared symbol, and the others their static size from the example.

    The exporter names dims it cannot infer through a dynamic Reshape (``Reshape..._dim_2``); the
    compiler and our checks need them either declared or fixed.
    """
    for value, shape in zip(model.graph.output, example_outputs):
        declared = axes.get(value.name, {})
        for index, dim in enumerate(value.type.tensor_type.shape.dim):
            if index in declared:  # an output a function call produced has generated dim names
                dim.dim_param = declared[index]
            elif dim.dim_param:
                dim.Clear()
                dim.dim_value = int(shape[index])


@dataclass
class _Traced:
    """A program traced to a raw ONNX file, waiting for :func:`_finalize`."""

    program: str
    raw_path: Path
    output_shapes: list[tuple[int, ...]]
    axes: Mapping[str, Mapping[int, str]]
    params: Mapping[str, torch.Tensor]
    # Graph output names, restored by position after a function export renamed them.
    output_names: Sequence[str] = ()


def _stream_constants(model: onnx.ModelProto, source_dir: Path, data) -> None:
    """Move every large initializer the tracer left in the graph (not a weight) into ``data``.

    Node attributes stay in the graph (:mod:`qeff_vision.graph_file`): one the tracer stored
    externally (a large traced buffer's ``Constant``) is read back in.
    """
    inline_attributes(model, source_dir)
    for tensor in model.graph.initializer:
        if external_data_helper.uses_external_data(tensor):
            info = external_data_helper.ExternalDataInfo(tensor)
            with open(source_dir / info.location, "rb") as source:
                source.seek(info.offset or 0)
                payload = source.read(info.length) if info.length else source.read()
        elif len(tensor.raw_data) >= EXTERNAL_THRESHOLD:
            payload = tensor.raw_data
        else:
            continue
        append_tensor(data, tensor, payload, Path(data.name).name)


def _finalize(
    traced: _Traced, plan: WeightPlan, final_path: Path, bars: bool, form: WeightForm
) -> tuple[onnx.ModelProto, WrittenWeights]:
    """Attach functions, pin static dims, write the weights tensor by tensor, and check the result.

    ``bars``: show the weight streaming as a byte bar (rate, ETA) when stderr is a terminal.
    ``form``: how weights are stored; keeping quantized weights moves the graph to opset 21.
    """
    model = onnx.load(str(traced.raw_path), load_external_data=False)
    if traced.output_names:
        restore_output_names(model, traced.output_names)
        ranks = {name: param.dim() for name, param in traced.params.items()}
        hoist_weight_transposes(model, ranks)  # stored transposed, as inline (export/subfunctions.py)
    attach_functions(model)
    attach_rms_norm(model)
    attach_gated_delta(model)
    _pin_static_dims(model, traced.output_shapes, traced.axes)
    inputs = {value.name for value in model.graph.input}
    total = (
        sum(param.numel() for name, param in traced.params.items() if name in inputs) * plan.dtype.itemsize
    )
    with (
        open(final_path.with_name(final_path.name + ".data"), "wb") as data,
        progress_bar(f"{traced.program} weights", total=total, unit="B", enabled=bars) as shown,
    ):
        _stream_constants(model, traced.raw_path.parent, data)
        written = write_weights(model, traced.params, plan, data, on_written=shown.update, form=form)
    if form.keep_quantized:
        upgrade_opset(model, QUANTIZED_OPSET)
    outside = external_attributes(model)
    if outside:  # every stage reads node attributes from the graph itself
        raise RuntimeError(f"{final_path}: node attributes stored as external data: {outside[:3]}")
    onnx.save_model(model, str(final_path))
    for leftover in traced.raw_path.parent.iterdir():
        if leftover.name not in (final_path.name, final_path.name + ".data"):
            leftover.unlink()
    onnx.checker.check_model(str(final_path))
    return model, written


def describe_io(values, declared_axes: Mapping[str, Mapping[int, str]]) -> dict[str, dict]:
    """Name -> dtype, shape (ints and symbols) and symbolic axes, checked against the declaration."""
    described = described_values(values)
    for name, entry in described.items():
        axes = {str(i): dim for i, dim in enumerate(entry["shape"]) if isinstance(dim, str)}
        expected = {str(i): sym for i, sym in declared_axes.get(name, {}).items()}
        if axes != expected:
            raise RuntimeError(f"{name}: exported symbolic axes {axes} differ from the declared {expected}")
        entry["axes"] = axes
    return described


def example_values(family: Family, model: ModelDescription) -> dict[str, int]:
    """Every symbol and model dimension of the language table at trace size (one image slot)."""
    return {
        **family.kv_cache_lengths(model, EXAMPLE_CTX_LEN),  # a family's own per-layer cache symbols
        **EXAMPLE_SYMBOLS,
        **family.language_dims(model),
        **family.request_symbols(model, 1),
    }


def language_example(io: LanguageIO, values: Mapping[str, int], image_token_id: int) -> tuple:
    """Small example inputs of the language program, one per row of ``io`` in graph order.

    A row that declares its own example (token ids: a chunk with a few placeholders after two text
    tokens; positions counting up; a family's own inputs) supplies it; otherwise a compute-dtype
    row gets random values and the rest zeros (caches, cursors).
    """
    example = []
    for row in io.inputs:
        shape = row.concrete_shape(values)
        if row.example is not None:
            tensor = torch.from_numpy(row.example(shape, values, image_token_id))
        elif row.dtype in (DType.INT64, DType.KV, DType.STATE, DType.BOOL):
            kind = {DType.INT64: torch.int64, DType.BOOL: torch.bool}.get(row.dtype, torch.float32)
            tensor = torch.zeros(shape, dtype=kind)
        else:
            tensor = torch.randn(shape)
        example.append(tensor)
    return tuple(example)


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    force: bool = False,
    dtype: str = "float32",
    comp_ctx_lengths: bool = False,
    patch_buckets: bool = False,
    continuous_batching: bool = False,
    retain_full_kv: bool = False,
    sampler: SamplerOptions | None = None,
    progress: Progress | None = stderr_progress,
    hub: Mapping[str, str | None] | None = None,
    weight_dtype: str | Mapping[str, str] = "float32",
    keep_quantized: bool = False,
    attention_blocking: AttentionBlocking | None = None,
    task: str = GENERATE,
    subfunctions: bool = False,
) -> ExportResult:
    """Export ``model_dir``'s vision encoder and language decoder to ``out_dir``.

    Peak memory is about one copy of the exported weights (see :mod:`qeff_vision.export.weights`):
    the model is traced without weights, and each weight is read, cast and written on its own.

    Args:
        model_dir: A Hugging Face checkpoint directory (config, safetensors, processor).
        out_dir: Output directory; must be empty or absent unless ``force``.
        force: Replace a non-empty ``out_dir``.
        dtype: Floating dtype of the exported graphs, ``float32`` or ``float16``.
        comp_ctx_lengths: Give the language program the ``comp_ctx_lengths`` input (compute-context
            lengths: attention reads as many leading KV slots as it has elements).
        patch_buckets: Export the family's patch-bucket vision program (specialized on patch
            counts, any resolution, images packed) instead of the per-resolution one.
        continuous_batching: Export the language program for continuous batching (QEfficient's
            names): KV caches with ``full_batch_size`` slots on dim 0 and the input
            ``batch_index`` [batch_size, 1] naming each row's slot.
        retain_full_kv: Ring layers (sliding window, attention chunk) keep ``ctx_len`` KV slots
            masked to their window or block instead of a ring (:mod:`qeff_vision.contract.full_kv`).
        sampler: Compile QEfficient's on-device sampler into the language program: it returns
            ``next_tokens`` instead of ``logits`` (:mod:`qeff_vision.export.sampler`).
        progress: Called with one line per stage; ``None`` silences progress (and the weight bar).
        hub: The Hugging Face id, revision and commit ``model_dir`` is the snapshot of
            (:meth:`qeff_vision.hub.HubCheckpoint.record`), kept in export.json as ``hub``.
        weight_dtype: How float weights of a float32 graph are stored, ``float32`` or ``float16``
            (float16 + Cast where exact, :mod:`qeff_vision.export.weight_forms`); one for both
            programs or per program (``{"vision": ..., "lang": ...}``).
        keep_quantized: Write weights the checkpoint stores quantized as ``DequantizeLinear``
            inputs (the graphs move to opset 21).
        attention_blocking: Block-count rule of the attentions (vision query blocks, language key
            blocks; :mod:`qeff_vision.export.blocked_attention`); None: the default policy
            (256 MiB per block at 2560x1440 images and a 512 x 32k prefill). Kept in export.json.
        task: ``generate`` (the KV-cache decoder), or a pooling task (``embed``, ``score``): the
            language program pools a whole prompt with no cache (:mod:`qeff_vision.export.pooled`).
        subfunctions: Export the language program's decoder layers as ONNX local functions, one
            per distinct layer body (:mod:`qeff_vision.export.subfunctions`); compiled with
            ``-sub-functions``. Kept in export.json with the calls per function.

    Returns:
        The :class:`ExportResult`; ``timings`` has seconds per stage.
    """
    say = progress or _quiet
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"export dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch_dtype = DTYPES[dtype]
    forms = program_forms(weight_dtype, keep_quantized)
    check_output_dir(out_dir)  # before minutes of work, not after
    if is_nonempty_dir(out_dir) and not force:
        raise UserError(f"{out_dir} is not empty; pass --force to replace it")
    description = describe_checkpoint(model_dir)
    family = family_for(description)
    if patch_buckets and not family.supports_patch_buckets:
        raise UserError(f"family {family.name} has no patch-bucket vision program")
    if continuous_batching and not family.features.continuous_batching.supported:
        raise UserError(
            f"{family.title}: no continuous batching ({family.features.continuous_batching.note})"
        )
    if comp_ctx_lengths and not family.features.comp_ctx_lengths.supported:
        raise UserError(
            f"{family.title}: no compute-context lengths ({family.features.comp_ctx_lengths.note})"
        )
    stateful = continuous_batching or comp_ctx_lengths or sampler is not None or retain_full_kv
    score_ids = checked_task(family, task, model_dir, stateful)  # before minutes of work
    if retain_full_kv and not has_rings(family.layer_caches(description)):
        raise UserError(f"{family.title}: no ring layer in this config, so no cache to keep full length")
    dims = family.text_dims(description)
    if sampler is not None and not 1 <= sampler.max_top_k_ids <= dims.vocab_size:
        raise UserError(
            f"sampler max_top_k_ids must be in 1..{dims.vocab_size} (the vocabulary), "
            f"not {sampler.max_top_k_ids}"
        )
    timings: dict[str, float] = {}
    attention_blocking = attention_blocking or AttentionBlocking()

    start = time.perf_counter()
    say(f"load: {model_dir} ({family.title}, weights streamed from disk)")
    adapter = load_adapter(family)
    model = _load_model(adapter, model_dir, torch_dtype)
    use_custom_rms_norm(model, adapter.rms_norm_weight_offsets)
    plan = build_without_weights(model_dir, model, torch_dtype)
    timings["load"] = time.perf_counter() - start

    with staged_directory(out_dir, force=force) as staging:
        start = time.perf_counter()
        say("patch: symbolic vision tower, retained-state KV decoder")
        encoder = adapter.patch_bucket_encoder(model) if patch_buckets else adapter.vision_encoder(model)
        parts = adapter.decoder_parts(model)
        # bf16 compute (ai200): rotary cos/sin gathered from tables, no angle rounded on the device.
        rotaries = use_rotary_tables(parts.text_model) if forms["lang"].dtype == BFLOAT16 else {}
        io = family.language_table(description, comp_ctx_lengths, continuous_batching, retain_full_kv)
        if is_pooling(task):  # one call per whole prompt, no cache (export/pooled.py)
            io = pooled_io(io, task)
            decoder = PooledDecoder(parts, io, task, score_ids).eval()
        else:
            decoder = adapter.language_decoder(model, parts, io)
        if sampler is not None:  # generic: wraps whatever decoder the family has
            sampled = with_sampler(io, sampler)
            decoder, io = SamplerDecoder(decoder, io, sampled, sampler), sampled
        timings["patch"] = time.perf_counter() - start

        start = time.perf_counter()
        say("export vision")
        if patch_buckets:
            vision_example = adapter.patch_bucket_example_inputs(model)
        else:
            vision_example = adapter.vision_example_inputs(model)
        vision_inputs, vision_outputs = family.vision_io(description, patch_buckets)
        with blocking(attention_blocking):
            vision = _trace(
                staging,
                "vision",
                encoder,
                _cast(tuple(vision_example.values()), torch_dtype),
                list(vision_example),
                list(vision_outputs),
                {**vision_inputs, **vision_outputs},
            )
        timings["trace_vision"] = time.perf_counter() - start

        start = time.perf_counter()
        say("export language")
        use_grouped_attention(parts.text_model)  # after the vision trace: text layers only
        values = {**example_values(family, description), **sampler_dims(sampler or SamplerOptions())}
        example = language_example(io, values, parts.image_token_id)
        # The sampler's float32 rows keep their type in a float16 export (QEfficient's dtypes).
        example = tuple(
            t if row.dtype is DType.FLOAT32 else _cast((t,), torch_dtype)[0]
            for row, t in zip(io.inputs, example)
        )
        in_axes, out_axes = io.input_axes(), io.output_axes()
        functions = layer_classes(decoder) if subfunctions else None
        if subfunctions and not functions:
            raise UserError(f"{family.title}: no repeated decoder layers to export as functions")
        with blocking(attention_blocking):
            lang = _trace(
                staging,
                "lang",
                decoder,
                example,
                list(in_axes),
                list(out_axes),
                {**in_axes, **out_axes},
                functions,
            )
        image_token_id = parts.image_token_id
        tables = [name for name, rotary in rotaries.items() if rotary.used]
        table_positions = min((rotaries[name].positions for name in tables), default=None)
        if tables:
            say(f"language: rotary cos/sin read from bf16 position tables ({', '.join(tables)})")
        del encoder, decoder, parts, example, rotaries
        timings["trace_language"] = time.perf_counter() - start

        programs = {}
        for traced in (vision, lang):
            start = time.perf_counter()
            say(f"write {traced.program} weights")
            form = forms[traced.program]
            final, written = _finalize(
                traced, plan, staging / traced.program / "model.onnx", progress is not None, form
            )
            programs[traced.program] = {**_describe_program(traced, final), "weights": written.to_dict()}
            say(f"{traced.program} written: {written.summary()}")
            timings[f"write_{traced.program}"] = time.perf_counter() - start
        del model, plan, vision, lang
        release_memory()

        start = time.perf_counter()
        say("check: onnxruntime loads both graphs")
        check_loads(staging, programs)
        timings["check"] = time.perf_counter() - start

        manifest = {
            "family": family.name,
            "model": str(model_dir.resolve()),
            "config_hash": config_hash(model_dir),
            **({"hub": dict(hub)} if hub else {}),
            "opset": QUANTIZED_OPSET if keep_quantized else OPSET,
            "dtype": dtype,
            "weights": {program: form.to_dict() for program, form in forms.items()},
            "comp_ctx_lengths": comp_ctx_lengths,
            VISION_MODE: PATCH_BUCKETS if patch_buckets else RESOLUTIONS,
            "continuous_batching": continuous_batching,
            "retain_full_kv": retain_full_kv,
            "task": task,
            **({"score_token_ids": list(score_ids)} if score_ids else {}),
            "sampler": sampler.to_dict() if sampler is not None else None,
            "attention_blocking": attention_blocking.to_dict(),
            "subfunctions": subfunctions,
            **({"rotary_tables": tables} if tables else {}),
            **({"rotary_table_positions": table_positions} if tables else {}),
            "image_token_id": image_token_id,
            "num_layers": dims.num_layers,
            "programs": programs,
            "versions": _versions(),
        }
        atomic_write_json(staging / EXPORT_FILE, manifest)
    return ExportResult(out_dir, manifest, timings)


def _cast(example: tuple, dtype: torch.dtype) -> tuple:
    """Floating example inputs in the export dtype (integer ids and indices unchanged)."""
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in example)


def _trace(
    staging: Path, program: str, module, example, input_names, output_names, axes, functions=None
) -> _Traced:
    directory = staging / program
    directory.mkdir()
    raw = directory / "traced.onnx"
    traced_names = [internal_name(n) for n in output_names] if functions else list(output_names)
    traced_axes = {internal_name(n) if functions else n: a for n, a in axes.items()}
    with dense_placeholder_linears(module), buffers_as_constants(module):
        _torch_export(
            module, example, raw, input_names, traced_names, traced_axes, program == "lang", functions
        )
        with torch.no_grad():
            outputs = module(*example)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    shapes = [tuple(o.shape) for o in outputs]
    restore = list(output_names) if functions else ()
    return _Traced(program, raw, shapes, axes, parameter_inputs(module), restore)


def _describe_program(traced: _Traced, model: onnx.ModelProto) -> dict:
    described = {
        "path": f"{traced.program}/model.onnx",
        "inputs": describe_io(model.graph.input, traced.axes),
        "outputs": describe_io(model.graph.output, traced.axes),
    }
    calls = layer_calls(model)
    if calls:  # decoder layers exported as functions: name -> calls
        described["functions"] = calls
    return described


def check_loads(root: Path, programs: Mapping[str, dict]) -> None:
    """Every program loads in onnxruntime (functions inlined, external data found)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Loading is the check; graph optimizations would copy every constant-folded weight, and
    # pre-packing every MatMul weight into MLAS's layout another copy of the model. Without both,
    # onnxruntime memory-maps the page-aligned external data and the check costs almost nothing.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    for program in programs.values():
        ort.InferenceSession(str(root / program["path"]), options, providers=["CPUExecutionProvider"])


def _versions() -> dict[str, str]:
    import onnxruntime
    import transformers

    return {
        "qeff_vision": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
    }


__all__ = ["ExportResult", "export_model", "load_adapter", "read_export"]
