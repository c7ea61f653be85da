"""Which values of a graph may hold attention-mask sentinels, read from the graph before any run.

The recorder (:mod:`qeff_vision.numerics.recording`) takes a value's peak below
:data:`~qeff_vision.numerics.slicing.MASK_SENTINEL` when the value holds sentinels (a mask filled
with float32's minimum, scores with the mask added). Found at run time, such a value costs a second
run of its slice; at full depth every slice that adds a mask to its scores would run twice on the
first call that shows one (a 1080p image through a vision tower: each slice's run twice).

A mask's sentinel comes from a constant of the graph (``torch.finfo(dtype).min`` traced as a
``Constant``, a ``ConstantOfShape`` fill, a small initializer) and reaches the scores through
``Where``, ``Expand``, ``Add`` and the like. Following every value computed from such a constant
finds the values that may hold one. The set is a superset of what a run finds on the graph's own
masks: the cost of a value predicted but never masked is one cheaper reduction form in the graph
(:func:`~qeff_vision.numerics.slicing._masked_peak` instead of three reductions), and its peak is
the same either way. A sentinel the constants do not explain (a float mask given as an input, an
overflow to infinity) is still found at run time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Ops whose float output is bounded whatever their input holds: a sentinel does not pass them.
# ``Exp`` too, as a blocked attention uses it (exp(score - running max)): a masked score's
# exponential is 0. A positive sentinel's would be infinite; a run finds that one.
BOUNDED_OPS = frozenset({"Softmax", "Sigmoid", "Tanh", "Cos", "Sin", "Erf", "HardSigmoid", "Softsign", "Exp"})
# Inline initializers larger than this are weights, not mask fills: not read.
_SMALL_ELEMENTS = 1 << 16


def _holds_sentinel(array: np.ndarray, sentinel: float) -> bool:
    if array.dtype.kind != "f" or not array.size:
        return False
    magnitudes = np.abs(array.astype(np.float64))
    return bool(np.any(~np.isfinite(magnitudes)) or magnitudes.max() >= sentinel)


def _seeds(model: onnx.ModelProto, sentinel: float) -> set[str]:
    """Constants and small inline initializers holding a sentinel (or an infinity)."""
    seeds = set()
    for tensor in model.graph.initializer:
        external = tensor.data_location == onnx.TensorProto.EXTERNAL
        if not external and int(np.prod(tensor.dims, dtype=np.int64)) <= _SMALL_ELEMENTS:
            if _holds_sentinel(numpy_helper.to_array(tensor), sentinel):
                seeds.add(tensor.name)
    for node in model.graph.node:
        if node.op_type not in ("Constant", "ConstantOfShape") or node.domain not in ("", "ai.onnx"):
            continue
        for attribute in node.attribute:
            value = helper.get_attribute_value(attribute)
            if isinstance(value, onnx.TensorProto):
                value = numpy_helper.to_array(value)
            elif isinstance(value, float):
                value = np.asarray([value], np.float32)
            elif isinstance(value, Sequence) and value and isinstance(value[0], float):
                value = np.asarray(value, np.float32)
            else:
                continue
            if _holds_sentinel(np.asarray(value), sentinel):
                seeds.add(node.output[0])
    return seeds


def mask_carriers(model: onnx.ModelProto, reads: Sequence[Iterable[str]], sentinel: float) -> set[str]:
    """Values of ``model`` computed from a sentinel-holding constant (the constants included).

    Args:
        model: The graph (initializers' data may stay on disk: only small inline ones are read).
        reads: Per node, in graph order, the values it reads (its subgraphs' captures included).
        sentinel: Magnitudes from here on are mask sentinels.
    """
    carriers = _seeds(model, sentinel)
    for node, read in zip(model.graph.node, reads):
        if node.op_type in BOUNDED_OPS and node.domain in ("", "ai.onnx"):
            continue
        if any(name in carriers for name in read):
            carriers.update(name for name in node.output if name)
    return carriers
