"""Activation memory of one call of a graph at a specialization's shapes, counted from the graph.

Next to its weights a program needs room for the values it computes. Two figures per
specialization, both at the device's dtype (every floating value 2 bytes: fp16 on AI 100, bf16 on
AI 200; integers and booleans at their own width):

* **largest intermediate**: the biggest single value a node produces (an attention's scores
  [heads, N, K] at a large image or a long context);
* **peak live bytes**: walking the nodes in the graph's (topological) order, the most bytes of
  produced values alive at once; a value lives from its node to its last reader (a graph output to
  the end). Weights, graph inputs and ``*_RetainedState`` outputs are not counted: the first are
  weights, the others are IO buffers (a retained state shares its input's buffer on the device).
  Nor are values computed from weights and constants alone (a tied language head's transposed
  embedding, a static slice or cast of a weight): the compiler folds them into constants.

Shapes come as :mod:`qeff_vision.compile.weight_reads` gets them: the specialization's symbols
bound on the graph inputs, then ONNX shape inference with the shape arithmetic folded to
constants, as a compiler specializes a graph. A value whose shape does not resolve is counted in
``unresolved`` (not in the figures). The order is the exporter's, not the compiler's schedule:
the peak is what a sequential schedule of that order needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path
from typing import Any

import onnx
from onnx import helper, shape_inference

from qeff_vision.compile.weight_reads import _bind, _fold_constants
from qeff_vision.contract.attention_blocking import DEFAULT_BOUND, DEVICE_ITEM_BYTES, MIB
from qeff_vision.symbols import RETAINED_SUFFIX

_FLOATS = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
}


@dataclass(frozen=True)
class ActivationMemory:
    """Activation figures of one specialization of one graph.

    Attributes:
        largest_bytes: Bytes of the largest value a node produces.
        largest_name: That value's name.
        largest_op: The op type of the node producing it.
        largest_shape: Its shape.
        peak_bytes: Most bytes of produced values alive at once in the graph's node order.
        weight_bytes: Bytes of the initializers at the device dtype.
        unresolved: Values whose shape did not resolve (counted in neither figure).
    """

    largest_bytes: int
    largest_name: str
    largest_op: str
    largest_shape: tuple[int, ...]
    peak_bytes: int
    weight_bytes: int
    unresolved: int = 0

    def to_dict(self) -> dict:
        """JSON-ready form (the manifest's ``activation_memory`` entries)."""
        data = asdict(self)
        data["largest_shape"] = list(self.largest_shape)
        return data


def item_bytes(elem_type: int, device_item_bytes: int = DEVICE_ITEM_BYTES) -> int:
    """Bytes per element on the device: floats at the device dtype, the rest at their own width."""
    if elem_type in _FLOATS:
        return device_item_bytes
    if elem_type == onnx.TensorProto.UNDEFINED:
        return device_item_bytes
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def _typed_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int | None, ...]]]:
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    found = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
        found[value.name] = (tensor.elem_type, dims if tensor.HasField("shape") else (None,))
    return found


# Output shapes of our custom-domain ops from their input shapes. Shape inference does not look
# into model-local functions (and CtxGather's body branches on the data), while the compiler maps
# each to a native kernel; the rules follow the torch sides' docstrings: export/kv_ops.py
# (CtxScatter[CB] -> the cache; CtxGather cache [B, H, C, D], indices [B, K] -> [B, H, K, D];
# CtxGatherCB adds batch_index [B, 1] before the indices), export/rms_norm.py, export/gated_delta.py
# (output like value, final state like state).
_CUSTOM_SHAPES = {
    "CtxScatter": lambda s: [s[0]],
    "CtxScatterCB": lambda s: [s[0]],
    "CtxGather": lambda s: [(s[0][0], s[0][1], s[1][-1], s[0][3])],
    "CtxGatherCB": lambda s: [(s[1][0], s[0][1], s[2][-1], s[0][3])],
    "CustomRMSNorm": lambda s: [s[0]],
    "GatedDeltaRule": lambda s: [s[2], s[5]],
}


def _custom_shapes(model: onnx.ModelProto, typed: Mapping[str, tuple]) -> int:
    """Declare the output shapes of custom ops whose input shapes are known (in place); the count."""
    declared = 0
    for node in model.graph.node:
        rule = _CUSTOM_SHAPES.get(node.op_type) if node.domain not in ("", "ai.onnx") else None
        known = {name for name in node.output if name in typed and None not in typed[name][1]}
        if rule is None or known >= set(node.output):
            continue  # (a graph output such as a retained state may already carry its shape)
        inputs = [typed.get(name, (0, (None,))) for name in node.input]
        if any(None in dims for _, dims in inputs):
            continue
        try:
            shapes = rule([dims for _, dims in inputs])
        except IndexError:  # another arity than ours: left unresolved
            continue
        outputs = [(inputs[0][0], shape) for shape in shapes]
        if node.op_type == "GatedDeltaRule":
            outputs = [(inputs[2][0], shapes[0]), (inputs[5][0], shapes[1])]
        for name, (elem, shape) in zip(node.output, outputs):
            if name in known:
                continue
            model.graph.value_info.append(helper.make_tensor_value_info(name, elem, list(shape)))
            declared += 1
    return declared


def _specialized(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int | None, ...]]]:
    """Every value's (element type, shape) after folding shape arithmetic (see weight_reads)."""
    typed = _typed_shapes(model)
    for _ in range(16):  # each round resolves what the previous one made constant or declared
        shapes = {name: dims for name, (_, dims) in typed.items()}
        if not _fold_constants(model, shapes) + _custom_shapes(model, typed):
            break
        typed = _typed_shapes(model)
    return typed


def graph_activation_memory(
    model_path: str | Path,
    values: Mapping[str, int | str],
    *,
    device_item_bytes: int = DEVICE_ITEM_BYTES,
) -> ActivationMemory:
    """The activation figures of the graph at ``model_path`` for one specialization.

    Args:
        model_path: An ONNX graph (external data is not loaded).
        values: The specialization's symbol values.
        device_item_bytes: Bytes of a floating element on the device.
    """
    model = onnx.load(str(model_path), load_external_data=False)
    return activation_memory(model, values, device_item_bytes=device_item_bytes)


def activation_memory(
    model: onnx.ModelProto, values: Mapping[str, int | str], *, device_item_bytes: int = DEVICE_ITEM_BYTES
) -> ActivationMemory:
    """:func:`graph_activation_memory` of a loaded graph (modified in place: symbols bound, folded)."""
    weights = sum(
        prod(init.dims) * item_bytes(init.data_type, device_item_bytes) for init in model.graph.initializer
    )
    _bind(model, values)
    typed = _specialized(model)
    outputs = {value.name for value in model.graph.output if not value.name.endswith(RETAINED_SUFFIX)}
    last_use: dict[str, int] = {}
    for index, node in enumerate(model.graph.node):
        for name in node.input:
            last_use[name] = index
    size: dict[str, int] = {}
    largest = (0, "", "", ())
    unresolved = 0
    live = peak = 0
    folded = _weight_derived(model)
    for index, node in enumerate(model.graph.node):
        if node.op_type == "Constant" or (node.output and all(name in folded for name in node.output)):
            continue  # folded shape arithmetic, stored constants, values of weights alone: not activations
        for name in node.output:
            if not name or name.endswith(RETAINED_SUFFIX):
                continue
            elem, dims = typed.get(name, (onnx.TensorProto.UNDEFINED, (None,)))
            if None in dims:
                unresolved += 1
                continue
            count = prod(dims) * item_bytes(elem, device_item_bytes)
            size[name] = count
            live += count
            if count > largest[0]:
                largest = (count, name, node.op_type, tuple(dims))
        peak = max(peak, live)
        # Values read for the last time here (and outputs nobody reads, unless graph outputs) die.
        for name in {*node.input, *node.output}:
            if name in size and name not in outputs and last_use.get(name, index) <= index:
                live -= size.pop(name)
    return ActivationMemory(
        largest_bytes=largest[0],
        largest_name=largest[1],
        largest_op=largest[2],
        largest_shape=largest[3],
        peak_bytes=peak,
        weight_bytes=weights,
        unresolved=unresolved,
    )


def _weight_derived(model: onnx.ModelProto) -> set[str]:
    """Outputs computed from weights and constants alone, which a compiler folds into constants.

    A tied language head reads the embedding through ``Transpose`` ([hidden, vocab]: 594 MiB for
    Qwen2.5-VL-3B's 151,936 x 2,048 at 2 bytes); that is a weight the compiler folds at compile
    time, not a value the device computes per call. A node with a subgraph is never folded here.
    """
    folded = {tensor.name for tensor in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            folded.update(node.output)
            continue
        inputs = [name for name in node.input if name]
        subgraph = any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
        )
        if inputs and not subgraph and all(name in folded for name in inputs):
            folded.update(name for name in node.output if name)
    return folded


def format_bytes(count: int) -> str:
    """``count`` in KiB below 1 MiB, GiB from 10 GiB, MiB between."""
    if count >= 10 * 1024 * MIB:
        return f"{count / (1024 * MIB):.1f} GiB"
    if count < MIB:
        return f"{count / 1024:.1f} KiB"
    return f"{count / MIB:.1f} MiB"


def describe(figures: ActivationMemory) -> str:
    """One line: weights, largest intermediate (op and shape) and peak live activations."""
    shape = "x".join(map(str, figures.largest_shape))
    line = (
        f"weights {format_bytes(figures.weight_bytes)}, largest intermediate "
        f"{format_bytes(figures.largest_bytes)} ({figures.largest_op} [{shape}]), "
        f"peak activations {format_bytes(figures.peak_bytes)}"
    )
    return line + (f", {figures.unresolved} shapes unresolved" if figures.unresolved else "")


def measure_plans(
    plans: Mapping[str, Any], on_done: Callable[[], None] | None = None
) -> dict[str, list[dict]]:
    """Figures of every specialization of every program (compile inputs ``ProgramPlan``s).

    ``on_done`` is called after each specialization (progress).

    Returns:
        Program -> one entry per specialization: its ``name``, ``symbols`` and the
        :class:`ActivationMemory` fields (the manifest's ``activation_memory``).
    """
    measured: dict[str, list[dict]] = {}
    for program, plan in plans.items():
        graph = plan.onnx if Path(plan.onnx).is_file() else plan.source_onnx
        entries = []
        for entry, values in zip(plan.specializations, plan.symbol_values()):
            figures = graph_activation_memory(graph, values)
            entries.append({"name": entry.get("name", ""), "symbols": values, **figures.to_dict()})
            if on_done is not None:
                on_done()
        measured[program] = entries
    return measured


def _label(program: str, index: int, entry: Mapping[str, Any]) -> str:
    name = entry.get("name") or ""
    return f"{program} {index}" + (f" ({name})" if name else "")


def report_lines(measured: Mapping[str, list[dict]]) -> list[str]:
    """One line per program and specialization, as ``compile`` prints them."""
    lines = []
    for program, entries in measured.items():
        for index, entry in enumerate(entries):
            figures = ActivationMemory(**{k: v for k, v in entry.items() if k not in ("name", "symbols")})
            lines.append(f"{_label(program, index, entry)}: {describe(figures)}")
    return lines


def bound_problem(measured: Mapping[str, list[dict]], bound: int | None) -> str | None:
    """The one-line refusal when any specialization's largest intermediate exceeds ``bound``, else None.

    The largest intermediate is what the bound refuses (one tensor the device must hold whole);
    the peak live figure depends on the compiler's schedule and is reported only.
    """
    if bound is None:
        return None
    over = [
        f"{_label(program, index, entry)} {format_bytes(entry['largest_bytes'])} "
        f"({entry['largest_op']} [{'x'.join(map(str, entry['largest_shape']))}])"
        for program, entries in measured.items()
        for index, entry in enumerate(entries)
        if entry["largest_bytes"] > bound
    ]
    if not over:
        return None
    return (
        f"largest intermediate above compile.max_activation_bytes ({format_bytes(bound)}) in "
        f"{len(over)} specialization(s): {'; '.join(over)}. Raise the bound (null: none) or lower the "
        "image size / context; the export's attention blocks are sized for the bound"
    )


__all__ = [
    "DEFAULT_BOUND",
    "ActivationMemory",
    "activation_memory",
    "bound_problem",
    "describe",
    "graph_activation_memory",
    "measure_plans",
    "report_lines",
]
