"""FP8 checkpoints: block-wise (``quant_method: fp8``) and per-channel (``quant_method: fbgemm_fp8``).

Block-wise, as transformers' FineGrainedFP8 reads it (Qwen3-VL-*-FP8, Qwen3.5 FP8, DeepSeek-V3):
a ``float8_e4m3fn`` tensor ``W`` beside ``W_scale_inv`` (float32), one scale per
``weight_block_size`` block of the last two axes (ceil-sized at the edges), and the weight is
``W * scale`` per block (ref: transformers v5 integrations/finegrained_fp8.py
``_dequantize_fp8_weight`` and ``Fp8Dequantize._dequantize_one``). Without a block size the scale is
one number per tensor.

Per-channel (``fbgemm_fp8``, the format of Llama-4-Maverick-17B-128E-Instruct-FP8, whose config
has ``quant_method: fbgemm_fp8``, ``activation_scale_ub`` and ``modules_to_not_convert``):
``float8_e4m3fn`` ``W`` beside ``W_scale``, one float32 scale per output channel. A linear weight
[out, in] has scale [out, 1]; Llama 4's stacked experts [experts, in, out] have scale
[experts, 1, out] (``gate_up_proj``) or [experts, out, 1] (``down_proj``), both one per output
column (ref: transformers v5 integrations/fbgemm_fp8.py ``FbgemmFp8Quantize.convert`` and
``FbgemmFp8Llama4TextExperts.forward``). Activation scales (``activation_scale_ub``,
``input_scale``) matter only to FP8 matmuls and are not read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qeff_vision.errors import UserError
from qeff_vision.export.quantization.forms import grid_form, grid_shape
from qeff_vision.export.quantization.rules import not_converted, refuse
from qeff_vision.export.quantization.tensors import QuantizedTensor, module_of
from qeff_vision.export.quantized_weight import QuantizedWeight

FP8 = torch.float8_e4m3fn


def find_block(
    model_dir: Path, config: dict[str, Any], entries: Mapping[str, Any]
) -> dict[str, QuantizedTensor]:
    """The block-wise FP8 weights of a ``quant_method: fp8`` checkpoint.

    Raises:
        UserError: Another FP8 encoding than e4m3, or a weight without a scale of the block grid.
    """
    fp8_keys = _fp8_keys(model_dir, entries, config)
    if str(config.get("fmt", "e4m3")).lower() != "e4m3" and fp8_keys:
        raise refuse(model_dir, f"fp8 fmt {config.get('fmt')!r}", fp8_keys[0], "e4m3 only")
    block = config.get("weight_block_size")
    block = tuple(int(b) for b in block) if block else None
    if block is not None and len(block) != 2:
        raise refuse(model_dir, f"fp8 weight_block_size {list(block)}", fp8_keys[0] if fp8_keys else "(none)")
    found = {}
    for key in fp8_keys:
        scale_key = f"{key}_scale_inv"
        _check_scale(model_dir, key, scale_key, entries, block)
        found[key] = QuantizedTensor(key, (key, scale_key), functools.partial(_decode_block, block=block))
    return found


def find_per_channel(
    model_dir: Path, config: dict[str, Any], entries: Mapping[str, Any]
) -> dict[str, QuantizedTensor]:
    """The per-channel FP8 weights of a ``quant_method: fbgemm_fp8`` checkpoint.

    Raises:
        UserError: A weight without a per-output-channel scale beside it.
    """
    found = {}
    for key in _fp8_keys(model_dir, entries, config):
        scale_key = f"{key}_scale"
        shape = tuple(entries[key].shape)
        scale = tuple(entries[scale_key].shape) if scale_key in entries else None
        lead, (rows, cols) = shape[:-2], shape[-2:]
        per_row = len(shape) == 2 and scale == (rows, 1)
        per_column = len(shape) == 3 and scale in ((*lead, 1, cols), (*lead, cols, 1))
        if scale is None or not (per_row or per_column or _numel(scale) == 1):
            raise UserError(
                f"{model_dir}: {key!r} is float8 but {scale_key!r} is "
                f"{'missing' if scale is None else scale}, not one scale per output channel (fbgemm_fp8)"
            )
        found[key] = QuantizedTensor(key, (key, scale_key), _decode_per_channel)
    return found


def _fp8_keys(model_dir: Path, entries: Mapping[str, Any], config: dict[str, Any]) -> list[str]:
    """The float8 tensors, checked against ``modules_to_not_convert``."""
    keys = sorted(k for k, e in entries.items() if e.dtype in (FP8, torch.float8_e5m2))
    skip = config.get("modules_to_not_convert")
    for key in keys:
        if entries[key].dtype != FP8:
            raise refuse(model_dir, "fp8 e5m2", key, "float8_e4m3fn only")
        if len(entries[key].shape) < 2:
            raise refuse(
                model_dir, f"{config.get('quant_method')} on a {len(entries[key].shape)}-D tensor", key
            )
        if not_converted(module_of(key), skip):
            raise UserError(f"{model_dir}: {key!r} is float8 but its module is in modules_to_not_convert")
    return keys


def _check_scale(model_dir: Path, key: str, scale_key: str, entries, block) -> None:
    shape = tuple(entries[key].shape)
    scale = tuple(entries[scale_key].shape) if scale_key in entries else None
    expected = grid_shape(shape, block) if block else None
    if scale is None or (scale != expected and not (block is None and _numel(scale) == 1)):
        raise UserError(
            f"{model_dir}: {key!r} is float8 but {scale_key!r} is "
            f"{'missing' if scale is None else scale}, not the {expected or 'per-tensor'} scale grid "
            f"of weight_block_size {list(block) if block else None}"
        )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _decode_block(tensors: Sequence[torch.Tensor], block) -> tuple[QuantizedWeight, bool]:
    data, scale = tensors
    return grid_form(data, scale, None, block or (1, 1), 8, "fp8-block"), True


def _decode_per_channel(tensors: Sequence[torch.Tensor]) -> tuple[QuantizedWeight, bool]:
    data, scale = tensors
    if scale.numel() == 1:
        return QuantizedWeight(data, 8, scale.reshape(()), None, 0, 0, "fp8-channel"), True
    if data.dim() == 2:  # [out, in] with [out, 1]: one scale per row
        return QuantizedWeight(data, 8, scale.reshape(-1), None, 0, 0, "fp8-channel"), True
    if scale.shape[-1] == 1 and scale.shape[-2] != 1:  # [experts, out, 1] for [experts, in, out]
        scale = scale.transpose(-1, -2)
    # [experts, 1, out]: one scale per output column, i.e. a single block along the input axis.
    return QuantizedWeight(data, 8, scale, None, data.dim() - 2, data.shape[-2], "fp8-channel"), True
