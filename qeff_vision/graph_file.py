"""Exported graphs on disk: weights in ``model.onnx.data``, every node attribute in the graph itself.

Only initializers are stored as external data. A ``Constant`` node's value stays in the graph
(QEfficient's graphs do the same: ``onnx.save_model`` keeps attribute tensors inline unless told
otherwise). Every later stage builds sessions from an in-memory copy of a graph (calibration, the
fp32 and device-precision runs, the single-program composition): onnxruntime finds external
initializers through its ``model_external_initializers_file_folder_path`` option, but a node
attribute stored externally is resolved against the process's working directory and fails ("Data
of TensorProto ... should be stored in model.onnx.data, but it is not regular file").

:func:`load_graph` is how every stage reads a graph: structure and attributes in memory, weights
left on disk. It also reads graphs exported before attributes were kept inline. It checks every
external-data reference against its file first (:func:`check_external_data`): a truncated
``model.onnx.data`` (a copy cut short, a full disk) is one line naming the file, the tensor and
both sizes, not onnxruntime's traceback from deep inside session creation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from qeff_vision.errors import UserError


def _graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every subgraph (``If`` branches, loop bodies), depth first."""
    pending = [model.graph]
    while pending:
        graph = pending.pop()
        yield graph
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    pending.append(attribute.g)
                pending.extend(attribute.graphs)


def _nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the main graph, its subgraphs and the model's local functions."""
    for graph in _graphs(model):
        yield from graph.node
    for function in model.functions:
        yield from function.node


def model_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``model``: its graph, subgraphs and local functions' bodies.

    Decoder layers exported as functions keep their ``CtxScatter``/``CustomRMSNorm`` calls there.
    """
    return _nodes(model)


def attribute_tensors(model: onnx.ModelProto) -> Iterator[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """(node, tensor) for every tensor-valued node attribute (a ``Constant``'s ``value`` included)."""
    for node in _nodes(model):
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield node, attribute.t
            for tensor in attribute.tensors:
                yield node, tensor


def external_attributes(model: onnx.ModelProto) -> list[str]:
    """Names (op type when unnamed) of the nodes holding an attribute tensor stored as external data."""
    return [
        node.name or node.op_type for node, tensor in attribute_tensors(model) if uses_external_data(tensor)
    ]


def inline_attributes(model: onnx.ModelProto, base_dir: str | Path) -> None:
    """Read every externally stored attribute tensor of ``model`` from ``base_dir`` into the graph."""
    for _, tensor in attribute_tensors(model):
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(base_dir))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def described_values(values) -> dict[str, dict]:
    """Name -> ``dtype`` (numpy name) and ``shape`` (ints and symbol names) of graph inputs or outputs.

    What export.json records per program input and output (the export adds each one's axes).
    """
    return {
        value.name: {
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name,
            "shape": [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim],
        }
        for value in values
    }


def load_graph(path: str | Path) -> onnx.ModelProto:
    """The graph at ``path`` with its node attributes in memory and its initializers' data left on disk.

    Raises:
        UserError: An external-data reference its file cannot serve (:func:`check_external_data`).
    """
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    check_external_data(model, path)
    inline_attributes(model, path.parent)
    return model


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for graph in _graphs(model):
        for tensor in graph.initializer:
            if uses_external_data(tensor):
                yield tensor
    for _, tensor in attribute_tensors(model):
        if uses_external_data(tensor):
            yield tensor


def _value_bytes(tensor: onnx.TensorProto) -> int | None:
    """Bytes the tensor's shape and type need in raw little-endian form (``None``: not fixed-width)."""
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2  # two 4-bit values a byte
    return count * itemsize


def check_external_data(model: onnx.ModelProto, graph_path: str | Path) -> None:
    """Refuse a graph whose external data its files cannot serve, before any reader trips on it.

    Each externally stored tensor names a file (``location``, relative to the graph), an
    ``offset`` and a ``length``. The file must exist and hold ``offset + length`` bytes, and
    ``length`` must be what the tensor's shape and type need (onnx's own reader takes the bytes
    it is told to, so a wrong length is the graph and its data out of step). Only file sizes are
    read, never the data.

    Args:
        model: The graph, loaded without its external data.
        graph_path: Where it was read from (locations are relative to its directory).

    Raises:
        UserError: One line naming the data file, the tensor and the sizes.
    """
    base = Path(graph_path).parent
    sizes: dict[str, int] = {}
    for tensor in _external_tensors(model):
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        path = base / location
        if location not in sizes:
            try:
                sizes[location] = path.stat().st_size
            except OSError as exc:
                raise UserError(
                    f"{path}: cannot read the external data of {graph_path} ({exc.strerror or exc})"
                ) from None
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
        except ValueError:
            raise UserError(
                f"{graph_path}: tensor {tensor.name!r} has a malformed external-data entry"
            ) from None
        needed = _value_bytes(tensor)
        if length is not None and needed is not None and length != needed:
            raise UserError(
                f"{path}: tensor {tensor.name!r} is stored as {length:,} bytes but its shape "
                f"{list(tensor.dims)} needs {needed:,} ({graph_path} and its data do not match)"
            )
        size = length if length is not None else needed
        if size is not None and offset + size > sizes[location]:
            raise UserError(
                f"{path}: truncated: tensor {tensor.name!r} needs bytes {offset:,}..{offset + size:,} "
                f"but the file holds {sizes[location]:,} bytes"
            )


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every initializer of ``model`` (external data read from its metadata only)."""
    return sum(tensor_bytes(tensor) for tensor in model.graph.initializer)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of one initializer's value, from its external-data length when stored outside."""
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


FOUR_BIT = {onnx.TensorProto.INT4: True, onnx.TensorProto.UINT4: False}  # type -> signed


def initializer_array(tensor: onnx.TensorProto, model_dir: str | Path) -> np.ndarray:
    """An initializer's value as a new writable array; external data is read straight from its file.

    Reading the file region directly holds the value once (loading it into the ``TensorProto``
    first would hold its bytes and the array side by side). 4-bit integers (stored two per byte)
    come back one per element as int8 / uint8; float8 as ml_dtypes' float8 type.
    """
    shape = tuple(tensor.dims)
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor).copy().reshape(shape)
    info = {entry.key: entry.value for entry in tensor.external_data}
    count = int(np.prod(shape, dtype=np.int64))
    offset = int(info.get("offset", 0))
    path = Path(model_dir) / info["location"]
    if tensor.data_type in FOUR_BIT:
        packed = np.fromfile(path, dtype=np.uint8, count=(count + 1) // 2, offset=offset)
        return unpack_int4(packed, count, FOUR_BIT[tensor.data_type]).reshape(shape)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)


def unpack_int4(packed: np.ndarray, count: int, signed: bool) -> np.ndarray:
    """``count`` 4-bit integers from bytes holding two each (the first in the low nibble, as ONNX)."""
    pairs = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)[:count]
    if not signed:
        return pairs.astype(np.uint8)
    return ((pairs.astype(np.int8) ^ 8) - 8).astype(np.int8)


#: Nodes that only turn stored weights into the values the graph computes with.
STORAGE_OPS = ("Cast", "DequantizeLinear")


def storage_nodes(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Weight name -> the node of the main graph that writes it from initializers alone.

    The float16 form's ``Cast`` and the kept-quantized form's ``DequantizeLinear``
    (:mod:`qeff_vision.export.weight_forms`): the graph reads the node's output as it read a
    float32 initializer of that name.
    """
    names = {tensor.name for tensor in model.graph.initializer}
    return {
        node.output[0]: node
        for node in model.graph.node
        if node.op_type in STORAGE_OPS
        and node.domain in ("", "ai.onnx")
        and node.input
        and all(name in names for name in node.input if name)
    }


def weight_values(model: onnx.ModelProto, name: str, model_dir: str | Path) -> np.ndarray:
    """The float32 values the graph computes with for weight ``name``: an initializer or a stored weight.

    A stored weight is computed as its node does (Cast, or DequantizeLinear-21's
    ``(x - zero_point) * scale`` with the scale repeated along ``axis`` per block), in float32.
    """
    by_name = {tensor.name: tensor for tensor in model.graph.initializer}
    node = storage_nodes(model).get(name)
    if node is None:
        return initializer_array(by_name[name], model_dir).astype(np.float32, copy=False)
    arrays = [initializer_array(by_name[i], model_dir).astype(np.float32) for i in node.input if i]
    if node.op_type == "Cast":
        return arrays[0]
    values, scale = arrays[0], arrays[1]
    zero = arrays[2] if len(arrays) > 2 else None
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if scale.ndim:
        axis = attributes.get("axis", 1) % values.ndim
        block = attributes.get("block_size", 0)
        if block:
            scale = np.repeat(scale, block, axis=axis).take(range(values.shape[axis]), axis=axis)
            zero = (
                None
                if zero is None
                else np.repeat(zero, block, axis=axis).take(range(values.shape[axis]), axis=axis)
            )
        else:
            shape = [1] * values.ndim
            shape[axis] = -1
            scale = scale.reshape(shape)
            zero = None if zero is None else zero.reshape(shape)
    if zero is not None:
        values = values - zero
    return (values * scale).astype(np.float32)


#: Location of a weight declared as external data that a session is given in memory.
GIVEN_IN_MEMORY = "given-in-memory"


def with_weights_given(model: onnx.ModelProto, arrays) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` where each stored weight named in ``arrays`` is an initializer its caller supplies.

    A session given replacement values (rounded weights) overrides initializers by name; a weight
    a storage node computes has none, so the node goes and an initializer of the weight's shape and
    the array's dtype takes its place, declared as external data the session is handed in memory
    (onnxruntime's ``add_external_initializers``; a declaration without data fails its checks).
    Initializers only the removed nodes read go too. ``model`` itself is unchanged.

    Returns:
        (model, the names declared so), ``model`` itself when no stored weight is among ``arrays``.
    """
    storage = storage_nodes(model)
    targets = [name for name in arrays if name in storage]
    if not targets:
        return model, []
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    kept = [node for node in graph.node if not (node.output and node.output[0] in targets)]
    del graph.node[:]
    graph.node.extend(kept)
    read = {name for node in _nodes(result) for name in node.input}
    freed = {name for target in targets for name in storage[target].input} - read
    shapes = {tensor.name: list(tensor.dims) for tensor in graph.initializer}
    initializers = [tensor for tensor in graph.initializer if tensor.name not in freed]
    for name in targets:
        array = np.asarray(arrays[name])
        tensor = onnx.TensorProto(
            name=name,
            data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
            dims=shapes[storage[name].input[0]],
        )
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", GIVEN_IN_MEMORY), ("offset", "0"), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        initializers.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return result, targets
