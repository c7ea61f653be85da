"""Which of a graph's shapes could follow its input *values*: a check that each specialization is static.

The SDK compiler fixes every shape per specialization from the symbols it binds, so a graph whose
output (or any intermediate) length is computed from an input's values cannot be compiled for a
device (onnxruntime runs it anyway). Values flow from the graph inputs through every node; a
``Shape`` or ``Size`` node reads only its input's shape, so what it outputs is fixed once the
symbols are. A value reaching an operand that sets a shape (a ``Reshape`` target, a ``Range``
bound, a ``Slice`` bound, ...) or a node whose output shape is its input's data (``NonZero``) makes
that shape depend on input values.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Operands (by position) that set an output shape, per op type.
SHAPE_OPERANDS = {
    "Reshape": (1,),
    "Expand": (1,),
    "Range": (0, 1, 2),
    "ConstantOfShape": (0,),
    "Slice": (1, 2, 3, 4),
    "Tile": (1,),
    "Pad": (1,),
    "Resize": (2, 3),
    "Upsample": (1,),
    "TopK": (1,),
    "Split": (1,),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
    "OneHot": (1,),
    "If": (0,),
    "Loop": (0, 1),
}
#: Ops whose output shape is a function of their input data.
DATA_SHAPED = {"NonZero", "Compress", "Unique", "NonMaxSuppression", "StringSplit"}
#: Ops whose output is a function of their input's shape only.
SHAPE_READERS = {"Shape", "Size"}


def value_dependent_shapes(model, inputs: Iterable[str]) -> list[str]:
    """Nodes whose output shape follows the values of ``inputs`` (empty: static per specialization).

    Args:
        model: An ``onnx.ModelProto``. The branches of ``If`` and the body of ``Loop`` are walked
            too (they read the outer graph's values); their condition or trip count counts as a
            shape operand.
        inputs: Graph input names whose values vary at run time.

    Returns:
        ``"op name: operand"`` for each offending node, in graph order.
    """
    tainted = set(inputs)
    found: list[str] = []
    _walk(model.graph, tainted, found)
    return found


def _walk(graph, tainted: set[str], found: list[str]) -> None:
    for node in graph.node:
        if node.op_type in SHAPE_READERS:
            continue
        operands = [name in tainted for name in node.input]
        if node.op_type in DATA_SHAPED and any(operands):
            found.append(f"{node.op_type} {node.name}: data-shaped output")
        for position in SHAPE_OPERANDS.get(node.op_type, ()):
            if position < len(operands) and operands[position]:
                found.append(f"{node.op_type} {node.name}: operand {position} ({node.input[position]})")
        branch_outputs = []
        for attribute in node.attribute:
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                _walk(subgraph, tainted, found)
                branch_outputs += [value.name for value in subgraph.output]
        if any(operands) or any(name in tainted for name in branch_outputs):
            tainted.update(output for output in node.output if output)
