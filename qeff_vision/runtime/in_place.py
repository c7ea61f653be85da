"""Retained state updated in place on onnxruntime (IO binding), as a device keeps its cache resident.

A language call returns every KV cache whole as ``X_RetainedState`` and the host feeds it back as
``X``. Through ``session.run`` onnxruntime copies each cache into a fresh output every call (the
scatter's first step), which grows with ``full_batch_size`` x ``ctx_len`` and was, with the read,
most of the per-row cost of a batched decode call (benchmarks/batched_decode.py). Binding the
output ``X_RetainedState`` to the very buffer fed as ``X`` lets the scatter write the new rows into
it, skipping the copy, and the next call reads the updated array without a host copy either.

That is only sound when the graph finishes reading ``X`` before it writes it: :func:`aliasable`
checks that the output is produced by a ``ScatterND`` whose data input is ``X`` (directly or as the
result of a local function, e.g. ``CtxScatterCB``, whose body ends in one), that every other node
reading ``X`` is an ancestor of that scatter (so it runs first) or reads only its shape, and that
no subgraph can read it. Pairs that fail the check keep the copying run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

# Ops that read only their input's shape, never its values.
_SHAPE_ONLY = {"Shape", "Size"}


def aliasable(model_path: Path, retained: Mapping[str, str]) -> set[str]:
    """Inputs of ``retained`` (input -> output name) whose output may share the input's buffer."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    subgraphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(attr.type in subgraphs for node in graph.node for attr in node.attribute):
        return set()
    model_functions = {(f.domain, f.name): f for f in model.functions}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in set(node.input):
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    safe = set()
    for source, target in retained.items():
        writer = producer.get(target)
        if source in outputs or writer is None or not _scatters_into(writer, source, model_functions):
            continue
        before = _ancestors(writer, producer)
        readers = [n for n in consumers.get(source, []) if n is not writer]
        if all(n.op_type in _SHAPE_ONLY or id(n) in before for n in readers):
            safe.add(source)
    return safe


def _scatters_into(node, source: str, functions: Mapping) -> bool:
    """Whether ``node``'s output is a ScatterND whose data is ``source`` (through one local function)."""
    if node.op_type == "ScatterND" and not node.domain:
        return node.input[0] == source
    function = functions.get((node.domain, node.op_type))
    if function is None or len(node.output) != 1:
        return False
    inner = {out: n for n in function.node for out in n.output}.get(function.output[0])
    if inner is None or inner.op_type != "ScatterND" or inner.domain:
        return False
    formal = dict(zip(function.input, node.input))
    return formal.get(inner.input[0]) == source


def _ancestors(node, producer: Mapping) -> set[int]:
    """The ``id`` of every node ``node`` depends on."""
    seen: set[int] = set()
    stack = [producer[name] for name in node.input if name in producer]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        stack.extend(producer[name] for name in current.input if name in producer)
    return seen


class BoundRunner:
    """onnxruntime calls through one IO binding, rebinding only inputs whose array changed.

    Binding an array costs tens of microseconds of Python, as much as a small model's whole call;
    a batched decode step feeds the same arrays every step (the slot cache and the engine's input
    buffers, refilled in place), so they stay bound. Outputs not written in place are rebound every
    call: onnxruntime would otherwise reuse their buffers, which the previous call's results view.

    Args:
        session: The onnxruntime session.
        output_names: Outputs in the order results are returned.
    """

    def __init__(self, session, output_names: list[str]):
        self.session = session
        self.output_names = output_names
        self.binding = session.io_binding()
        self.bound: dict[str, tuple] = {}  # name -> (array, shape) bound now (the array kept alive)

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray],
        retained: Mapping[str, str],
        in_place: set[str],
    ) -> dict[str, np.ndarray]:
        """One call; outputs by name.

        ``state`` arrays whose names are in ``in_place`` receive their retained output (same
        buffer) and are returned as that output; every other output is a fresh array.
        """
        for name, array in feeds.items():
            self._bind_input(name, np.ascontiguousarray(array))
        for name, array in state.items():
            if not (array.flags.c_contiguous and array.flags.writeable):
                raise ValueError(f"{name}: state updated in place must be a writeable C-contiguous array")
            self._bind_input(name, array)
        aliased = {retained[name]: state[name] for name in in_place}
        for name in self.output_names:
            if name not in aliased:
                self.binding.bind_output(name, "cpu")
                self.bound.pop(name, None)
            elif not self._same(name, aliased[name]):
                _bind(self.binding.bind_output, name, aliased[name])
                self.bound[name] = (aliased[name], aliased[name].shape)
        self.session.run_with_iobinding(self.binding)
        values = self.binding.get_outputs()
        return {
            name: aliased[name] if name in aliased else value.numpy()
            for name, value in zip(self.output_names, values)
        }

    def _same(self, name: str, array: np.ndarray) -> bool:
        held = self.bound.get(name)
        return held is not None and held[0] is array and held[1] == array.shape

    def _bind_input(self, name: str, array: np.ndarray) -> None:
        if not self._same(name, array):
            _bind(self.binding.bind_input, name, array)
            self.bound[name] = (array, array.shape)


def _bind(bind, name: str, array: np.ndarray) -> None:
    bind(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)
