"""The spec's ``weights`` key: how the export stores weights on disk.

```yaml
weights:
  dtype: auto          # auto | float32 | float16 | bfloat16
  keep_quantized: false
```
``auto`` stores a program's float weights in float16 when it is compiled to fp16 (the spec's
``dtype: float16``, or ``-convert-to-fp16``, the ai100 default), in bfloat16 when the device
computes bfloat16 (``aic_hw_version: ai200``) and in float32 otherwise; the
graph computes in float32 either way (:mod:`qeff_vision.export.weight_forms`).
``keep_quantized`` writes weights a quantized checkpoint stores quantized as ``DequantizeLinear``
inputs. Plain ``qeff-vision export`` has no compile dtype and writes float32 unless told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qeff_vision.spec.strict_yaml import shown

if TYPE_CHECKING:  # the schema imports the spec model, which imports this module
    from qeff_vision.spec.schema import Reader

AUTO = "auto"
WEIGHT_DTYPE_CHOICES = (AUTO, "float32", "float16", "bfloat16")
WEIGHTS_KEYS = ("dtype", "keep_quantized")


@dataclass(frozen=True)
class WeightsSpec:
    """The spec's ``weights`` key.

    Attributes:
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16`` (``auto``: the dtype the device
            computes the program in, float32 when it computes fp32).
        keep_quantized: Keep quantized checkpoint weights quantized in the graphs.
    """

    dtype: str = AUTO
    keep_quantized: bool = False

    def program_dtype(self, compute_dtype: str) -> str:
        """The stored dtype of one program's float weights, given the dtype the device computes it in."""
        if self.dtype != AUTO:
            return self.dtype
        return compute_dtype if compute_dtype in ("float16", "bfloat16") else "float32"


def read_weights(reader: Reader, top: dict) -> WeightsSpec:
    """The ``weights`` key of a spec's top level (defaults when absent); problems go to ``reader``."""
    data: Any = top.get("weights")
    if data is None:
        return WeightsSpec()
    data = reader.mapping(data, "weights", WEIGHTS_KEYS)
    dtype = reader.text(data, "dtype", "weights", choices=WEIGHT_DTYPE_CHOICES, default=AUTO) or AUTO
    keep = data.get("keep_quantized", False)
    if not isinstance(keep, bool):
        reader.add("weights.keep_quantized", f"must be true or false (got {shown(keep)})")
        keep = False
    return WeightsSpec(dtype, keep)
