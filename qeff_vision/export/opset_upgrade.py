"""Raise an exported graph's default-domain opset from 17 to 21, for ``DequantizeLinear``'s int4/fp8 forms.

The TorchScript exporter writes opset 20 at most (``torch.onnx._constants``); the graph is traced at
17 and a graph that keeps quantized weights (:mod:`qeff_vision.export.weight_forms`) needs 21. A
model imports one version per domain, so the whole graph moves, local functions included. Between
17 and 21 the only operators our graphs use whose schema changed incompatibly are the reductions
other than ``ReduceSum`` (opset 18 moved ``axes`` from an attribute to an input) and ``GridSample``
(opset 20 renamed its modes ``bilinear``/``bicubic`` to ``linear``/``cubic``); every other change
in that range adds types or optional attributes (ref: onnx/docs/Changelog.md, opsets 18-21). The
ONNX checker validates every node against the new schemas afterwards (the exporter runs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")
# Reductions whose ``axes`` became an input at opset 18 (ReduceSum did at 13).
AXES_AS_INPUT = frozenset(
    {
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSumSquare",
    }
)
GRID_SAMPLE_MODES = {"bilinear": "linear", "bicubic": "cubic"}


def _node_lists(model: onnx.ModelProto) -> Iterator[tuple[list, object]]:
    """(nodes, container) for the main graph, every subgraph and every local function."""
    pending = [model.graph, *model.functions]
    while pending:
        container = pending.pop()
        yield container.node, container
        for node in container.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    pending.append(attribute.g)
                pending.extend(attribute.graphs)


def _upgraded(node: onnx.NodeProto, index: int) -> list[onnx.NodeProto]:
    """``node`` in its opset-21 form (with a Constant for moved ``axes``)."""
    if node.domain not in DEFAULT_DOMAINS:
        return [node]
    if node.op_type in AXES_AS_INPUT:
        axes = next((a for a in node.attribute if a.name == "axes"), None)
        if axes is None:
            return [node]
        name = f"{node.output[0]}_axes_{index}"
        value = numpy_helper.from_array(np.array(list(axes.ints), dtype=np.int64), name)
        constant = helper.make_node("Constant", [], [name], value=value, name=f"{name}_constant")
        node.attribute.remove(axes)
        node.input.append(name)
        return [constant, node]
    if node.op_type == "GridSample":
        for attribute in node.attribute:
            if attribute.name == "mode" and attribute.s.decode() in GRID_SAMPLE_MODES:
                attribute.s = GRID_SAMPLE_MODES[attribute.s.decode()].encode()
    return [node]


def upgrade_opset(model: onnx.ModelProto, version: int) -> None:
    """Move ``model`` (a graph exported at opset 17..20) to default-domain opset ``version`` in place."""
    current = {o.domain: o.version for o in model.opset_import}.get("", 0)
    if current >= version:
        return
    if current < 17:
        raise ValueError(f"the opset upgrade starts at 17, the graph has {current}")
    for nodes, _ in _node_lists(model):
        rewritten = []
        for index, node in enumerate(nodes):
            rewritten.extend(_upgraded(node, index))
        del nodes[:]
        nodes.extend(rewritten)
    # Opset 21 (and its 4-bit types) belongs to IR version 10 (onnx/onnx/helper.py VERSION_TABLE).
    model.ir_version = max(model.ir_version, 10)
    for imports in [model.opset_import, *(f.opset_import for f in model.functions)]:
        for entry in imports:
            if entry.domain in DEFAULT_DOMAINS:
                entry.version = version
