"""The onnxruntime backend: prove every specialization against the exported graph, without hardware.

For each specialization of a program, each symbolic dimension of each graph input and output is
bound from the specialization (a missing or unused symbol is an error naming it), the graph runs
once on generated inputs, and every output shape is checked against the bound shape. The latency
of that one run is recorded. The result has the same manifest layout as a compile, so ``run``
executes it with onnxruntime sessions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision import symbols
from qeff_vision.compile.graph_io import GraphIO, TensorInfo, read_graph_io, symbol_problems
from qeff_vision.errors import SpecError, UserError


@dataclass(frozen=True)
class SpecializationRun:
    """One verified specialization."""

    index: int
    symbols: dict[str, int]
    latency_ms: float
    output_shapes: dict[str, list[int]]

    def to_dict(self) -> dict[str, Any]:
        """Plain dictionary for the manifest."""
        return {
            "index": self.index,
            "symbols": self.symbols,
            "latency_ms": round(self.latency_ms, 3),
            "output_shapes": self.output_shapes,
        }


def generated_input(tensor: TensorInfo, shape: tuple[int, ...], rng: Any) -> Any:
    """A valid input for ``tensor``: small random floats, zero integers, positions counting up.

    Zero is a valid token id, image index and cache slot in every family; ``position_ids``
    count 0..seq_len-1 along the last axis (every M-RoPE row too), as a real prompt would.
    """
    import numpy as np

    dtype = np.dtype(tensor.dtype)
    if tensor.name == symbols.POSITION_IDS and np.issubdtype(dtype, np.integer) and shape:
        return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(shape) * 0.1).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def _bound_shape(tensor: TensorInfo, values: Mapping[str, int], where: str) -> tuple[int, ...]:
    shape = tensor.bind(values)
    if any(dim is None for dim in shape):
        raise UserError(f"{where}: input {tensor.name} has an unnamed dynamic axis; the export must name it")
    return tuple(int(dim) for dim in shape)  # type: ignore[arg-type]


def check_program_symbols(
    graph: GraphIO, specializations: Sequence[Mapping[str, int]], program: str, source: str
) -> None:
    """Raise a :class:`SpecError` listing every missing or unused symbol of every specialization."""
    problems = symbol_problems(graph, specializations, program, outputs_required=True)
    if problems:
        raise SpecError(source, problems)


def verify_program(
    program: str,
    onnx_path: str | Path,
    specializations: Sequence[Mapping[str, int]],
    *,
    source: str = "",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[SpecializationRun]:
    """Run ``onnx_path`` once per specialization and check every output shape.

    Args:
        program: ``vision`` or ``lang``, for messages.
        onnx_path: The exported graph (external data beside it).
        specializations: Symbol values of each specialization.
        source: What the specializations came from (the spec path), for messages.
        seed: Seed of the generated float inputs.
        progress: Called with one line per finished specialization.

    Raises:
        SpecError: A specialization misses a graph symbol or names one the graph lacks.
        UserError: onnxruntime fails on a specialization, or an output shape differs.
    """
    import numpy as np
    import onnxruntime

    graph = read_graph_io(onnx_path)
    check_program_symbols(graph, specializations, program, source or str(onnx_path))
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
        raise UserError(f"{onnx_path}: onnxruntime cannot load the graph ({exc})") from exc
    rng = np.random.default_rng(seed)
    runs = []
    for index, values in enumerate(specializations):
        where = f"{program} specialization {index} {dict(values)}"
        feeds = {
            tensor.name: generated_input(tensor, _bound_shape(tensor, values, where), rng)
            for tensor in graph.inputs
        }
        names = [tensor.name for tensor in graph.outputs]
        start = time.perf_counter()
        try:
            results = session.run(names, feeds)
        except Exception as exc:
            raise UserError(f"{where}: onnxruntime failed: {str(exc).splitlines()[0]}") from exc
        latency_ms = (time.perf_counter() - start) * 1000.0
        shapes = {}
        problems = []
        for tensor, result in zip(graph.outputs, results):
            expected = tensor.bind(values)
            actual = tuple(result.shape)
            if len(expected) != len(actual) or any(
                e is not None and e != a for e, a in zip(expected, actual)
            ):
                shown = ["?" if e is None else e for e in expected]
                problems.append(f"output {tensor.name} has shape {list(actual)}, expected {shown}")
            shapes[tensor.name] = [int(d) for d in actual]
        if problems:
            raise UserError(f"{where}: " + "; ".join(problems))
        run = SpecializationRun(index, dict(values), latency_ms, shapes)
        runs.append(run)
        if progress:
            progress(f"{program} specialization {index}: ok in {latency_ms:.1f} ms {dict(values)}")
    return runs
