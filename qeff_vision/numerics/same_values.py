"""Values whose magnitudes are another value's, rearranged: their peaks need no reduction of their own.

A ``Reshape``, ``Transpose``, ``Squeeze``, ``Unsqueeze``, ``Flatten`` or ``Identity`` output holds
exactly its data input's elements, a ``Cast`` to the type the value already has the same values
(the exporter's ``.float()`` on a float tensor), a ``Neg`` the same magnitudes: each one's largest
magnitude below the mask sentinel is its input's, and whether it holds a sentinel or NaN too. The
recorder (:mod:`qeff_vision.numerics.recording`) reduces the input and copies the peak. At real
widths (a 0.67 B-parameter vision tower, a 1080p image) these were a third of the recorded values, and a
reduction read on a ``Transpose`` also keeps onnxruntime from fusing it into its ``MatMul``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx

# Ops whose output is their first input's elements, in another order or shape.
REARRANGING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Neg"})


def is_same_type_cast(node: onnx.NodeProto, types: Mapping[str, int]) -> bool:
    """``node`` is a ``Cast`` to the type its input already has (a copy of the same values)."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.input:
        return False
    target = next((attribute.i for attribute in node.attribute if attribute.name == "to"), None)
    return target is not None and types.get(node.input[0]) == target


def same_magnitudes(
    model: onnx.ModelProto, recorded: Collection[str], types: Mapping[str, int]
) -> dict[str, str]:
    """Recorded value -> the recorded value whose peak it has (followed to one that is reduced).

    Only values of the top-level graph: a subgraph's values are not recorded.
    """
    wanted = set(recorded)
    source: dict[str, str] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.input:
            continue
        name, data = node.output[0], node.input[0]
        if name not in wanted or data not in wanted:
            continue
        if node.op_type in REARRANGING or is_same_type_cast(node, types):
            source[name] = source.get(data, data)
    return source
