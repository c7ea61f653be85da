"""Bytes on disk per parameter and export seconds for each way of storing weights, against the checkpoint.

Usage:
    python benchmarks/weight_bytes.py                          # tiny Qwen2.5-VL (seconds)
    python benchmarks/weight_bytes.py --config qwen2_5_vl-3b   # real widths, depth cut
    python benchmarks/weight_bytes.py --config qwen3_vl-4b

One bf16 checkpoint is drawn (the tiny one, or a pinned config at its real widths with two text and
two vision layers: ``qeff_vision.real_width``) and exported in each form
(docs/guide/weights-on-disk.md):

* ``float32``: 4 bytes a parameter, what export wrote before;
* ``float16``: the form an fp16-compiled program gets (``weights.dtype: auto`` on ai100);
* ``int4-kept`` / ``fp8-kept``: the same checkpoint as a quantized release would ship it (int4
  group-32 symmetric with bf16 scales, as compressed-tensors' pack-quantized; FP8 e4m3 with a
  float32 scale per 128x128 block, as the FP8 releases' ``weight_scale_inv``), exported with
  ``keep_quantized``. The quantized checkpoint is simulated: :func:`quantized_checkpoint` hands the
  ONNX writer each linear weight's :class:`QuantizedWeight` (what the format readers return), and
  its own bytes are counted as that format stores them.

Columns: the checkpoint's bytes, the ONNX files' bytes (graph + external data, both programs),
bytes per exported parameter (weights alone, and every file: the graph and the 4 KiB page
alignment of each tensor count at tiny sizes), the files' ratio to the checkpoint, weights kept
float32, values below fp16's normal range rounded in float16 weights, weights kept quantized, and
export seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "qwen2_5_vl-3b": ("qwen2_5_vl", ROOT / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct"),
    "qwen3_vl-4b": ("qwen3_vl", ROOT / "specs" / "configs" / "Qwen3-VL-4B-Instruct"),
}
GROUP = 32  # int4 group size (compressed-tensors' pack-quantized, Kimi-K2.5's experts)
FP8_BLOCK = 128  # FP8 block-wise releases' weight_block_size [128, 128]
FP8_MAX = 448.0  # largest float8_e4m3fn
SCHEMES = ("int4-g32", "int4-asym", "fp8-channel", "fp8-block")


def quantizable(key: str, shape: tuple[int, ...]) -> bool:
    """Whether a quantized release stores this weight quantized: linear and expert weights only."""
    lowered = key.lower()
    skipped = ("embed", "lm_head", "norm", "bias")
    return len(shape) in (2, 3) and shape[-1] % GROUP == 0 and not any(s in lowered for s in skipped)


def quantize(values: torch.Tensor, scheme: str):
    """``values`` (float) in a quantized checkpoint's stored form (a QuantizedWeight).

    int4-g32: symmetric int4, a bf16 scale per 32 along the input axis; int4-asym: uint4 with a
    zero point per group (AWQ/GPTQ style, fp16 scales); fp8-channel: e4m3 with a float32 scale per
    output row (per expert and row for a stack); fp8-block: e4m3 with a float32 scale per 128x128
    block, given expanded along the row axis (DequantizeLinear blocks along one axis).
    """
    from qeff_vision.export.quantized_weight import QuantizedWeight

    values = values.to(torch.float32)
    last = values.dim() - 1
    if scheme.startswith("int4"):
        groups = values.reshape(*values.shape[:-1], -1, GROUP)
        if scheme == "int4-g32":
            scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16).to(torch.float32)
            data = (groups / scale[..., None]).round().clamp(-8, 7).to(torch.int8).reshape(values.shape)
            return QuantizedWeight(data, 4, scale.to(torch.bfloat16), None, last, GROUP, scheme)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8).to(torch.float16).to(torch.float32)
        zero = (-low / scale).round().clamp(0, 15)
        data = ((groups / scale[..., None]).round() + zero[..., None]).clamp(0, 15)
        data = data.to(torch.uint8).reshape(values.shape)
        return QuantizedWeight(data, 4, scale.to(torch.float16), zero.to(torch.uint8), last, GROUP, scheme)
    if scheme == "fp8-channel":
        scale = (values.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        data = (values / scale).to(torch.float8_e4m3fn)
        return QuantizedWeight(data, 8, scale, None, last, values.shape[-1], scheme)
    if scheme == "fp8-block":
        rows, cols = values.shape[-2:]
        pad = (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK)
        padded = torch.nn.functional.pad(values, pad)
        blocks = padded.reshape(*values.shape[:-2], padded.shape[-2] // FP8_BLOCK, FP8_BLOCK, -1, FP8_BLOCK)
        scale = (blocks.abs().amax((-3, -1)) / FP8_MAX).clamp(min=1e-12)  # [..., row blocks, col blocks]
        expanded = scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :rows, :]
        full = expanded.repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]
        data = (values / full).to(torch.float8_e4m3fn)
        return QuantizedWeight(data, 8, expanded.contiguous(), None, last, FP8_BLOCK, scheme)
    raise ValueError(f"unknown scheme {scheme!r}")


def stored_bytes(shape: tuple[int, ...], scheme: str) -> int:
    """Bytes a quantized checkpoint stores for one weight of ``shape`` (values, scales, zero points)."""
    count = 1
    for dim in shape:
        count *= dim
    if scheme == "int4-g32":
        return count // 2 + count // GROUP * 2
    if scheme == "int4-asym":
        return count // 2 + count // GROUP * 2 + count // GROUP // 2
    if scheme == "fp8-channel":
        return count + count // shape[-1] * 4
    rows, cols = shape[-2:]
    leading = count // (rows * cols)
    return count + leading * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK) * 4


@contextlib.contextmanager
def quantized_checkpoint(scheme: str | None) -> Iterator[None]:
    """While active, export reads the checkpoint as a ``scheme`` release of itself.

    ``WeightPlan.stored`` returns each quantizable weight's :class:`QuantizedWeight` and
    ``WeightPlan.read`` its dequantized values, so an export that keeps weights quantized and one
    that does not describe the same values. ``scheme`` may cycle per weight: ``"mixed"`` gives the
    weights the four schemes in turn. None: the plain checkpoint.
    """
    from qeff_vision.export.weights import WeightPlan

    if scheme is None:
        yield
        return
    original_read, original_stored = WeightPlan.read, WeightPlan.stored
    cache: dict[tuple, object] = {}  # by source and shape: ids of freed parameters come back
    order: dict[str, int] = {}

    def stored(self, param):
        source = self.sources[id(param)]
        if not param.is_floating_point() or not quantizable(source.key, tuple(param.shape)):
            return None
        key = (source, tuple(param.shape))
        if key not in cache:
            chosen = scheme
            if scheme == "mixed":
                chosen = SCHEMES[order.setdefault(source.key, len(order)) % len(SCHEMES)]
            cache[key] = quantize(original_read(self, param), chosen)
        return cache[key]

    def read(self, param):
        weight = stored(self, param)
        return original_read(self, param) if weight is None else weight.dequantize(self.dtype)

    WeightPlan.stored, WeightPlan.read = stored, read
    try:
        yield
    finally:
        WeightPlan.stored, WeightPlan.read = original_stored, original_read


def checkpoint_bytes(model_dir: Path, scheme: str | None) -> int:
    """The checkpoint's own bytes: its tensors, quantizable ones as ``scheme`` stores them."""
    from qeff_vision.export.weights import Checkpoint

    total = 0
    for key, entry in Checkpoint(model_dir).entries.items():
        if scheme is not None and entry.dtype.is_floating_point and quantizable(key, entry.shape):
            total += stored_bytes(entry.shape, scheme)
        else:
            total += entry.length
    return total


def bf16_checkpoint(config: str, out: Path) -> Path:
    """The benchmark's bf16 checkpoint: tiny Qwen2.5-VL, or a pinned config at real widths (depth cut)."""
    from qeff_vision import api
    from qeff_vision.real_width import build_real_width_checkpoint

    if config == "tiny":
        directory = api.tiny("qwen2_5_vl", out / "tiny")
        _to_bfloat16(directory)
        return directory
    family, pinned = CONFIGS[config]
    return build_real_width_checkpoint(family, out / config, config=pinned, dtype="bfloat16")


def _to_bfloat16(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(bf16, path, metadata={"format": "pt"})


FORMS = {  # label -> (checkpoint scheme, weight dtype, keep quantized)
    "float32": (None, "float32", False),
    "float16": (None, "float16", False),
    "int4-kept": ("int4-g32", "float16", True),
    "fp8-kept": ("fp8-block", "float16", True),
}


def onnx_bytes(export_dir: Path) -> int:
    """Bytes of every file of both programs (graph and external data)."""
    return sum(
        path.stat().st_size for program in ("vision", "lang") for path in (export_dir / program).iterdir()
    )


def measure(config: str, work: Path, forms=tuple(FORMS), checkpoints: Path | None = None) -> list[dict]:
    """One row per form: checkpoint bytes, ONNX bytes, parameters, seconds.

    ``checkpoints``: where the drawn checkpoint is kept and found again (``--checkpoints``; default
    ``work``, which goes away).
    """
    from qeff_vision.exporter import export_model

    home = checkpoints or work
    checkpoint = home / ("tiny" if config == "tiny" else config)
    if not (checkpoint / "config.json").is_file():
        checkpoint = bf16_checkpoint(config, home)
    rows = []
    for label in forms:
        scheme, dtype, keep = FORMS[label]
        out = work / f"export-{label}"
        with quantized_checkpoint(scheme):
            start = time.perf_counter()
            result = export_model(checkpoint, out, progress=None, weight_dtype=dtype, keep_quantized=keep)
            seconds = time.perf_counter() - start
        weights = [result.manifest["programs"][p]["weights"] for p in ("vision", "lang")]
        rows.append(
            {
                "config": config,
                "form": label,
                "checkpoint": "bf16" if scheme is None else scheme,
                "checkpoint_bytes": checkpoint_bytes(checkpoint, scheme),
                "onnx_bytes": onnx_bytes(out),
                "parameters": sum(w["parameters"] for w in weights),
                "weight_bytes": sum(w["bytes"] for w in weights),
                "kept_float32": sum(len(w["kept_float32"]) for w in weights),
                "rounded": sum(c["below_normal"] for w in weights for c in w["rounded_below_normal"]),
                "quantized": sum(sum(w["quantized"].values()) for w in weights),
                "seconds": seconds,
            }
        )
        shutil.rmtree(out)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table of :func:`measure`'s rows."""
    lines = [
        "| config | form | checkpoint | checkpoint MB | ONNX MB | B/param (weights) | B/param (files) | "
        "ONNX / checkpoint | kept fp32 | tiny values rounded | quantized | export s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        mb = row["checkpoint_bytes"] / 1e6
        lines.append(
            f"| {row['config']} | {row['form']} | {row['checkpoint']} | {mb:,.1f} | "
            f"{row['onnx_bytes'] / 1e6:,.1f} | {row['weight_bytes'] / row['parameters']:.3f} | "
            f"{row['onnx_bytes'] / row['parameters']:.3f} | "
            f"{row['onnx_bytes'] / row['checkpoint_bytes']:.3f} | {row['kept_float32']} | "
            f"{row['rounded']:,} | {row['quantized']} | {row['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["tiny"], choices=["tiny", *CONFIGS])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS), metavar="FORM")
    parser.add_argument(
        "--checkpoints", type=Path, default=None, help="keep the drawn checkpoints here and reuse them"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="The tiny checkpoint (a quick check of every form)."
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "weight_bytes", argv):
        configs = ["tiny"] if args.smoke else args.config
        rows = []
        for config in configs:
            with tempfile.TemporaryDirectory(prefix="qeff-weight-bytes-", dir=args.work) as scratch:
                rows += measure(config, Path(scratch), args.forms, args.checkpoints)
                print(f"{config}: done", file=sys.stderr, flush=True)
        print(table(rows))


if __name__ == "__main__":
    main()
