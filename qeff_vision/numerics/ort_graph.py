"""The exported graph as the onnxruntime runtime loads it: KV functions inlined, constants shared.

Every layer's ``CtxScatter`` / ``CtxGather`` (CB) call is a local function (:mod:`qeff_vision.export.kv_ops`).
onnxruntime inlines each call separately, so the index arithmetic the bodies do on the call's
shared inputs (``batch_index``, the position ids, the read's ``indices``) is repeated once per
KV tensor: four times in a two-layer decoder, sixty-four in a 32-layer one. Its common-subexpression
pass would merge the copies, but each inlined body brings its own ``Constant`` nodes, and nodes
fed by different constants of equal value are not recognised as equal.

:func:`prepared_for_onnxruntime` does onnxruntime's inlining itself (``onnx.inliner``) and turns
every top-level ``Constant`` into an initializer shared by all constants of the same value, so the
repeated arithmetic becomes identical nodes that onnxruntime then computes once per call. The
result is the same graph, evaluated with the same kernels: outputs are bit-identical
(tests/test_ort_graph.py). The file on disk (what the compiler receives and the verification
backend loads) is not touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from qeff_vision.graph_file import load_graph


def prepared_for_onnxruntime(onnx_path: Path) -> onnx.ModelProto:
    """``onnx_path``'s graph, local functions inlined and equal constants shared; weights stay external."""
    model = load_graph(onnx_path)
    if not model.functions:
        return model
    from onnx import inliner

    return share_constants(inliner.inline_local_functions(model))


def share_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its top-level tensor ``Constant`` nodes replaced by one initializer per value.

    Constants that are graph outputs stay nodes. Subgraphs (``If`` branches) read the shared
    names through the enclosing scope, as they read any outer value.
    """
    graph = model.graph
    taken = {value.name for value in (*graph.input, *graph.initializer)}
    taken.update(name for node in graph.node for name in node.output)
    outputs = {value.name for value in graph.output}
    shared: dict[tuple, str] = {}  # (dtype, shape, bytes) -> initializer name
    renamed: dict[str, str] = {}
    kept = []
    for node in graph.node:
        array = _constant_value(node)
        if array is None or node.output[0] in outputs:
            kept.append(node)
            continue
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in shared:
            shared[key] = _fresh_name(f"shared_constant_{len(shared)}", taken)
            graph.initializer.append(numpy_helper.from_array(array, shared[key]))
        renamed[node.output[0]] = shared[key]
    del graph.node[:]
    graph.node.extend(kept)
    _rename_inputs(graph, renamed)
    return model


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The tensor a ``Constant`` node with a ``value`` attribute produces, else None."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    attribute = node.attribute[0]
    if attribute.name != "value" or attribute.type != onnx.AttributeProto.TENSOR:
        return None
    return numpy_helper.to_array(attribute.t)


def _fresh_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _rename_inputs(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Point node inputs at their new names, in subgraphs too (unless a subgraph defines the name)."""
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name in renamed:
                node.input[position] = renamed[name]
        for attribute in node.attribute:
            single = attribute.type == onnx.AttributeProto.GRAPH
            for subgraph in (attribute.g,) if single else attribute.graphs:
                local = {value.name for value in (*subgraph.input, *subgraph.initializer)}
                local.update(name for inner in subgraph.node for name in inner.output)
                _rename_inputs(subgraph, {k: v for k, v in renamed.items() if k not in local})
