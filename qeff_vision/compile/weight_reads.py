"""Weight bytes one call of a graph reads at a specialization's shapes, counted from the graph.

A decode step on the accelerator is bound by the bytes it reads. A weight consumed directly (a
``MatMul`` operand, a norm scale) is read whole; a weight read only through ``Gather`` on axis 0
(an embedding table, a mixture-of-experts stack read by slices) is read as many rows as the
gathers return. The gathered row counts are static per specialization: this module binds the
specialization's symbols on the graph inputs and runs ONNX shape inference with data propagation,
the constant folding of shape arithmetic a compiler does when it specializes a graph (the
mixture-of-experts form of :mod:`qeff_vision.export.experts` gathers min(tokens x top_k, experts)
slices, a shape-only count). A gather whose row count does not resolve is counted as a whole read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import onnx
from onnx import helper, shape_inference


@dataclass(frozen=True)
class WeightRead:
    """How much of one initializer a call reads.

    Attributes:
        name: The initializer.
        shape: Its full shape.
        item_bytes: Bytes per element.
        rows_read: Rows along axis 0 read per call when only gathered (may exceed ``shape[0]``
            when rows repeat, e.g. one expert routed for two tokens of a batch); None when read whole.
    """

    name: str
    shape: tuple[int, ...]
    item_bytes: int
    rows_read: int | None

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole initializer."""
        return prod(self.shape) * self.item_bytes

    @property
    def read_bytes(self) -> int:
        """Bytes read per call: the gathered rows, or the whole initializer."""
        if self.rows_read is None:
            return self.full_bytes
        return self.rows_read * prod(self.shape[1:]) * self.item_bytes


def _bind(model: onnx.ModelProto, values: Mapping[str, int | str]) -> None:
    """Replace every symbolic input dim named in ``values`` by its value (in place)."""
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in values:
                dim.dim_value = int(values[dim.dim_param])


# Constants larger than this stay unfolded (shape arithmetic is a handful of int64s).
FOLD_LIMIT = 4096


def _static_shape(node: onnx.NodeProto, shapes: Mapping[str, tuple[int | None, ...]]):
    """The value of a ``Shape`` node whose input's shape is fully known, else None."""
    import numpy as np

    dims = shapes.get(node.input[0])
    if dims is None or None in dims:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attributes.get("start", 0), attributes.get("end", len(dims))
    return np.array(dims[start:end], dtype=np.int64)


def _fold_constants(model: onnx.ModelProto, shapes: Mapping[str, tuple[int | None, ...]]) -> int:
    """Replace nodes computable from constants and known shapes by ``Constant`` nodes (in place).

    A ``Shape`` of a tensor whose dims are all known is a constant once the specialization binds
    the inputs; so is every node computed from constants only (the exporter writes ``TopK``'s k as a
    ``Reshape`` of a ``Constant``, which shape inference does not evaluate). Returns the count folded.
    """
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    opset = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    known: dict[str, object] = {}
    nodes, folded = [], 0
    for node in model.graph.node:
        outputs = None
        if node.op_type == "Constant":
            tensor = node.attribute[0].t if node.attribute[0].type == onnx.AttributeProto.TENSOR else None
            # A large constant stored out of line (a rope table) is no shape arithmetic: not loaded.
            if tensor is not None and tensor.data_location != onnx.TensorProto.EXTERNAL:
                known[node.output[0]] = numpy_helper.to_array(tensor)
            nodes.append(node)
            continue
        if node.op_type == "Shape":
            value = _static_shape(node, shapes)
            outputs = None if value is None else [value]
        elif (
            node.domain in ("", "ai.onnx")
            and node.input
            and all(name in known for name in node.input if name)
            and not any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute)
        ):
            feeds = {name: known[name] for name in node.input if name}
            values = [
                helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), None)
                for name, value in feeds.items()
            ]
            undefined = onnx.TensorProto.UNDEFINED
            results = [helper.make_tensor_value_info(name, undefined, None) for name in node.output]
            graph = helper.make_graph([node], "fold", values, results)
            try:
                outputs = ReferenceEvaluator(helper.make_model(graph, opset_imports=opset)).run(None, feeds)
            except Exception:  # an op the reference evaluator lacks: the node stays as it is
                outputs = None
        if outputs is not None and all(getattr(o, "size", FOLD_LIMIT + 1) <= FOLD_LIMIT for o in outputs):
            for name, value in zip(node.output, outputs):
                known[name] = value
                tensor = numpy_helper.from_array(value, name)
                nodes.append(helper.make_node("Constant", [], [name], value=tensor))
            folded += 1
            continue
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return folded


def _inferred(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    shapes = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    return shapes


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Every tensor's shape after folding shape arithmetic to constants, as a compiler specializes."""
    shapes = _inferred(model)
    for _ in range(8):  # each round resolves what the previous one made constant
        if not _fold_constants(model, shapes):
            break
        shapes = _inferred(model)
    return shapes


def weight_reads(model_path: str | Path, values: Mapping[str, int | str]) -> list[WeightRead]:
    """Every initializer of the graph at ``model_path`` and what one call at ``values`` reads of it.

    Args:
        model_path: An ONNX graph (its external data is not loaded).
        values: Symbol values of one specialization (e.g. ``batch_size``, ``seq_len``, ``ctx_len``).
    """
    model = onnx.load(str(model_path), load_external_data=False)
    _bind(model, values)
    shapes = _shapes(model)
    gathered: dict[str, list[str | None]] = {}
    whole: set[str] = set()
    names = {init.name for init in model.graph.initializer}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            if name not in names:
                continue
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
            if node.op_type == "Gather" and position == 0 and axis == 0:
                gathered.setdefault(name, []).append(node.output[0])
            else:
                whole.add(name)
    # A weight consumed inside a subgraph (an ``If`` branch) is counted whole.
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                whole |= {n for sub in attribute.g.node for n in sub.input if n in names}
    reads = []
    for init in model.graph.initializer:
        shape = tuple(init.dims)
        item = helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        rows = None
        if init.name in gathered and init.name not in whole and shape:
            per_row = prod(shape[1:])
            counts = []
            for output in gathered[init.name]:
                dims = shapes.get(output)
                if dims is None or None in dims or per_row == 0:
                    counts = None
                    break
                counts.append(prod(dims) // per_row)
            rows = sum(counts) if counts is not None else None
        reads.append(WeightRead(init.name, shape, item, rows))
    return reads
