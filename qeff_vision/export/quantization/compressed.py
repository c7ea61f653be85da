"""compressed-tensors checkpoints (``quant_method: compressed-tensors``): FP8 and packed integers.

The config's ``config_groups`` give each group of modules (``targets``: module names, ``re:``
regular expressions, or a class name such as ``Linear``) a scheme: how ``weights`` are stored
and how ``input_activations`` are quantized at run time; ``ignore`` lists modules left dense; a
group's ``format`` (or the config's) names the compressor (ref: compressed-tensors
quantization/quant_config.py ``QuantizationConfig``, quant_scheme.py ``QuantizationScheme``).

Read here, dequantized as the library's own ``decompress`` does:

- FP8 weights (``type: float``, 8 bits; ``float-quantized`` / ``naive-quantized``): ``weight`` in
  float8_e4m3fn and ``weight_scale`` per tensor, per output channel [out, 1] or per block
  (``block_structure``); ``weight * scale``. Their ``input_activations`` (FP8, static or
  dynamic) only say how a FP8 matmul would quantize its input at run time, which a weight-only
  dequantization does not do: ignored, as the library's own decompression ignores them.
- Integer weights without activation quantization (``type: int``, 4 or 8 bits, symmetric;
  ``pack-quantized``): ``weight_packed`` int32 (values + 2^(bits-1) packed low bits first,
  ``32 / bits`` to a word along the input axis), ``weight_shape``, ``weight_scale`` per group
  of ``group_size`` inputs, per channel or per tensor; ``(value) * scale`` (ref:
  compressed-tensors compressors/pack_quantized/helpers.py ``pack_to_int32`` /
  ``unpack_from_int32``, base.py ``PackedQuantizationCompressor.decompress``). Kimi-K2.5
  ships its routed experts so, group size 32. An ``int-quantized`` 8-bit ``weight`` is read as is.

Refused in one line: integer weights with quantized activations (W8A8 int8: the checkpoint's
accuracy depends on quantizing activations, which the exported program would not do),
asymmetric integers, other bit widths, FP4 and other compressors, sparsity formats.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qeff_vision.errors import UserError
from qeff_vision.export.quantization.forms import grid_form, unpack_words
from qeff_vision.export.quantization.rules import refuse, targeted
from qeff_vision.export.quantization.tensors import QuantizedTensor, module_of
from qeff_vision.export.quantized_weight import QuantizedWeight

# The leaves that mark a module stored quantized.
MARKERS = (".weight_packed", ".weight_scale")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def find(model_dir: Path, config: dict[str, Any], entries: Mapping[str, Any]) -> dict[str, QuantizedTensor]:
    """The quantized weights of a compressed-tensors checkpoint, each by its module's scheme.

    Raises:
        UserError: A scheme not read here, or a module stored quantized that no group targets
            (or that the ignore list names).
    """
    sparsity = config.get("sparsity_config") or {}
    modules = sorted({module_of(k) for k in entries if k.endswith(MARKERS)})
    if sparsity.get("format") not in (None, "dense") and modules:
        raise refuse(model_dir, f"compressed-tensors sparsity {sparsity.get('format')!r}", sorted(entries)[0])
    groups = config.get("config_groups") or {}
    found = {}
    for module in modules:
        values = [f"{module}.weight_packed", f"{module}.weight"]
        first = next((k for k in values if k in entries), f"{module}.weight_scale")
        if targeted(module, config.get("ignore")):
            raise UserError(
                f"{model_dir}: {first!r} is stored quantized but its module is in the ignore list"
            )
        group = next((g for g in groups.values() if targeted(module, g.get("targets"))), None)
        if group is None:
            raise UserError(
                f"{model_dir}: {first!r} is stored quantized but no config group targets {module!r}"
            )
        fmt = group.get("format") or config.get("format") or "dense"
        found[f"{module}.weight"] = _tensor(model_dir, module, first, group, fmt, entries)
    return found


def _tensor(model_dir, module: str, first: str, group: dict, fmt: str, entries) -> QuantizedTensor:
    """The reader of one module's weight under its group's scheme, or the refusal of the scheme."""
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    kind, bits = weights.get("type"), int(weights.get("num_bits", 0))
    strategy = weights.get("strategy")
    name = _scheme_name(weights, acts, fmt)
    if acts and (kind == "int" or acts.get("type") == "int"):
        raise refuse(model_dir, name, first, "activations quantized to integers at run time")
    if weights.get("dynamic"):
        raise refuse(model_dir, name, first, "dynamic weight scales are not stored")
    if kind == "float" and bits == 8 and fmt in FLOAT_FORMATS and strategy in ("tensor", "channel", "block"):
        block = (1, 1)  # per tensor: one scale value
        if strategy == "channel":
            block = (1, entries[f"{module}.weight"].shape[-1])
        elif strategy == "block":
            block = tuple(int(b) for b in weights.get("block_structure") or (128, 128))
        parts = (f"{module}.weight", f"{module}.weight_scale")
        return QuantizedTensor(parts[0], parts, functools.partial(_decode_stored, block=block, scheme=name))
    if kind == "int" and bits in (4, 8) and fmt in INT_FORMATS and strategy in ("tensor", "channel", "group"):
        if not weights.get("symmetric", True):
            raise refuse(model_dir, name, first, "asymmetric integers")
        group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
        if fmt != "pack-quantized":
            if bits != 8:
                raise refuse(model_dir, name, first, f"{fmt} stores 8-bit integers only")
            parts = (f"{module}.weight", f"{module}.weight_scale")
            decode = functools.partial(
                _decode_stored, block=(1, group_size or _cols(entries, parts[0])), scheme=name
            )
            return QuantizedTensor(parts[0], parts, decode)
        parts = (f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape")
        if f"{module}.weight_g_idx" in entries:  # activation ordering: groups by index
            parts += (f"{module}.weight_g_idx",)
        missing = [p for p in parts if p not in entries]
        if missing:
            raise UserError(f"{model_dir}: {first!r} is pack-quantized but {missing[0]!r} is missing")
        decode = functools.partial(_decode_packed, bits=bits, group_size=group_size, scheme=name)
        return QuantizedTensor(f"{module}.weight", parts, decode)
    raise refuse(model_dir, name, first)


def _cols(entries, key: str) -> int:
    return entries[key].shape[-1]


def _scheme_name(weights: dict, acts: dict | None, fmt: str) -> str:
    """``compressed-tensors W4A16 (int4 weights per group 32; pack-quantized)``-style name for messages."""
    bits, kind = weights.get("num_bits"), weights.get("type")
    detail = f"{kind}{bits} weights per {weights.get('strategy') or '?'}"
    if weights.get("strategy") == "group":
        detail += f" {weights.get('group_size')}"
    if weights.get("symmetric") is False:
        detail += " asymmetric"
    if acts:
        detail += f", {acts.get('type')}{acts.get('num_bits')} activations"
    abits = acts.get("num_bits") if acts else 16
    return f"compressed-tensors W{bits}A{abits} ({detail}; {fmt})"


def _decode_stored(tensors: Sequence[torch.Tensor], block, scheme: str) -> tuple[QuantizedWeight, bool]:
    """A weight stored unpacked (FP8 or int8) with its scale grid."""
    data, scale = tensors
    if scale.numel() > 1 and block == (1, 1):
        raise UserError(f"{scheme}: a per-tensor scale has {scale.numel()} values")
    return grid_form(data, scale, None, block, 8, scheme), True


def _decode_packed(
    tensors: Sequence[torch.Tensor], bits: int, group_size: int, scheme: str
) -> tuple[QuantizedWeight, bool]:
    """A ``pack-quantized`` weight: unpacked to signed values in the dense weight's shape."""
    packed, scale, shape = tensors[:3]
    shape = tuple(int(s) for s in shape.tolist())
    unsigned = unpack_words(packed, bits, shape[-1], dim=-1).reshape(shape)
    data = (unsigned.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    if len(tensors) == 4:  # weight_g_idx: the group of each input column
        g_idx = tensors[3].to(torch.int64)
        if group_size and torch.equal(g_idx, torch.arange(shape[-1]) // group_size):
            return grid_form(data, scale, None, (1, group_size), bits, scheme), True
        return QuantizedWeight(
            data, bits, scale.index_select(-1, g_idx), None, data.dim() - 1, 1, scheme
        ), False
    block = (1, group_size or shape[-1])
    return grid_form(data, scale, None, block, bits, scheme), True
