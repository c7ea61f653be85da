"""Emulate what the device computes under ``-convert-to-fp16``: fp16 rounding of an fp32 graph.

The AI 100 compiler runs an fp32 graph in fp16 when given ``-convert-to-fp16``, except for the node
outputs its ``-node-precision-info`` file lists under ``FP32NodeInstanceNames`` (the precision
plan, :mod:`qeff_vision.numerics.plan`). :func:`device_graph` rewrites a graph to do the same on
onnxruntime, under these assumptions (stated in docs/design.md):

* Every node outside the plan computes from fp16 values and rounds each float output to fp16 (a
  value beyond 65,504 becomes infinite); the arithmetic inside one node is exact to fp32 (the
  kernels accumulate in higher precision). Nodes in the plan keep fp32 outputs.
* Graph IO keeps its types: float inputs are rounded to fp16 where they are read, float outputs
  are whatever their producer computed (the compiler's IO conversion).
* Weights are stored in fp16 (rounded where an fp16 node reads them, so external data is not
  copied); a node in the plan reads its weights in fp32. Constants are rounded to fp16 and clamped
  to its finite range (masks built from float32's minimum stay finite, as the compiler's
  saturating conversion keeps them).
* ``CustomRMSNorm`` computes in fp32 inside whatever its IO precision (one node, one rounding), as
  the compiler's dedicated kernel is assumed to.

On ai200 the device computes in bfloat16 (``aic_hw_version: ai200``, no ``-convert-to-fp16``): the
same rewriting with bfloat16 in place of float16 (:class:`Bf16Values` as the plan, which keeps no
node in fp32: bf16 has fp32's range, so there is no overflow to plan around). Casts round to
nearest even (onnxruntime's and torch's float-to-bfloat16 conversion); constants are clamped to
bf16's largest finite value first (float32's minimum would round to -inf).

The graph keeps its float32 types and the rounding is an explicit Cast to float16 and back after
each value: onnxruntime's CPU float16 execution is not a model of the device (where a float16
kernel is missing it computes whole chains of nodes in float32, hiding intermediate overflow).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from qeff_vision import symbols
from qeff_vision.contract.slot_names import is_kv_name, is_state_name
from qeff_vision.graph_file import (
    initializer_array,
    storage_nodes,
    weight_bytes,
    weight_values,
    with_weights_given,
)
from qeff_vision.numerics.arena import use_shared_arena
from qeff_vision.numerics.layer_functions import expanded_plan, load_flat_graph

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
FP16_MAX = float(np.finfo(np.float16).max)  # 65504
BF16_MAX = 3.3895313892515355e38  # (2 - 2**-7) * 2**127


class Bf16Values(tuple):
    """The device plan of a program the device computes in bfloat16 (ai200): no node kept in fp32.

    It goes where an fp16 plan's node list goes (``fp32_values``); its type selects bf16 rounding.
    """


def grid_of(fp32_values: Collection[str] | None) -> int:
    """The element type device values are rounded to: BFLOAT16 for :class:`Bf16Values`, else FLOAT16."""
    return TensorProto.BFLOAT16 if isinstance(fp32_values, Bf16Values) else TensorProto.FLOAT16


def round_to(array: np.ndarray, grid: int) -> np.ndarray:
    """float32 ``array`` rounded to ``grid`` (fp16 or bf16, nearest even), as float32."""
    if grid == TensorProto.BFLOAT16:
        import torch

        values = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        return values.to(torch.bfloat16).float().numpy()
    with np.errstate(over="ignore"):
        return array.astype(np.float16).astype(np.float32)


def _clamped(array: np.ndarray, grid: int) -> np.ndarray:
    """A constant rounded to ``grid`` within its finite range (the compiler's saturating conversion)."""
    limit = BF16_MAX if grid == TensorProto.BFLOAT16 else FP16_MAX
    return round_to(np.clip(array, -limit, limit), grid)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named value of the main graph (onnx shape inference, functions included)."""
    inferred = shape_inference.infer_shapes(model)
    types = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        types[value.name] = value.type.tensor_type.elem_type
    for tensor in model.graph.initializer:
        types[tensor.name] = tensor.data_type
    return types


def float_outputs(model: onnx.ModelProto, types: dict[str, int] | None = None) -> list[str]:
    """Names of the float node outputs of the main graph, in topological order."""
    types = value_types(model) if types is None else types
    return [o for node in model.graph.node for o in node.output if o and types.get(o) in FLOAT_TYPES]


def _rounded_constant(node: onnx.NodeProto, grid: int = TensorProto.FLOAT16) -> onnx.NodeProto | None:
    """A float32 Constant / ConstantOfShape with its value rounded to ``grid`` (clamped), else None."""
    if node.op_type not in ("Constant", "ConstantOfShape"):
        return None
    for attribute in node.attribute:
        if attribute.name in ("value_float", "value_floats"):
            values = [attribute.f] if attribute.name == "value_float" else list(attribute.floats)
            rounded = _clamped(np.array(values, dtype=np.float32), grid)
            rewritten = _copy(node)
            for target in rewritten.attribute:
                if target.name == "value_float":
                    target.f = float(rounded[0])
                elif target.name == "value_floats":
                    target.floats[:] = rounded.tolist()
            return rewritten
        if attribute.name == "value" and attribute.t.data_type == TensorProto.FLOAT:
            rounded = _clamped(numpy_helper.to_array(attribute.t), grid)
            rewritten = _copy(node)
            for target in rewritten.attribute:
                if target.name == "value":
                    target.t.CopyFrom(numpy_helper.from_array(rounded, attribute.t.name))
            return rewritten
    return None


#: Ops whose float outputs are values of their float inputs (moved, selected or repeated): on fp16
#: inputs their outputs are fp16 values already.
VALUE_MOVES = frozenset(
    {
        "Concat",
        "Expand",
        "Flatten",
        "Gather",
        "GatherElements",
        "GatherND",
        "Identity",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "Tile",
        "Transpose",
        "Unsqueeze",
    }
)


def _round_trip(source: str, target: str, grid: int = TensorProto.FLOAT16) -> list[onnx.NodeProto]:
    """``target`` = ``source`` rounded to ``grid`` (fp16 or bf16: Cast there and back)."""
    half = f"{target}__fp16" if grid == TensorProto.FLOAT16 else f"{target}__bf16"
    return [
        helper.make_node("Cast", [source], [half], to=grid, name=f"{half}__cast"),
        helper.make_node("Cast", [half], [target], to=TensorProto.FLOAT, name=f"{target}__cast"),
    ]


def device_graph(
    model: onnx.ModelProto, fp32_values: Collection[str] = (), rounded_weights: Collection[str] = ()
) -> onnx.ModelProto:
    """The fp16 emulation of ``model`` (an fp32 graph), keeping ``fp32_values`` in fp32.

    Args:
        model: The exported graph; external data may stay unloaded (initializers are not copied).
        fp32_values: Node output names kept in fp32 (the precision plan); a :class:`Bf16Values`
            emulates bfloat16 instead of fp16.
        rounded_weights: Initializers whose values the session is given already rounded to fp16
            (:func:`fp16_only_weights`): read as they are, without a rounding Cast pair.

    Returns:
        A new model with the same IO names and types.
    """
    types = value_types(model)
    keep = set(fp32_values)
    grid = grid_of(fp32_values)
    graph = model.graph
    # Graph inputs and weights read by an fp16 node go through a rounded copy (made once).
    sources = {v.name for v in graph.input if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    sources |= {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    # A stored weight (float16 + Cast, DequantizeLinear) is read as a float32 weight is: its node
    # computes it exactly and an fp16 reader rounds it (the same graph as with float32 initializers).
    storage = storage_nodes(model)
    sources |= {name for name in storage if types.get(name) == TensorProto.FLOAT}
    sources -= set(rounded_weights)
    rounded: dict[str, str] = {}
    on_grid: set[str] = set()  # values already fp16 values: an fp16 node's outputs
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.output and storage.get(node.output[0]) is node:
            nodes.append(_copy(node))
            continue
        fp32 = any(output in keep for output in node.output)
        rewritten = (None if fp32 else _rounded_constant(node, grid)) or _copy(node)
        if not fp32:
            for index, name in enumerate(rewritten.input):
                if name in sources:
                    if name not in rounded:
                        rounded[name] = f"{name}__rounded"
                        nodes.extend(_round_trip(name, rounded[name], grid))
                    rewritten.input[index] = rounded[name]
        # Constants are already rounded (and clamped) in place; fp32 nodes keep their outputs; a node
        # that only moves values already on the fp16 grid leaves them there (a round trip of read
        # expert slices would copy them twice more: Kimi-K2.5's real-width decode, 1.4 GB).
        moved = node.op_type in VALUE_MOVES and all(
            name in sources or name in on_grid
            for name in node.input
            if name and types.get(name) == TensorProto.FLOAT
        )
        exact = fp32 or node.op_type in ("Constant", "ConstantOfShape") or moved
        outputs = [] if exact else [o for o in node.output if o and types.get(o) == TensorProto.FLOAT]
        if not fp32:
            on_grid.update(o for o in node.output if o)
        for index, name in enumerate(rewritten.output):
            if name in outputs:
                rewritten.output[index] = f"{name}__exact"
        nodes.append(rewritten)
        for name in outputs:
            nodes.extend(_round_trip(f"{name}__exact", name, grid))
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    del result.graph.value_info[:]
    return result


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copied = onnx.NodeProto()
    copied.CopyFrom(node)
    return copied


#: Weight bytes up to which :func:`session_for` gives a session onnxruntime's CPU arena by default
#: (the verification's slice size: a graph this small runs whole).
ARENA_WEIGHT_BYTES = 512 * 2**20


def session_for(
    model: onnx.ModelProto,
    model_dir: Path,
    threads: int = 0,
    initializers: Mapping[str, np.ndarray] | None = None,
    in_graph_order: bool = False,
    arena: bool | None = None,
    shared_arena: bool = False,
):
    """An onnxruntime CPU session on an in-memory graph whose external data lives in ``model_dir``.

    ``initializers`` replace the named initializers' values (rounded weights), unpacked: onnxruntime's
    prepacked copy of a MatMul weight would sit beside the caller's buffer. ``in_graph_order``
    runs nodes in their graph order wherever it can (onnxruntime's priority-based order): its
    default order may put a value's extra readers (calibration reductions) after every other node
    and keep each value alive until then. Without ``arena`` freed buffers go back to the allocator
    (and large ones to the OS) instead of staying in the session's arena at its peak size. By
    default a graph keeps the arena while its weights fit :data:`ARENA_WEIGHT_BYTES`: a larger one
    makes weight-sized values (read expert slices, casts of weights), which the arena keeps at its
    grown size (Kimi-K2.5 at real widths, fp32 run: 8.34 GB with the arena, 6.06 GB without).
    ``shared_arena`` takes the process's shared arena instead (:mod:`~qeff_vision.numerics.arena`;
    run such a session with its shrinking run options).
    """
    import onnxruntime as ort

    if arena is None:
        arena = weight_bytes(model) <= ARENA_WEIGHT_BYTES
    options = ort.SessionOptions()
    if in_graph_order:
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.enable_cpu_mem_arena = arena
    if shared_arena:
        use_shared_arena(options)
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_dir))
    # A weight kept quantized is dequantized as its DequantizeLinear says, then used in float32: no
    # QDQ fusion into onnxruntime's quantized kernels (int8 MatMul with activations quantized on the
    # fly, MatMulNBits), whose results differ from the float32 graph the device is emulated from.
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    # onnxruntime takes only buffers the caller owns (and keeps alive): contiguous numpy arrays.
    arrays = {name: np.ascontiguousarray(array) for name, array in (initializers or {}).items()}
    model, declared = with_weights_given(model, arrays)  # a stored weight's node gives way to the values
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    for name, value in values.items():
        if name not in declared:
            options.add_initializer(name, value)
    if declared:
        options.add_external_initializers(declared, [values[name] for name in declared])
    if values:
        # A packed copy of a weight cannot replace a buffer the caller owns: both would stay.
        options.add_session_config_entry("session.disable_prepacking", "1")
    # Constant folding would fold Cast(weight) from the model's own values, before the replacement.
    disabled = ["ConstantFolding"] if values else None
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    session.replaced_initializers = (arrays, values)  # keep the buffers alive with the session
    return session


@dataclass(frozen=True)
class MxEmulation:
    """Microscaling formats the device applies on top of fp16 (see :mod:`qeff_vision.numerics.mx`).

    Attributes:
        matmul_weights: MX element format of MatMul/Gemm weights (``-mxfp6-matmul``:
            ``fp6_e2m3`` or ``fp6_e3m2``), or ``None`` for fp16 weights.
        kv_mxint8: The KV cache is stored as MXINT8 (``kv_cache_dtype: mxint8``): every
            ``past_*_RetainedState`` output is rounded to it.
        state_fp16: Recurrent layers' states are stored in fp16 (``state_dtype: float16``): every
            ``conv_state.*`` / ``recurrent_state.*`` retained output is rounded to fp16.
    """

    matmul_weights: str | None = None
    kv_mxint8: bool = False
    state_fp16: bool = False

    @classmethod
    def from_options(
        cls, mxfp6_matmul: bool, kv_cache_dtype: str, state_dtype: str = "float32"
    ) -> MxEmulation:
        """The formats a compile's options ask of the device.

        The FP6 element of ``-mxfp6-matmul`` is not public; E2M3 is assumed (see numerics/mx.py).
        """
        return cls("fp6_e2m3" if mxfp6_matmul else None, kv_cache_dtype == "mxint8", state_dtype == "float16")

    def label(self, grid: int = TensorProto.FLOAT16) -> str:
        """Short description for reports: ``fp16``, ``fp16+mxfp6 (fp6_e2m3)``, ``+mxint8 KV``.

        ``grid``: the element type the rest computes in (``bf16`` on ai200).
        """
        parts = ["bf16" if grid == TensorProto.BFLOAT16 else "fp16"]
        if self.matmul_weights:
            parts.append(f"mxfp6 {self.matmul_weights}")
        if self.kv_mxint8:
            parts.append("mxint8 KV")
        if self.state_fp16:
            parts.append("fp16 state")
        return " + ".join(parts)


def _expanded(model: onnx.ModelProto, fp32_values: Collection[str]) -> Collection[str]:
    """The plan on the flat graph, still a :class:`Bf16Values` when it was one (the grid it selects)."""
    expanded = expanded_plan(model, fp32_values)
    return Bf16Values(sorted(expanded)) if isinstance(fp32_values, Bf16Values) else expanded


def device_session(
    onnx_path: Path, fp32_values: Collection[str] = (), mx: MxEmulation | None = None, threads: int = 0
):
    """An onnxruntime session running ``onnx_path`` as the device will (fp16, plan, MX formats).

    Without MX weights, the weights only fp16 nodes read are handed to onnxruntime already rounded,
    each read and rounded in turn: through Cast pairs onnxruntime folds them at load, holding the
    fp32 originals beside their rounded copies (1.5x the weights at peak; the session for Mistral
    3's 4.5 GB language graph then ran at 7.5 GB).
    """
    if mx is not None and mx.matmul_weights:
        graph, weights = device_model(onnx_path, fp32_values, mx)
        return session_for(graph, onnx_path.parent, threads, weights(None))
    model = load_flat_graph(onnx_path)  # layer functions inlined (numerics/layer_functions.py)
    fp32_values = _expanded(model, fp32_values)
    names = fp16_only_weights(model, fp32_values)
    graph = _with_mx_state(device_graph(model, fp32_values, names), mx)
    weights = fp16_rounded_weights(model, onnx_path.parent, names, grid_of(fp32_values))
    return session_for(graph, onnx_path.parent, threads, weights)


def fp16_only_weights(model: onnx.ModelProto, fp32_values: Collection[str] = ()) -> list[str]:
    """The float32 initializers that only nodes computing in fp16 read (none in the plan, no subgraph).

    A weight a plan node reads too keeps its fp32 value (and gets a rounded copy for the others).
    """
    keep = set(fp32_values)
    graph = model.graph
    excluded = {value.name for value in graph.input}
    # A stored weight's scales are read by its exact storage node, not by an fp16 node.
    excluded.update(name for node in storage_nodes(model).values() for name in node.input)
    for node in graph.node:
        if any(output in keep for output in node.output):
            excluded.update(node.input)
        for attribute in node.attribute:  # an If branch reads outer values by name
            for subgraph in (
                (attribute.g,) if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs
            ):
                excluded.update(name for inner in subgraph.node for name in inner.input)
    read = {name for node in graph.node for name in node.input}
    plain = [
        tensor.name
        for tensor in graph.initializer
        if tensor.data_type == TensorProto.FLOAT and tensor.name in read and tensor.name not in excluded
    ]
    # A stored weight (float16 + Cast, DequantizeLinear) is handed over the same way, so the session
    # is the one a float32 initializer gives: its readers read an initializer, with the same kernels.
    stored = [
        name
        for name, node in storage_nodes(model).items()
        if name in read and name not in excluded and _float32_output(node)
    ]
    return plain + stored


def _float32_output(node: onnx.NodeProto) -> bool:
    """Whether a storage node writes float32 (a Cast to float, a DequantizeLinear with float scales)."""
    if node.op_type == "Cast":
        return any(a.name == "to" and a.i == TensorProto.FLOAT for a in node.attribute)
    return True  # the writer's scales are in the graph's float dtype, float32 here


def fp16_rounded_weights(
    model: onnx.ModelProto, model_dir: Path, names: Collection[str], grid: int = TensorProto.FLOAT16
) -> dict[str, np.ndarray]:
    """The initializers ``names`` rounded to fp16 (or ``grid``: bf16) as float32 arrays, each read from disk.

    Out-of-range values become infinite, as the Cast to float16 they replace makes them.
    """
    wanted = set(names)
    weights = {}
    for tensor in model.graph.initializer:
        if tensor.name in wanted:
            weights[tensor.name] = _rounded(
                initializer_array(tensor, model_dir).astype(np.float32, copy=False), grid
            )
    for name in wanted & set(storage_nodes(model)):  # stored weights, as their nodes compute them
        weights[name] = _rounded(weight_values(model, name, model_dir), grid)
    return weights


def _rounded(array: np.ndarray, grid: int = TensorProto.FLOAT16) -> np.ndarray:
    if grid == TensorProto.BFLOAT16:
        array[...] = round_to(array, grid)
        return array
    with np.errstate(over="ignore"):
        array[...] = array.astype(np.float16)
    return array


def _with_mx_state(graph: onnx.ModelProto, mx: MxEmulation | None) -> onnx.ModelProto:
    """``graph`` with the KV cache (MXINT8) and recurrent state (fp16) stored as ``mx`` says."""
    mx = mx or MxEmulation()
    if mx.kv_mxint8:
        graph = _kv_as_mxint8(graph)
    if mx.state_fp16:
        graph = _state_as_fp16(graph)
    return graph


def device_model(onnx_path: Path, fp32_values: Collection[str] = (), mx: MxEmulation | None = None):
    """The device emulation of ``onnx_path`` as a graph, and how its weights are replaced.

    Returns:
        (graph, weights): ``weights`` is ``None``, or (``-mxfp6-matmul``) a function from initializer
        names (``None``: all) to their MX-rounded values, read when called.
    """
    from qeff_vision.numerics import mx as formats

    model = load_flat_graph(onnx_path)  # layer functions inlined (numerics/layer_functions.py)
    fp32_values = _expanded(model, fp32_values)
    mx = mx or MxEmulation()
    graph = _with_mx_state(device_graph(model, fp32_values), mx)
    if not mx.matmul_weights:
        return graph, None
    element = formats.FORMATS[mx.matmul_weights]
    return graph, lambda names: formats.rounded_weights(model, onnx_path.parent, element, names)


def _detach_retained_outputs(model: onnx.ModelProto, names: list[str], suffix: str) -> dict[str, str]:
    """Rename the producers of retained outputs ``names`` so a rounding step can be put before each.

    Every node that writes (or reads) output ``X`` now writes (or reads) ``X<suffix>``; the caller
    adds the nodes that turn ``X<suffix>`` back into ``X``. Returns ``{X: X<suffix>}``.
    """
    renamed = {name: f"{name}{suffix}" for name in names}
    for node in model.graph.node:
        for index, name in enumerate(node.output):
            if name in renamed:
                node.output[index] = renamed[name]
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
    return renamed


def _retained_outputs(model: onnx.ModelProto, kind) -> list[str]:
    """``_RetainedState`` outputs whose names ``kind`` accepts (KV caches or recurrent states)."""
    return [o.name for o in model.graph.output if kind(o.name) and o.name.endswith(symbols.RETAINED_SUFFIX)]


def _state_as_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Round every recurrent-state retained output to fp16 (what an fp16 custom IO stores)."""
    states = _retained_outputs(model, is_state_name)
    renamed = _detach_retained_outputs(model, states, "__before_fp16")
    for name in states:
        half = f"{name}__stored_fp16"
        model.graph.node.extend(
            [
                helper.make_node(
                    "Cast", [renamed[name]], [half], to=TensorProto.FLOAT16, name=f"{half}__cast"
                ),
                helper.make_node("Cast", [half], [name], to=TensorProto.FLOAT, name=f"{half}__back"),
            ]
        )
    return model


def _kv_as_mxint8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Round every ``past_key``/``past_value`` retained-state output to MXINT8 along head_dim."""
    from qeff_vision.numerics.mx import mxint8_nodes

    # The KV cache outputs (custom IO decides their device dtype), named by the language IO table.
    kv = _retained_outputs(model, is_kv_name)
    renamed = _detach_retained_outputs(model, kv, "__before_mxint8")
    for position, name in enumerate(kv):
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        model.graph.node.extend(mxint8_nodes(renamed[name], name, f"{name}__mxint8_{position}_", opset))
    return model
