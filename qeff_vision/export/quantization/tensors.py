"""A quantized checkpoint weight (the tensors storing it, how to decode them) and the format dispatch."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qeff_vision.errors import UserError
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


def module_of(key: str) -> str:
    """The module part of a tensor name (``a.b.weight`` -> ``a.b``)."""
    return key.rsplit(".", 1)[0] if "." in key else ""
