"""A quantized checkpoint weight (the tensors storing it, how to decode them) and the format dispatch."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qeff_vision.errors import UserError
from qeff_vision.export.quantization.rules import refuse
from qeff_vision.export.quantized_weight import QuantizedWeight

# decode(tensors in ``parts`` order) -> (stored form, whether DequantizeLinear can express it)
Decode = Callable[[Sequence[torch.Tensor]], tuple[QuantizedWeight, bool]]
# Leaf names that only quantized checkpoints use for weights (refused without a quantization config).
QUANTIZED_LEAVES = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv", "qzeros")


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight stored quantized, offered under the dense weight's checkpoint name.

    Attributes:
        key: The name a dense checkpoint would give the weight (``<module>.weight``).
        parts: The checkpoint tensors storing it, in the order ``decode`` takes them.
        decode: Builds the stored form in the dense weight's layout from those tensors, and says
            whether ``DequantizeLinear`` can express it (GPTQ act-order cannot).
    """

    key: str
    parts: tuple[str, ...]
    decode: Decode

    def form(self, read: Callable[[str], torch.Tensor]) -> tuple[QuantizedWeight, bool]:
        """The stored form, reading the parts with ``read``.

        Raises:
            UserError: The stored tensors' shapes do not fit together as the format says.
        """
        tensors = [read(part) for part in self.parts]
        try:
            return self.decode(tensors)
        except (ValueError, RuntimeError, IndexError) as error:
            shapes = ", ".join(f"{p} {tuple(t.shape)}" for p, t in zip(self.parts, tensors))
            raise UserError(
                f"{self.key}: the stored tensors do not fit their format ({shapes}): {error}"
            ) from None


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (None when it has none or no config.json)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the config reader reports it in its own words
    found = config.get("quantization_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) else None


def find_quantized(model_dir: Path, entries: Mapping[str, Any]) -> dict[str, QuantizedTensor]:
    """Dense weight name -> its quantized form, for every weight the checkpoint stores quantized.

    ``entries`` maps each checkpoint tensor name to its header entry (``dtype``, ``shape``).

    Raises:
        UserError: The config names a format or scheme export does not read, or the tensors do
            not match it.
    """
    from qeff_vision.export.quantization import awq, compressed, fp8, gptq

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


def module_of(key: str) -> str:
    """The module part of a tensor name (``a.b.weight`` -> ``a.b``)."""
    return key.rsplit(".", 1)[0] if "." in key else ""
