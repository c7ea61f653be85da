"""Published quantized checkpoints, read tensor by tensor and dequantized at read time.

A quantized checkpoint stores a linear weight as several tensors (quantized values, scales, zero
points, a group index) under names of its own (``qweight``, ``weight_packed``, ...). This package
finds those groups from the checkpoint's ``quantization_config`` and its tensor names, and gives
each one the name the dense weight would have (``<module>.weight``, or the stacked experts'
parameter name). The checkpoint reader then offers that name like any other tensor: reading it
decodes the stored form (:class:`~qeff_vision.export.quantized_weight.QuantizedWeight`) and
dequantizes it, so transformers' loading rules and the value conversions of
:mod:`qeff_vision.export.weight_sources` apply unchanged afterwards.

One module per format: :mod:`.fp8` (``quant_method: fp8`` block-wise and ``fbgemm_fp8``
per-channel), :mod:`.compressed` (compressed-tensors), :mod:`.awq`, :mod:`.gptq`. A format or
scheme none of them reads is one :class:`~qeff_vision.errors.UserError` line naming the scheme
and the first tensor stored in it.
"""

from qeff_vision.export.quantization.readers import find_quantized
from qeff_vision.export.quantization.tensors import QuantizedTensor

__all__ = ["QuantizedTensor", "find_quantized"]
