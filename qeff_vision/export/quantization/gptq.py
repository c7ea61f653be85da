"""GPTQ checkpoints (``quant_method: gptq``), as AutoGPTQ / GPTQModel write them.

Per linear module (the dense weight is [out, in]): ``qweight`` [in * bits / 32, out] int32 with
``32 / bits`` values to a word along the input axis, ``qzeros`` [groups, out * bits / 32] packed
along the output axis, both low bits first; ``scales`` [groups, out]; ``g_idx`` [in], the group
of each input row (ref: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
``QuantLinear.pack``). Without act-order ``g_idx[i] = i // group_size``; with act-order
(``desc_act``) rows were quantized in another order and ``g_idx`` is a permutation of groups.

Zero points: the classic format (``checkpoint_format: gptq``, "v1") stores ``zero - 1`` (the
``zeros -= 1`` of ``QuantLinear.pack``), wrapping -1 to all ones in the packed bits; it is
read back as ``(stored + 1) mod 2^bits``. ``gptq_v2`` stores the zero itself (ref: GPTQModel
gptqmodel/utils/model.py ``convert_gptq_v1_to_v2_format_module``). ``sym: true`` checkpoints
have the mid-range zero 2^(bits-1) either way. The weight is ``(q - zero[g_idx]) * scale[g_idx]``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qeff_vision.errors import UserError
from qeff_vision.export.quantization.forms import unpack_words
from qeff_vision.export.quantization.rules import not_converted, refuse
from qeff_vision.export.quantization.tensors import QuantizedTensor, module_of
from qeff_vision.export.quantized_weight import QuantizedWeight


def find(model_dir: Path, config: dict[str, Any], entries: Mapping[str, Any]) -> dict[str, QuantizedTensor]:
    """The GPTQ-packed linear weights.

    Raises:
        UserError: Bits other than 4 or 8, an unknown checkpoint format, or incomplete tensors.
    """
    modules = sorted(module_of(k) for k in entries if k.endswith(".qweight"))
    if not modules:
        return {}
    first = f"{modules[0]}.qweight"
    bits = int(config.get("bits", 4))
    version = str(config.get("checkpoint_format", "gptq")).lower()
    name = f"gptq {bits}-bit ({version})"
    if bits not in (4, 8):
        raise refuse(model_dir, name, first, "4 or 8 bits only")
    if version not in ("gptq", "gptq_v2"):
        raise refuse(model_dir, name, first, "checkpoint_format gptq or gptq_v2 only")
    found = {}
    for module in modules:
        parts = (f"{module}.qweight", f"{module}.qzeros", f"{module}.scales")
        missing = [p for p in parts if p not in entries]
        if missing:
            raise UserError(f"{model_dir}: {parts[0]!r} has no {missing[0]!r} beside it (GPTQ)")
        if not_converted(module, config.get("modules_to_not_convert")):
            raise UserError(
                f"{model_dir}: {parts[0]!r} is packed but its module is in modules_to_not_convert"
            )
        if f"{module}.g_idx" in entries:
            parts += (f"{module}.g_idx",)
        decode = functools.partial(
            _decode,
            bits=bits,
            group=int(config.get("group_size", 128)),
            offset=version == "gptq",
            scheme=name,
        )
        found[f"{module}.weight"] = QuantizedTensor(f"{module}.weight", parts, decode)
    return found


def _decode(
    tensors: Sequence[torch.Tensor], bits: int, group: int, offset: bool, scheme: str
) -> tuple[QuantizedWeight, bool]:
    qweight, qzeros, scales = tensors[:3]
    out = scales.shape[-1]
    rows = qweight.shape[0] * 32 // bits
    group = group if group > 0 else rows  # group_size -1: one group over all inputs
    ordered = torch.arange(rows) // group
    g_idx = tensors[3].to(torch.int64) if len(tensors) == 4 else ordered
    if g_idx.shape != (rows,) or int(g_idx.max()) >= scales.shape[0]:
        raise UserError(
            f"{scheme}: g_idx of {tuple(g_idx.shape)} does not index the {scales.shape[0]} groups"
        )
    data = unpack_words(qweight, bits, rows, dim=0).t().contiguous()  # [out, in]
    zero = unpack_words(qzeros, bits, out, dim=-1)
    if offset:  # v1 stores zero - 1
        zero = ((zero.to(torch.int16) + 1) & ((1 << bits) - 1)).to(torch.uint8)
    scale, zero = scales.t().contiguous(), zero.t().contiguous()  # [out, groups]
    if torch.equal(g_idx, ordered) and scales.shape[0] == -(-rows // group):
        return QuantizedWeight(data, bits, scale, zero, 1, group, scheme), True
    # Act-order: each input row's group, one scale per element of the input axis.
    return QuantizedWeight(data, bits, scale[:, g_idx], zero[:, g_idx], 1, 1, scheme), False
