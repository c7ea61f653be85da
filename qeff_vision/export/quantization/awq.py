"""AWQ checkpoints (``quant_method: awq``, ``version: gemm``), as AutoAWQ writes them.

Per linear module (the dense weight is [out, in]): ``qweight`` [in, out / 8] int32, ``qzeros``
[in / group, out / 8] int32 and ``scales`` [in / group, out]. Eight 4-bit values share a word
along the output axis, written in AutoAWQ's order: nibble ``j`` (bits ``4j..4j+3``) holds output
column ``8 * word + [0, 2, 4, 6, 1, 3, 5, 7][j]`` (ref: AutoAWQ awq/modules/linear/gemm.py
``WQLinear_GEMM.from_linear``, the ``order_map`` loop; unpacking: awq/utils/packing_utils.py
``unpack_awq`` and ``reverse_awq_order`` with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``).
The weight is ``(q - zero) * scale`` per group of ``group_size`` inputs, transposed to [out, in]
(``dequantize_gemm`` there). Zero points are unsigned 4-bit values with no offset.
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

# Position in a word -> output column within the word's eight (AutoAWQ's order_map).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def find(model_dir: Path, config: dict[str, Any], entries: Mapping[str, Any]) -> dict[str, QuantizedTensor]:
    """The AWQ-packed linear weights.

    Raises:
        UserError: Another AWQ layout than GEMM, other than 4 bits, without zero points, or a
            module whose tensors are incomplete.
    """
    modules = sorted(module_of(k) for k in entries if k.endswith(".qweight"))
    if not modules:
        return {}
    first = f"{modules[0]}.qweight"
    bits, version = (
        int(config.get("bits", config.get("w_bit", 4))),
        str(config.get("version", "gemm")).lower(),
    )
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    name = f"awq {version} {bits}-bit group {group}"
    if version != "gemm" or bits != 4:
        raise refuse(model_dir, name, first, "AutoAWQ's GEMM layout, 4 bits only")
    if config.get("zero_point") is False:
        raise refuse(model_dir, name + " without zero points", first)
    found = {}
    for module in modules:
        parts = (f"{module}.qweight", f"{module}.qzeros", f"{module}.scales")
        missing = [p for p in parts if p not in entries]
        if missing:
            raise UserError(f"{model_dir}: {parts[0]!r} has no {missing[0]!r} beside it (AWQ)")
        if not_converted(module, config.get("modules_to_not_convert")):
            raise UserError(
                f"{model_dir}: {parts[0]!r} is packed but its module is in modules_to_not_convert"
            )
        rows = entries[parts[0]].shape[0]
        if group <= 0 or entries[parts[2]].shape[0] != -(-rows // group):
            raise UserError(f"{model_dir}: {parts[2]!r} does not hold one row per {group} inputs (AWQ)")
        found[f"{module}.weight"] = QuantizedTensor(
            f"{module}.weight", parts, functools.partial(_decode, group=group, scheme=name)
        )
    return found


def unpack_awq(words: torch.Tensor, columns: int) -> torch.Tensor:
    """AutoAWQ-packed words [rows, columns / 8] -> unsigned 4-bit values [rows, columns]."""
    sequential = unpack_words(words, 4, words.shape[-1] * 8, dim=-1)
    grouped = sequential.reshape(*words.shape, 8)
    ordered = torch.empty_like(grouped)
    ordered[..., list(AWQ_ORDER)] = grouped  # nibble j holds column AWQ_ORDER[j]
    return ordered.reshape(*words.shape[:-1], -1).narrow(-1, 0, columns)


def _decode(tensors: Sequence[torch.Tensor], group: int, scheme: str) -> tuple[QuantizedWeight, bool]:
    qweight, qzeros, scales = tensors
    out = scales.shape[-1]
    data = unpack_awq(qweight, out).t().contiguous()  # [out, in]
    zero = unpack_awq(qzeros, out).t().contiguous()  # [out, in / group]
    return QuantizedWeight(data, 4, scales.t().contiguous(), zero, 1, group, scheme), True
