"""OCP Microscaling (MX) rounding: what ``-mxfp6-matmul`` weights and an ``mxint8`` KV cache hold.

Facts from the OCP Microscaling Formats (MX) v1.0 specification (public): a block of 32 elements
shares one E8M0 scale X = 2^e; e = floor(log2(max |v|)) - emax, where emax is the exponent of the
element format's largest normal; each element is v / X rounded to nearest-even in the element
format and saturated at its largest magnitude. Element formats used here:

* FP6 E2M3 (bias 1, max 7.5, emax 2) and FP6 E3M2 (bias 3, max 28, emax 4): MXFP6 defines both.
* INT8 with an implied scale of 2^-6 (values -2 .. 127/64, emax 0): MXINT8.

What is not public, and therefore assumed (docs/design.md says so): which FP6 element the AI 100
compiler uses for ``-mxfp6-matmul`` (its docs say matmul weights are stored in MXFP6 and
decompressed to fp16 for compute; E2M3 is the default here, E3M2 selectable), and the block axis:
a MatMul weight [in, out] is blocked along ``in`` (the reduction axis, as MX dot products are), the
KV cache along ``head_dim`` (blocks of min(32, head_dim)).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_vision.graph_file import storage_nodes, weight_values

BLOCK = 32
SCALE_EXPONENT_RANGE = (-127, 127)  # E8M0 encodes 2^-127 .. 2^127 (0xFF is NaN)


@dataclass(frozen=True)
class ElementFormat:
    """An MX element format: mantissa bits, exponent bias, largest magnitude, emax."""

    name: str
    mantissa_bits: int
    bias: int
    largest: float
    emax: int
    integer: bool = False


FP6_E2M3 = ElementFormat("fp6_e2m3", 3, 1, 7.5, 2)
FP6_E3M2 = ElementFormat("fp6_e3m2", 2, 3, 28.0, 4)
INT8 = ElementFormat("int8", 6, 0, 127 / 64, 0, integer=True)
FORMATS = {f.name: f for f in (FP6_E2M3, FP6_E3M2, INT8)}


def _round_elements(values: np.ndarray, element: ElementFormat) -> np.ndarray:
    """Round scaled values to the element grid (nearest-even), saturating at its largest magnitude."""
    if element.integer:
        step = 2.0**-element.mantissa_bits
        return np.clip(np.round(values / step), -128, 127) * step
    magnitude = np.abs(values)
    min_exponent = 1 - element.bias  # subnormals share the smallest normal's step
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**min_exponent)))
    step = 2.0 ** (exponent - element.mantissa_bits)
    rounded = np.round(values / step) * step  # numpy rounds half to even
    return np.clip(rounded, -element.largest, element.largest)


# Elements rounded at a time: the rounding's float64 temporaries stay a few tens of MB whatever the
# weight (Mistral 3's 5,120 x 32,768 MLP weights, 671 MB each, made the MX check pass 7 GB).
_CHUNK_ELEMENTS = 1 << 22


def mx_round(array: np.ndarray, element: ElementFormat, axis: int = -1, block: int = BLOCK) -> np.ndarray:
    """``array`` as an MX tensor holds it: blocks of ``block`` along ``axis``, one power-of-two scale each."""
    moved = np.moveaxis(np.asarray(array, dtype=np.float32), axis, -1)
    if moved.ndim < 2:
        return np.moveaxis(_mx_round_last(moved, element, block), -1, axis)
    rounded = np.empty(moved.shape, dtype=np.float32)
    rows = max(1, _CHUNK_ELEMENTS // int(np.prod(moved.shape[1:])))
    for start in range(0, moved.shape[0], rows):
        rounded[start : start + rows] = _mx_round_last(moved[start : start + rows], element, block)
    return np.moveaxis(rounded, -1, axis)


def _mx_round_last(moved: np.ndarray, element: ElementFormat, block: int) -> np.ndarray:
    """:func:`mx_round` along the last axis of ``moved``."""
    length = moved.shape[-1]
    block = min(block, length)
    padded_length = -(-length // block) * block
    padded = np.zeros((*moved.shape[:-1], padded_length), dtype=np.float64)
    padded[..., :length] = moved
    blocks = padded.reshape(*moved.shape[:-1], padded_length // block, block)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    exponent = np.floor(np.log2(np.where(largest > 0, largest, 1.0))) - element.emax
    scale = 2.0 ** np.clip(exponent, *SCALE_EXPONENT_RANGE)
    rounded = (_round_elements(blocks / scale, element) * scale).reshape(padded.shape)[..., :length]
    return rounded.astype(np.float32)


def matmul_weights(model: onnx.ModelProto) -> dict[str, int]:
    """Weight name -> reduction axis, for every 2-D float weight a MatMul or Gemm reads.

    A weight is a float32 initializer or a stored weight (float16 + Cast, DequantizeLinear:
    :func:`qeff_vision.graph_file.storage_nodes`) the graph computes in float32.
    """
    initializers = {t.name: t for t in model.graph.initializer}
    stored = storage_nodes(model)
    found = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        weight = node.input[1]
        if weight in stored:
            data = initializers[stored[weight].input[0]]
            if len(data.dims) == 2:
                found[weight] = 1 if _transposed_b(node) else 0
            continue
        tensor = initializers.get(weight)
        if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
            continue
        found[tensor.name] = 1 if _transposed_b(node) else 0
    return found


def _transposed_b(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)


def rounded_weights(
    model: onnx.ModelProto, model_dir, element: ElementFormat, names: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Every matmul weight of ``model`` (of ``names``, if given) rounded to MX ``element``.

    Each is read from its external data when rounded: a caller running the graph slice by slice
    asks for one slice's weights at a time (by initializer names: a stored weight is asked for by
    its own name or by its stored initializers').
    """
    weights = {}
    stored = storage_nodes(model)
    wanted = None if names is None else set(names)
    for name, axis in matmul_weights(model).items():
        asked = {name, *(stored[name].input if name in stored else ())}
        if wanted is not None and not asked & wanted:
            continue
        weights[name] = mx_round(weight_values(model, name, model_dir), element, axis=axis)
    return weights


def mxint8_nodes(source: str, target: str, prefix: str, opset: int = 17) -> list[onnx.NodeProto]:
    """ONNX nodes computing ``target`` = ``source`` [..., D] stored as MXINT8 along its last axis.

    Blocks of min(32, D) elements (D a multiple of the block, as head dims are); standard ops only
    (Round is half-to-even, as the specification's conversion). ``opset``: the graph's default-domain
    opset (from 18 on, ``ReduceMax`` takes its axes as an input).
    """

    def constant(name: str, value, dtype=np.float32) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [f"{prefix}{name}"], value=numpy_helper.from_array(np.array(value, dtype=dtype))
        )

    p = prefix
    return [
        constant("start", [0], np.int64),
        constant("end", [-1], np.int64),
        constant("block", [BLOCK], np.int64),
        constant("tiny", 2.0**-126),
        constant("ln2", float(np.log(2.0))),
        constant("two", 2.0),
        constant("sixty_four", 64.0),
        constant("low", -128.0),
        constant("high", 127.0),
        helper.make_node("Shape", [source], [f"{p}shape"]),
        helper.make_node("Shape", [source], [f"{p}last"], start=-1),
        helper.make_node("Min", [f"{p}last", f"{p}block"], [f"{p}width"]),
        helper.make_node("Slice", [f"{p}shape", f"{p}start", f"{p}end"], [f"{p}leading"]),
        helper.make_node("Concat", [f"{p}leading", f"{p}end", f"{p}width"], [f"{p}block_shape"], axis=0),
        helper.make_node("Reshape", [source, f"{p}block_shape"], [f"{p}x"]),
        helper.make_node("Abs", [f"{p}x"], [f"{p}abs"]),
        *(
            [
                constant("axes", [-1], np.int64),
                helper.make_node("ReduceMax", [f"{p}abs", f"{p}axes"], [f"{p}largest"], keepdims=1),
            ]
            if opset >= 18
            else [helper.make_node("ReduceMax", [f"{p}abs"], [f"{p}largest"], axes=[-1], keepdims=1)]
        ),
        helper.make_node("Max", [f"{p}largest", f"{p}tiny"], [f"{p}positive"]),
        helper.make_node("Log", [f"{p}positive"], [f"{p}ln"]),
        helper.make_node("Div", [f"{p}ln", f"{p}ln2"], [f"{p}log2"]),
        helper.make_node("Floor", [f"{p}log2"], [f"{p}exponent"]),  # emax of INT8 elements is 0
        helper.make_node("Pow", [f"{p}two", f"{p}exponent"], [f"{p}scale"]),
        helper.make_node("Div", [f"{p}x", f"{p}scale"], [f"{p}scaled"]),
        helper.make_node("Mul", [f"{p}scaled", f"{p}sixty_four"], [f"{p}steps"]),
        helper.make_node("Round", [f"{p}steps"], [f"{p}rounded"]),
        helper.make_node("Clip", [f"{p}rounded", f"{p}low", f"{p}high"], [f"{p}clipped"]),
        helper.make_node("Div", [f"{p}clipped", f"{p}sixty_four"], [f"{p}elements"]),
        helper.make_node("Mul", [f"{p}elements", f"{p}scale"], [f"{p}values"]),
        helper.make_node("Reshape", [f"{p}values", f"{p}shape"], [target]),
    ]
