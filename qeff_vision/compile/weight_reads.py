"""Weight bytes one call of a graph reads at a specialization's shapes, counted from the graph.

A decode step on the accelerator is bound by the bytes it reads. A weight consumed directly (a
``MatMul`` operand, a norm scale) is read whole; a weight read only through ``Gather`` on axis 0
(an embedding table, a mixture-of-experts stack read by slices) is read as many rows as the
gathers return. The gathered row counts are static per specialization: this module binds the
specialization's symbols on the graph inputs and runs ONNX shape inference with data propagation,
the constant folding of shape arithmetic a compiler does when it specializes a graph (the
mixture-of-experts form of :mod:`qeff_vision.export.experts` gathers min(tokens x top_k, experts)
slices, a shape-only count). A gather whose row count does not resolve is counted as a whole read.

Weights are counted as stored: a weight the graph computes from initializers by a storage node (the
float16 form's Cast, the kept-quantized form's DequantizeLinear, :func:`qeff_vision.graph_file.storage_nodes`)
is read as its readers read the node's output, in the bytes of its initializers (2 bytes a
parameter in float16, half a byte in int4, plus scales); an initializer sharing the weight's
axis 0 (data, per-row scales) is read by the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import onnx
from onnx import helper, shape_inference

from qeff_vision.graph_file import FOUR_BIT, storage_nodes, tensor_bytes


@dataclass(frozen=True)
class WeightRead:
    """How much of one initializer a call reads.

    Attributes:
        name: The initializer.
        shape: Its full shape.
        item_bytes: Bytes per element.
        rows_read: Rows along axis 0 read per call when only gathered (may exceed ``shape[0]``
            when rows repeat, e.g. one expert routed for two tokens of a batch); None when read whole.
        stored_bytes: Bytes on disk when not ``item_bytes`` per element (4-bit values, two a byte).
    """

    name: str
    shape: tuple[int, ...]
    item_bytes: int
    rows_read: int | None
    stored_bytes: int | None = None

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole initializer."""
        return self.stored_bytes if self.stored_bytes is not None else prod(self.shape) * self.item_bytes

    @property
    def read_bytes(self) -> int:
        """Bytes read per call: the gathered rows, or the whole initializer."""
        if self.rows_read is None:
            return self.full_bytes
        if self.stored_bytes is not None:
            return self.stored_bytes * self.rows_read // self.shape[0]
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
    storage = storage_nodes(model)
    # Weights as the graph reads them: plain initializers and the outputs of storage nodes.
    stored_in = {name for node in storage.values() for name in node.input}
    names = {init.name for init in model.graph.initializer} - stored_in | set(storage)
    views = weight_views(model, names)
    for node in model.graph.node:
        if node.output and (storage.get(node.output[0]) is node or node.output[0] in views):
            continue
        for position, read in enumerate(node.input):
            name = views.get(read, read)
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
    by_name = {init.name: init for init in model.graph.initializer}
    rows_of: dict[str, int | None] = {}
    for name in names:
        shape = tuple(by_name[storage[name].input[0]].dims) if name in storage else tuple(by_name[name].dims)
        rows_of[name] = _rows(name, shape, gathered, whole, shapes)
    owner_of = {name: weight for weight, node in storage.items() for name in node.input}
    reads = []
    for init in model.graph.initializer:
        shape = tuple(init.dims)
        item = helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        owner = owner_of.get(init.name, init.name)
        rows = rows_of.get(owner)
        if owner != init.name:  # a stored weight's rows read only what shares its axis 0
            data_rows = (
                by_name[storage[owner].input[0]].dims[0] if by_name[storage[owner].input[0]].dims else 0
            )
            rows = rows if shape and shape[0] == data_rows else None
        stored = tensor_bytes(init) if init.data_type in FOUR_BIT else None
        reads.append(WeightRead(init.name, shape, item, rows, stored))
    return reads


def weight_views(model: onnx.ModelProto, weights: set[str]) -> dict[str, str]:
    """Outputs of ``Slice`` nodes that cut a weight along axes other than 0 -> that weight.

    A static slice of a weight is a weight (a compiler folds it); gathered by rows on axis 0 it
    reads those rows' part of the weight (the mixture-of-experts form reads each expert's
    intermediate width in chunks, :mod:`qeff_vision.export.experts`). Only slices whose ``axes``
    are a constant of positive axes are views.
    """
    from onnx import numpy_helper

    constants = {node.output[0]: node for node in model.graph.node if node.op_type == "Constant"}
    views = {}
    for node in model.graph.node:
        if node.op_type != "Slice" or node.input[0] not in weights or len(node.input) < 4:
            continue
        producer = constants.get(node.input[3])
        if producer is None or producer.attribute[0].type != onnx.AttributeProto.TENSOR:
            continue
        axes = numpy_helper.to_array(producer.attribute[0].t).reshape(-1)
        if all(int(axis) > 0 for axis in axes):  # a negative axis may name axis 0: not a view
            views[node.output[0]] = node.input[0]
    return views


def _rows(name, shape, gathered, whole, shapes) -> int | None:
    """Rows of weight ``name`` one call gathers, or None when read whole (or not resolved).

    Elements gathered over every gather of the weight or of its views, in whole rows.
    """
    if name not in gathered or name in whole or not shape:
        return None
    per_row = prod(shape[1:])
    elements = 0
    for output in gathered[name]:
        dims = shapes.get(output)
        if dims is None or None in dims or per_row == 0:
            return None
        elements += prod(dims)
    return elements // per_row
