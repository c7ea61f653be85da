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
from qeff_vision.contract.sampler_io import PENALTY_BUFFERS
from qeff_vision.contract.slot_names import kind_of_name
from qeff_vision.contract.states import LayerState
from qeff_vision.errors import SpecError, UserError
from qeff_vision.numerics.device import MxEmulation, device_model, grid_of
from qeff_vision.numerics.plan import overflow_message
from qeff_vision.numerics.recording import SliceRunError


@dataclass(frozen=True)
class SpecializationRun:
    """One verified specialization."""

    index: int
    symbols: dict[str, int]
    latency_ms: float
    output_shapes: dict[str, list[int]]
    device: DeviceDeviation | None = None
    device_mx: DeviceDeviation | None = None
    mx_label: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dictionary for the manifest."""
        entry = {
            "index": self.index,
            "symbols": self.symbols,
            "latency_ms": round(self.latency_ms, 3),
            "output_shapes": self.output_shapes,
        }
        if self.device is not None:
            entry["device_precision"] = self.device.to_dict()
        if self.device_mx is not None:
            entry["device_precision_mx"] = {"formats": self.mx_label, **self.device_mx.to_dict()}
        return entry


@dataclass(frozen=True)
class DeviceDeviation:
    """Device precision (fp16 with the plan's fp32 nodes) vs the fp32 graph on the same inputs.

    Attributes:
        max_abs: Largest absolute difference over every float output.
        max_relative: Largest difference divided by that output's fp32 range (max - min).
        worst_output: The output where ``max_relative`` occurs.
        finite: No inf/NaN in any device-precision output.
    """

    max_abs: float
    max_relative: float
    worst_output: str
    finite: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dictionary for the manifest."""
        return {
            "max_abs": float(f"{self.max_abs:.4g}"),
            "max_relative": float(f"{self.max_relative:.4g}"),
            "worst_output": self.worst_output,
            "finite": self.finite,
        }


def deviation(names: Sequence[str], reference: Sequence[Any], device: Sequence[Any]) -> DeviceDeviation:
    """Compare device-precision outputs with fp32 ones (float outputs only)."""
    import numpy as np

    worst = (0.0, 0.0, "")
    finite = True
    for name, ref, dev in zip(names, reference, device):
        if not np.issubdtype(ref.dtype, np.floating) or ref.size == 0:
            continue
        ref64, dev64 = ref.astype(np.float64), dev.astype(np.float64)
        finite = finite and bool(np.isfinite(dev64).all())
        diff = float(np.nan_to_num(np.abs(dev64 - ref64), nan=np.inf).max())
        spread = float(ref64.max() - ref64.min()) or 1.0
        if diff / spread >= worst[1]:
            worst = (diff, diff / spread, name)
    return DeviceDeviation(worst[0], worst[1], worst[2], finite)


def generated_input(
    tensor: TensorInfo,
    shape: tuple[int, ...],
    rng: Any,
    slots: int = 0,
    image_size: tuple[int, int] | None = None,
) -> Any:
    """A valid input for ``tensor``: small random floats, zero integers, positions counting up.

    Zero is a valid token id, image index and cache slot in every family; ``position_ids``
    count 0..seq_len-1 along the last axis (every M-RoPE row too), as a real prompt would.
    ``batch_index`` (continuous batching) gives each row its own KV slot, the last ones, so a
    batch-1 prefill writes slot full_batch_size - 1 and a decode every slot once.
    ``image_sizes`` rows are ``image_size``, the image the specialization was built from: a graph
    that reads those values (LLaVA-NeXT's grids) has the specialization's output shapes only then.
    """
    import numpy as np

    dtype = np.dtype(tensor.dtype)
    if tensor.name == symbols.IMAGE_SIZES and image_size is not None and shape:
        return np.broadcast_to(np.asarray(image_size, dtype=dtype), shape).copy()
    if tensor.name == symbols.POSITION_IDS and np.issubdtype(dtype, np.integer) and shape:
        return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
    if tensor.name == symbols.BATCH_INDEX and slots and shape:
        return np.arange(slots - shape[0], slots, dtype=dtype).reshape(shape)
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(shape) * 0.1).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def untouched_slot_problems(feeds: Mapping[str, Any], outputs: Mapping[str, Any]) -> list[str]:
    """Continuous batching: per-slot state (layer states, penalty buffers) no row names stays unchanged.

    Each retained state whose input has ``full_batch_size`` rows is compared with its input on
    the slots ``batch_index`` leaves out (a write or read routed to the wrong slot shows here), by
    the rule of its kind (:meth:`LayerState.idle_slots_unchanged
    <qeff_vision.contract.states.LayerState.idle_slots_unchanged>`); the on-device sampler's
    penalty buffers by the base rule (all of an idle slot unchanged).
    """
    import numpy as np

    batch_index = feeds.get(symbols.BATCH_INDEX)
    if batch_index is None:
        return []
    problems = []
    for name, value in feeds.items():
        retained = outputs.get(symbols.retained(name))
        kind = kind_of_name(name) or (LayerState if name in PENALTY_BUFFERS else None)
        if retained is None or kind is None:
            continue
        if not kind.idle_slots_unchanged(value, retained, batch_index):
            others = np.setdiff1d(np.arange(value.shape[0]), batch_index.reshape(-1))
            problems.append(
                f"{symbols.retained(name)} changed KV slots {others.tolist()} that batch_index does not name"
            )
    return problems


def bound_shape(tensor: TensorInfo, values: Mapping[str, int], where: str) -> tuple[int, ...]:
    """``tensor``'s shape with every symbol bound from ``values`` (a UserError for an unnamed axis)."""
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
    device_values: Sequence[str] | None = None,
    mx: MxEmulation | None = None,
    image_sizes: Sequence[tuple[int, int] | None] | None = None,
) -> list[SpecializationRun]:
    """Run ``onnx_path`` once per specialization and check every output shape.

    With ``device_values`` (the precision plan), each specialization also runs at device
    precision (:mod:`qeff_vision.numerics.device`) on the same inputs, and the deviation from fp32
    is recorded; an inf/NaN there is an error naming the first node that left fp16's range.

    The sessions run one after another, each over every specialization and released before the
    next is built (fp32, device precision, then MX): only one copy of the weights is in memory at
    a time. The fp32 outputs are kept for the comparisons; the generated inputs are generated
    again, from the same seed, for each session. A graph whose weights pass one calibration slice
    (:data:`~qeff_vision.numerics.recording.DEFAULT_SLICE_BYTES`) runs slice by slice, each
    slice's session built once, run on every specialization and released (:class:`_GraphRunner`):
    memory does not grow with depth, each weight is read once per session kind, and a
    specialization's latency is its share of the slices' run time.

    Args:
        program: ``vision`` or ``lang``, for messages.
        onnx_path: The exported graph (external data beside it).
        specializations: Symbol values of each specialization.
        source: What the specializations came from (the spec path), for messages.
        seed: Seed of the generated float inputs.
        progress: Called with one line per finished specialization (and per device-precision run).
        device_values: Node outputs kept in fp32 at device precision; ``None`` skips that check.
        mx: Microscaling formats of the compile (``-mxfp6-matmul``, an MXINT8 KV cache): their
            deviation is recorded too, on top of fp16 (a report, not a check).
        image_sizes: Per specialization, the image it was built from (``image_sizes`` inputs).

    Raises:
        SpecError: A specialization misses a graph symbol or names one the graph lacks.
        UserError: onnxruntime fails on a specialization, an output shape differs, or device
            precision overflows.
    """
    onnx_path = Path(onnx_path)
    graph = read_graph_io(onnx_path)
    check_program_symbols(graph, specializations, program, source or str(onnx_path))
    names = [tensor.name for tensor in graph.outputs]
    session = _fp32_runner(onnx_path, names)
    stage = None
    if isinstance(session, _GraphRunner):  # passes over slices: minutes at full depth
        from qeff_vision.progress import SliceCounter, StageProgress

        stage = StageProgress(f"{program} check", 0, unit="slices", say=progress)
        session.on_slice = SliceCounter(stage)
    # Handed over in a list, so this frame keeps no reference once _verify lets the fp32 weights go.
    held = [session]
    del session
    try:
        return _verify(
            program,
            onnx_path,
            graph,
            specializations,
            held,
            names,
            seed,
            progress,
            device_values,
            mx,
            image_sizes,
        )
    finally:
        if stage is not None:
            stage.close()


def _verify(
    program,
    onnx_path,
    graph,
    specializations,
    held,
    names,
    seed,
    progress,
    device_values,
    mx,
    image_sizes,
) -> list[SpecializationRun]:
    """:func:`verify_program` once its fp32 runner is made (``held``: a list holding only it)."""
    from qeff_vision.fsutil import release_memory

    session = held.pop()
    on_slice = session.on_slice if isinstance(session, _GraphRunner) else None

    def cases():
        return _generated_cases(graph, specializations, program, seed, image_sizes)

    references, latencies, shapes = [], [], []
    for (index, values, where, feeds), results, seconds in _runs(session, names, cases()):
        latencies.append(seconds * 1000.0)
        shapes.append(_checked_shapes(graph, values, where, feeds, names, results))
        references.append(results)
        if progress:
            progress(f"{program} specialization {index}: ok in {latencies[-1]:.1f} ms {dict(values)}")
    session = None  # the fp32 weights go before the device-precision session loads
    release_memory()
    compared = with_mx = [None] * len(references)
    if device_values is not None:
        compared = _device_deviations(
            program, onnx_path, cases, names, references, device_values, None, progress, on_slice
        )
        if mx is not None and (mx.matmul_weights or mx.kv_mxint8):
            with_mx = _device_deviations(
                program, onnx_path, cases, names, references, device_values, mx, None, on_slice
            )
    label = mx.label(grid_of(device_values)) if mx is not None else ""
    return [
        SpecializationRun(
            index,
            dict(values),
            latencies[index],
            shapes[index],
            compared[index],
            with_mx[index],
            label if with_mx[index] else "",
        )
        for index, values in enumerate(specializations)
    ]


def _generated_cases(graph: GraphIO, specializations, program: str, seed: int, image_sizes):
    """Per specialization: index, symbol values, its name in messages and its generated inputs.

    The same ``seed`` gives the same inputs, so each session of a verification generates them
    again instead of holding every specialization's inputs.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    for index, values in enumerate(specializations):
        where = f"{program} specialization {index} {dict(values)}"
        slots = int(values.get(symbols.FULL_BATCH_SIZE, 0))
        image_size = image_sizes[index] if image_sizes else None
        feeds = {
            tensor.name: generated_input(tensor, bound_shape(tensor, values, where), rng, slots, image_size)
            for tensor in graph.inputs
        }
        yield index, values, where, feeds


def _runs(session, names: Sequence[str], cases):
    """(case, outputs, seconds) per case: one call each on a session, one pass over all on slices.

    A sliced runner (:class:`_GraphRunner` over a graph larger than a slice) runs every case
    slice-major: each slice's session is built once for all the specializations, not once per
    specialization; a case's seconds are then its share of the slices' run time (builds excluded).

    Raises:
        UserError: onnxruntime failed on a case (named by its ``where``).
    """
    if isinstance(session, _GraphRunner) and session.recorder is not None:
        cases = list(cases)
        try:
            outputs, seconds = session.run_all(names, [case[3] for case in cases])
        except SliceRunError as exc:
            where = cases[exc.index][2]
            raise UserError(f"{where}: onnxruntime failed: {str(exc.error).splitlines()[0]}") from exc
        yield from zip(cases, outputs, seconds)
        return
    for case in cases:
        start = time.perf_counter()
        try:
            results = session.run(names, case[3])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise UserError(f"{case[2]}: onnxruntime failed: {str(exc).splitlines()[0]}") from exc
        yield case, results, time.perf_counter() - start


def _checked_shapes(graph: GraphIO, values, where: str, feeds, names, results) -> dict[str, list[int]]:
    """Every output's shape, checked against the bound one (and untouched slots left alone)."""
    shapes, problems = {}, []
    for tensor, result in zip(graph.outputs, results):
        expected = tensor.bind(values)
        actual = tuple(result.shape)
        if len(expected) != len(actual) or any(e is not None and e != a for e, a in zip(expected, actual)):
            shown = ["?" if e is None else e for e in expected]
            problems.append(f"output {tensor.name} has shape {list(actual)}, expected {shown}")
        shapes[tensor.name] = [int(d) for d in actual]
    problems += untouched_slot_problems(feeds, dict(zip(names, results)))
    if problems:
        raise UserError(f"{where}: " + "; ".join(problems))
    return shapes


def _device_deviations(
    program: str,
    onnx_path: Path,
    cases: Callable[[], Any],
    names: Sequence[str],
    references: Sequence[Sequence[Any]],
    device_values: Sequence[str],
    mx: MxEmulation | None,
    progress: Callable[[str], None] | None,
    on_slice: Callable[[int, int], None] | None = None,
) -> list[DeviceDeviation]:
    """Each specialization at device precision (``mx`` formats on top, if any) against its fp32 outputs.

    Raises:
        UserError: fp16 (without MX formats) produced an inf/NaN; the message names the first node
            beyond fp16's range (found by an fp32 run after this session is released).
    """
    from qeff_vision.fsutil import release_memory

    graph, weights = device_model(onnx_path, device_values, mx)
    session = _GraphRunner(graph, onnx_path.parent, names, weights)
    session.on_slice = on_slice
    del graph
    found = []
    for (index, _, where, feeds), results, _ in _runs(session, names, cases()):
        compared = deviation(names, references[index], results)
        if not compared.finite and mx is None:
            del session
            release_memory()
            raise UserError(overflow_message(program, onnx_path, feeds, device_values, where))
        found.append(compared)
        if progress:
            shown = f"device precision max deviation {compared.max_relative:.2e}"
            progress(f"{program} specialization {index}: {shown}")
    del session
    release_memory()
    return found


class _GraphRunner:
    """Runs one graph (an in-memory model over external data): one session, or slice by slice.

    A graph whose weights fit one slice gets one session. A larger one runs through
    :class:`~qeff_vision.numerics.recording.SlicedRecorder` with nothing recorded: slices of at most
    :data:`~qeff_vision.numerics.recording.DEFAULT_SLICE_BYTES` of weights, each session built,
    run and released in turn, values dropped after their last reader.
    """

    def __init__(self, model, model_dir: Path, names: Sequence[str], weights=None):
        from qeff_vision.graph_file import weight_bytes
        from qeff_vision.numerics.device import session_for, value_types
        from qeff_vision.numerics.recording import DEFAULT_SLICE_BYTES, SlicedRecorder

        self.names = list(names)
        self.session = self.recorder = None
        self.on_slice: Callable[[int, int], None] | None = None  # progress of a sliced pass
        if weight_bytes(model) <= DEFAULT_SLICE_BYTES:
            self.session = session_for(model, model_dir, initializers=weights(None) if weights else None)
        else:
            types = value_types(model)
            self.recorder = SlicedRecorder(
                model, model_dir, [], types, self.names, slice_bytes=DEFAULT_SLICE_BYTES, initializers=weights
            )

    def run_all(
        self, names: Sequence[str], feeds: Sequence[Mapping[str, Any]]
    ) -> tuple[list[list[Any]], list[float]]:
        """The outputs ``names`` for each of ``feeds``, and each call's run seconds.

        Sliced: one pass over the slices for every call (:meth:`SlicedRecorder.run_many`).
        """
        if self.session is not None:
            outputs, seconds = [], []
            for feed in feeds:
                start = time.perf_counter()
                outputs.append(self.session.run(list(names), dict(feed)))
                seconds.append(time.perf_counter() - start)
            return outputs, seconds
        results = self.recorder.run_many(feeds, self.on_slice)
        return [[result[name] for name in names] for result in results], list(self.recorder.call_seconds)

    def run(self, names: Sequence[str], feeds: Mapping[str, Any]) -> list[Any]:
        """The outputs ``names`` (a subset of the runner's) for ``feeds``."""
        if self.session is not None:
            return self.session.run(list(names), dict(feeds))
        results = self.recorder.run(feeds)
        return [results[name] for name in names]


def _fp32_runner(onnx_path: Path, names: Sequence[str]):
    """The exported graph as it is: an onnxruntime session on the file, or a sliced runner.

    Raises:
        UserError: onnxruntime cannot load the graph.
    """
    import onnxruntime

    from qeff_vision.graph_file import weight_bytes
    from qeff_vision.numerics.layer_functions import load_flat_graph
    from qeff_vision.numerics.recording import DEFAULT_SLICE_BYTES

    model = load_flat_graph(onnx_path)
    if weight_bytes(model) > DEFAULT_SLICE_BYTES:
        return _GraphRunner(model, onnx_path.parent, names)
    del model
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_quant_qdq", "1")  # as numerics.device.session_for
    try:
        return onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
        raise UserError(f"{onnx_path}: onnxruntime cannot load the graph ({exc})") from exc
