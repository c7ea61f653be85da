"""A weight kept as its checkpoint stores it: quantized values, scales and zero points.

The meeting point of two halves of export. The checkpoint readers (``weight_sources``) know each
published format (FP8 block-wise, compressed-tensors, AWQ, GPTQ) and hand out this description of
a parameter's stored form; the ONNX weight writer (``weights.write_weights``) turns it into
initializers feeding an ONNX ``DequantizeLinear`` (opset 21 semantics, blocked quantization
included) instead of a dequantized float tensor, so the graph on disk stays close to the
checkpoint's own bytes.

The values it stands for are ``(data - zero_point) * scale``, where ``scale`` and ``zero_point``
are repeated ``block_size`` times along ``axis`` (ONNX blocked quantization), broadcast along
``axis`` (per channel, ``block_size`` 0 and a 1-D scale) or used as one number (per tensor, a
0-D scale). A two-dimensional block grid (FP8's 128 x 128 blocks) is given in its expanded form
along one axis, since ``DequantizeLinear`` blocks along one axis only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """One parameter's stored form, in the parameter's own layout (shape and axis order).

    Attributes:
        data: Quantized values, one per element, shaped like the parameter: ``torch.int8`` /
            ``torch.uint8`` holding 4- or 8-bit integers (unpacked; the writer packs int4 two per
            byte), or ``torch.float8_e4m3fn``.
        bits: 4 or 8.
        scale: Floating-point scales (float32, float16 or bfloat16).
        zero_point: Integer zero points shaped like ``scale`` (same integer kind as ``data``), or
            None for symmetric formats (zero).
        axis: The axis ``scale`` runs along (ignored for a 0-D scale).
        block_size: Elements per scale along ``axis``; 0 for per-channel or per-tensor.
        scheme: The format's name for messages and reports (``"fp8-block"``, ``"awq"``, ...).
    """

    data: torch.Tensor
    bits: int
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    axis: int
    block_size: int
    scheme: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float values this form stands for (``DequantizeLinear``'s formula), in ``dtype``."""
        values = self.data.to(torch.float32)
        scale = self.scale.to(torch.float32)
        zero = None if self.zero_point is None else self.zero_point.to(torch.float32)
        if scale.dim() > 0:
            axis = self.axis % self.data.dim()
            if self.block_size:
                length = values.shape[axis]
                scale = scale.repeat_interleave(self.block_size, dim=axis).narrow(axis, 0, length)
                if zero is not None:
                    zero = zero.repeat_interleave(self.block_size, dim=axis).narrow(axis, 0, length)
            else:
                shape = [1] * values.dim()
                shape[axis] = -1
                scale = scale.reshape(shape)
                zero = None if zero is None else zero.reshape(shape)
        if zero is not None:
            values = values - zero
        return (values * scale).to(dtype)
