"""Which reader a checkpoint's ``quantization_config`` names: the one entry point of the formats.

Its own module so the format modules (which build :class:`QuantizedTensor` of
:mod:`.tensors`) and the dispatch over them import in one direction only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qeff_vision.export.quantization import awq, compressed, fp8, gptq
from qeff_vision.export.quantization.rules import refuse
from qeff_vision.export.quantization.tensors import QUANTIZED_LEAVES, QuantizedTensor, quantization_config


def find_quantized(model_dir: Path, entries: Mapping[str, Any]) -> dict[str, QuantizedTensor]:
    """Dense weight name -> its quantized form, for every weight the checkpoint stores quantized.

    ``entries`` maps each checkpoint tensor name to its header entry (``dtype``, ``shape``).

    Raises:
        UserError: The config names a format or scheme export does not read, or the tensors do
            not match it.
    """
    config = quantization_config(model_dir)
    if config is None:
        stray = _first_quantized(entries)
        if stray is not None:
            raise refuse(model_dir, "(none declared: config.json has no quantization_config)", stray)
        return {}
    method = str(config.get("quant_method", "")).lower()
    readers = {
        "fp8": fp8.find_block,
        "fbgemm_fp8": fp8.find_per_channel,
        "compressed-tensors": compressed.find,
        "awq": awq.find,
        "gptq": gptq.find,
    }
    if method not in readers:
        first = _first_quantized(entries) or min(entries, default="(none)")
        raise refuse(model_dir, f"quant_method {method or '(missing)'!r}", first)
    return readers[method](model_dir, config, entries)


def _first_quantized(entries: Mapping[str, Any]) -> str | None:
    """The first tensor that only a quantized checkpoint would hold (by name or dtype)."""
    for key in sorted(entries):
        leaf = key.rsplit(".", 1)[-1]
        if leaf in QUANTIZED_LEAVES or entries[key].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return key
    return None
