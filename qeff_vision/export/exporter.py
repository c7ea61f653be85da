"""Export both programs of a family to ONNX with the TorchScript exporter (``dynamo=False``).

Generic: the family supplies an :class:`~qeff_vision.export.adapter.ExportAdapter` and declares its
IO axes as data; this module traces with small example shapes (export memory does not depend on
image resolution), attaches the KV-cache ONNX functions, stores weights as external data, checks
the graphs and writes ``export.json``. Everything is written to a staging directory and renamed
into place at the end, so an interrupted export never leaves a model.onnx that looks complete.
"""

from __future__ import annotations

import importlib
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from qeff_vision import __version__
from qeff_vision.errors import UserError
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.decoder import LanguageDecoder
from qeff_vision.export.kv_ops import DOMAIN, DOMAIN_VERSION, attach_functions
from qeff_vision.export.record import EXPORT_FILE, config_hash, read_export
from qeff_vision.families import Family, describe_checkpoint, family_for
from qeff_vision.fsutil import atomic_write_json, is_nonempty_dir, staged_directory

OPSET = 17
# Example sizes for tracing the language program: small on purpose (the axes are symbolic).
EXAMPLE_SEQ_LEN = 8
EXAMPLE_VISION_ROWS = 4
EXAMPLE_CTX_LEN = 16

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
    """Import the family's torch-side module and instantiate its ``Adapter``."""
    module = importlib.import_module(family.export_module)
    return module.Adapter()


def _load_model(adapter: ExportAdapter, model_dir: Path):
    try:
        return adapter.load(model_dir)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors/transformers raise many types for bad files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{model_dir}: cannot load the checkpoint weights ({first_line})") from exc


def _torch_export(
    module, example: tuple, path: Path, input_names, output_names, dynamic_axes, custom
) -> None:
    with warnings.catch_warnings(), torch.no_grad():
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
            do_constant_folding=True,
        )


def _pin_static_dims(model: onnx.ModelProto, example_outputs, axes: Mapping[str, Mapping[int, str]]) -> None:
    """Give every output dim that is not a declared symbol its static size from the traced example.

    The exporter names dims it cannot infer through a dynamic Reshape (``Reshape..._dim_2``); the
    compiler and our checks need them either declared or fixed.
    """
    for value, example in zip(model.graph.output, example_outputs):
        declared = axes.get(value.name, {})
        for index, dim in enumerate(value.type.tensor_type.shape.dim):
            if index not in declared and dim.dim_param:
                dim.Clear()
                dim.dim_value = int(example.shape[index])


def _finalize(raw_path: Path, final_path: Path, example_outputs, axes) -> onnx.ModelProto:
    """Attach functions, pin static dims, move weights to external data, and check the result."""
    model = onnx.load(str(raw_path))
    attach_functions(model)
    _pin_static_dims(model, example_outputs, axes)
    onnx.save_model(
        model,
        str(final_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=final_path.name + ".data",
        size_threshold=1024,
    )
    for leftover in raw_path.parent.glob(raw_path.name + "*"):
        leftover.unlink()
    onnx.checker.check_model(str(final_path))
    return onnx.load(str(final_path), load_external_data=False)


def describe_io(values, declared_axes: Mapping[str, Mapping[int, str]]) -> dict[str, dict]:
    """Name -> dtype, shape (ints and symbols) and symbolic axes, checked against the declaration."""
    described = {}
    for value in values:
        tensor_type = value.type.tensor_type
        shape = [dim.dim_param if dim.dim_param else dim.dim_value for dim in tensor_type.shape.dim]
        axes = {str(i): dim for i, dim in enumerate(shape) if isinstance(dim, str)}
        expected = {str(i): sym for i, sym in declared_axes.get(value.name, {}).items()}
        if axes != expected:
            raise RuntimeError(
                f"{value.name}: exported symbolic axes {axes} differ from the declared {expected}"
            )
        described[value.name] = {
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name,
            "shape": shape,
            "axes": axes,
        }
    return described


def language_example(adapter_parts, config_dims, num_layers: int, position_rows: int | None) -> tuple:
    """Small example inputs of the language program (a chunk with a few placeholders)."""
    seq, rows, ctx = EXAMPLE_SEQ_LEN, EXAMPLE_VISION_ROWS, EXAMPLE_CTX_LEN
    input_ids = torch.ones(1, seq, dtype=torch.int64)
    input_ids[0, 2 : 2 + rows - 1] = adapter_parts.image_token_id
    positions = torch.arange(seq, dtype=torch.int64).view(1, seq)
    if position_rows is not None:
        positions = positions.unsqueeze(0).repeat(position_rows, 1, 1)
    vision_embeds = torch.randn(1, rows, config_dims.hidden_size)
    image_idx = torch.zeros(1, 1, dtype=torch.int64)
    kv_shape = (1, config_dims.num_kv_heads, ctx, config_dims.head_dim)
    past = [torch.zeros(kv_shape) for _ in range(2 * num_layers)]
    return (input_ids, positions, vision_embeds, image_idx, *past)


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    force: bool = False,
    progress: Progress | None = stderr_progress,
) -> ExportResult:
    """Export ``model_dir``'s vision encoder and language decoder to ``out_dir``.

    Args:
        model_dir: A Hugging Face checkpoint directory (config, safetensors, processor).
        out_dir: Output directory; must be empty or absent unless ``force``.
        force: Replace a non-empty ``out_dir``.
        progress: Called with one line per stage; ``None`` silences progress.

    Returns:
        The :class:`ExportResult`.
    """
    say = progress or _quiet
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_nonempty_dir(out_dir) and not force:
        raise UserError(f"{out_dir} is not empty; pass --force to replace it")
    description = describe_checkpoint(model_dir)
    family = family_for(description)
    dims = family.text_dims(description)
    timings: dict[str, float] = {}

    start = time.perf_counter()
    say(f"load: {model_dir} ({family.title})")
    adapter = load_adapter(family)
    model = _load_model(adapter, model_dir)
    timings["load"] = time.perf_counter() - start

    with staged_directory(out_dir, force=force) as staging:
        start = time.perf_counter()
        say("patch: symbolic vision tower, retained-state KV decoder")
        encoder = adapter.vision_encoder(model)
        parts = adapter.decoder_parts(model)
        decoder = LanguageDecoder(parts).eval()
        timings["patch"] = time.perf_counter() - start

        programs = {}
        start = time.perf_counter()
        say("export vision")
        vision_example = adapter.vision_example_inputs(model)
        vision_axes = {**family.vision_input_axes, **family.vision_output_axes}
        programs["vision"] = _export_program(
            staging,
            "vision",
            encoder,
            tuple(vision_example.values()),
            list(vision_example),
            list(family.vision_output_axes),
            vision_axes,
        )
        timings["export_vision"] = time.perf_counter() - start

        start = time.perf_counter()
        say("export language")
        in_axes = family.language_input_axes(dims.num_layers)
        out_axes = family.language_output_axes(dims.num_layers)
        example = language_example(parts, dims, dims.num_layers, family.position_id_rows)
        programs["lang"] = _export_program(
            staging, "lang", decoder, example, list(in_axes), list(out_axes), {**in_axes, **out_axes}
        )
        timings["export_language"] = time.perf_counter() - start

        start = time.perf_counter()
        say("check: onnxruntime loads both graphs")
        check_loads(staging, programs)
        timings["check"] = time.perf_counter() - start

        manifest = {
            "family": family.name,
            "model": str(model_dir.resolve()),
            "config_hash": config_hash(model_dir),
            "opset": OPSET,
            "dtype": "float32",
            "image_token_id": parts.image_token_id,
            "num_layers": dims.num_layers,
            "programs": programs,
            "versions": _versions(),
        }
        atomic_write_json(staging / EXPORT_FILE, manifest)
    return ExportResult(out_dir, manifest, timings)


def _export_program(staging: Path, program: str, module, example, input_names, output_names, axes) -> dict:
    directory = staging / program
    directory.mkdir()
    raw = directory / "traced.onnx"
    _torch_export(module, example, raw, input_names, output_names, axes, custom=program == "lang")
    with torch.no_grad():
        outputs = module(*example)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    final = directory / "model.onnx"
    model = _finalize(raw, final, outputs, axes)
    return {
        "path": f"{program}/model.onnx",
        "inputs": describe_io(model.graph.input, axes),
        "outputs": describe_io(model.graph.output, axes),
    }


def check_loads(root: Path, programs: Mapping[str, dict]) -> None:
    """Every program loads in onnxruntime (functions inlined, external data found)."""
    import onnxruntime as ort

    for program in programs.values():
        ort.InferenceSession(str(root / program["path"]), providers=["CPUExecutionProvider"])


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
