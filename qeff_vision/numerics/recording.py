"""Run an fp32 graph slice by slice, recording the largest magnitude of every float node output.

A precision plan needs, per float node output, its largest magnitude over the calibration inputs
(:mod:`qeff_vision.numerics.plan`). Running the whole graph with every output exposed holds every
weight and every recorded value at once; at real widths that is far beyond the host (Llama 3.2
Vision with 5 of 40 text layers: killed at 24 GiB). Here peak memory does not grow with depth:

* **Slices.** The graph's nodes, in their (topological) order, are cut into slices whose
  initializers add up to at most ``slice_bytes`` (a single larger weight is a slice of its own).
  Each slice is a graph of its own: its inputs are the values earlier slices produced (or the
  graph's inputs), its outputs the values later slices or the caller read. A call runs the slices
  in order, each in a session built for the call and released after it, so weights are read as
  they are needed and only one slice's weights are in memory; values are dropped after their
  last reader. A graph whose weights fit in one slice keeps its sessions between calls.
* **Statistics as values are produced.** Each recorded value gets three scalar reductions in the
  graph right after its producer (``ReduceMax``, ``ReduceMin``, ``ReduceSum``): no temporary as
  large as the value, and the session runs nodes in graph order, so onnxruntime frees the value
  after its last reader as in a plain run (its default order runs such extra readers last and
  keeps every value of the graph alive until then: 20 probed 100 MB values, 2.2 GB against 0.38). Its peak is
  ``max(max, -min, 0)`` unless that reaches :data:`~qeff_vision.numerics.plan.MASK_SENTINEL` or the
  sum is NaN: such a value (an attention mask, scores with the mask added) needs the magnitudes
  below the sentinel, so its slice is cut right after its producer and the value, now a slice
  output, is reduced on the host in fixed-size chunks; the next slice ends after its last reader
  (a slice holds its inputs until it ends). So does every slice input of :data:`LARGE_VALUE` bytes
  or more, found on the first call that feeds it. The cut is found on the call that first
  sees the sentinel (that slice runs again) and kept for later calls.

The peaks are exactly those of the whole graph with every value exposed (tests/test_recording.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from qeff_vision.fsutil import release_memory
from qeff_vision.graph_file import tensor_bytes
from qeff_vision.numerics.device import session_for

# Initializer bytes per slice: a real-width decoder layer is a few slices, a tiny graph one.
DEFAULT_SLICE_BYTES = 512 * 2**20
# Magnitudes from here on are attention-mask sentinels (float32's minimum), not activations.
MASK_SENTINEL = 1e30
# Inputs from here on make their slice end after their last reader (attention-sized values).
LARGE_VALUE = 64 * 2**20
# Elements per host-side chunk when reducing a masked value (bounded temporaries).
HOST_CHUNK = 1 << 22
_MAX, _MIN, _SUM = "__rec_max", "__rec_min", "__rec_sum"


@dataclass(frozen=True)
class Ref:
    """Output ``name`` of call ``call`` of the same :meth:`SlicedRecorder.run_many` pass, as an input."""

    call: int
    name: str
    shape: tuple[int, ...] | None = None  # known for a retained state: a slice that only reads
    dtype: object = None  # its shape (Shape nodes) runs on a placeholder before it is produced


def _nbytes(value) -> int:
    return value.nbytes if isinstance(value, np.ndarray) else 0


def _referenced(values: Sequence[Mapping[str, object]]) -> set[tuple[int, str]]:
    """(call, output) pairs a call's remaining inputs still refer to."""
    return {(v.call, v.name) for call in values for v in call.values() if isinstance(v, Ref)}


def _resolved(call: Mapping[str, object], part, graph, values) -> dict[str, np.ndarray]:
    """``call``'s inputs of ``part`` as arrays, references followed.

    A placeholder of the referred output's shape stands in where ``part`` reads only the shape
    (the output comes in a later slice).
    """
    inputs = {}
    for name in part.inputs:
        value = call[name]
        if isinstance(value, Ref):
            produced = values[value.call].get(value.name)
            if produced is None and value.shape is not None and graph.shape_only(part, name):
                produced = np.zeros(value.shape, value.dtype)  # pages never touched: no memory
            if produced is None:
                raise RuntimeError(f"{name}: call {value.call}'s {value.name} is not produced yet")
            value = produced
        inputs[name] = value
    return inputs


class SliceRunError(RuntimeError):
    """onnxruntime failed on call ``index`` of a :meth:`SlicedRecorder.run_many` pass."""

    def __init__(self, index: int, error: Exception):
        super().__init__(str(error))
        self.index = index
        self.error = error


def masked_peak(array: np.ndarray) -> float:
    """Largest magnitude below :data:`MASK_SENTINEL` (NaN and infinities left out; 0 when none)."""
    flat = array.reshape(-1)
    peak = 0.0
    for start in range(0, flat.size, HOST_CHUNK):
        part = np.abs(flat[start : start + HOST_CHUNK].astype(np.float32, copy=False))
        part = part[part < MASK_SENTINEL]  # NaN compares False
        if part.size:
            peak = max(peak, float(part.max()))
    return peak


def _reads(node: onnx.NodeProto) -> set[str]:
    """Values ``node`` reads: its inputs and what its subgraphs take from the enclosing scope."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for graph in subgraphs:
            defined = {value.name for value in (*graph.input, *graph.initializer)}
            used: set[str] = set()
            for inner in graph.node:
                used |= _reads(inner)
                defined.update(inner.output)
            names |= used - defined
    return names


@dataclass
class GraphSlice:
    """Nodes ``start:stop`` of the graph and the values they exchange with the rest."""

    start: int
    stop: int
    inputs: list[str]
    outputs: list[str]
    initializers: list[str]
    constants: list[str]  # outputs of Constant nodes of earlier slices this one reads (copied in)
    recorded: list[str]
    exposed: list[str]  # recorded values reduced on the host (they hold mask sentinels)


class SlicedGraph:
    """The slices of one graph (structure only: initializers' data stays on disk)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        recorded: Sequence[str],
        types: Mapping[str, int],
        wanted: Sequence[str],
        slice_bytes: int = DEFAULT_SLICE_BYTES,
    ):
        self.model = model
        graph = model.graph
        self.nodes = list(graph.node)
        self.reads = [_reads(node) for node in self.nodes]
        self.initializers = {tensor.name: tensor for tensor in graph.initializer}
        # A constant read by a later slice is copied into it rather than fed: onnxruntime's shape
        # inference reads a Reshape target or a Scan's sizes from it, as in the whole graph.
        self.constants = {
            node.output[0]: node
            for node in graph.node
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
        }
        self.recorded = list(recorded)
        self.types = dict(types)
        self.wanted = list(wanted)
        self.exposed: set[str] = set()
        self.producer = {name: index for index, node in enumerate(self.nodes) for name in node.output if name}
        self.weight_bytes = {name: tensor_bytes(tensor) for name, tensor in self.initializers.items()}
        self.cuts = self._weight_cuts(slice_bytes)
        self.protected: list[tuple[int, int]] = []  # node ranges no cut may split (chained calls)
        inputs = {value.name for value in graph.input}
        # Outputs that are an input passed through (mllama's cross-attention states): a later call
        # reading one reads the earlier call's input, not something it computes.
        self.passthrough = {
            node.output[0]: node.input[0]
            for node in self.nodes
            if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.input[0] in inputs
        }
        self.readers: dict[str, list[int]] = {}  # value -> indices of the nodes reading it
        for index, reads in enumerate(self.reads):
            for name in reads:
                self.readers.setdefault(name, []).append(index)
        self.slices = self._slices()

    def _weight_cuts(self, slice_bytes: int) -> list[int]:
        """Node indices where a slice starts, so that each slice's initializers fit in ``slice_bytes``."""
        cuts, taken, size = [0], set(), 0
        for index, reads in enumerate(self.reads):
            new = {name for name in reads if name in self.initializers} - taken
            added = sum(self.weight_bytes[name] for name in new)
            if index > cuts[-1] and size + added > slice_bytes:
                cuts.append(index)
                taken, size = set(), 0
            taken |= new
            size += added
        return cuts

    def cut_after(self, names: Iterable[str]) -> None:
        """Reduce ``names`` on the host from now on: each producer ends a slice, each value is an output."""
        for name in names:
            self.exposed.add(name)
            self.cuts.append(self.producer[name] + 1)
            self._cut_after_last_reader(name)
        self.cuts = sorted({cut for cut in self._allowed(self.cuts) if cut < len(self.nodes)})
        self.slices = self._slices()

    def chained_prefix(self, calls: Sequence[Mapping[str, object]]) -> int:
        """How many leading ``calls`` run slice-major together; protects their hand-overs from cuts.

        A call whose input X is an earlier call's output (a :class:`Ref`) runs in the same pass when
        the slice producing that output comes no later than the first slice reading X's values
        (slices before it that only read X's shape, with ``Shape``, get a placeholder of the
        Ref's shape). Cuts added during the pass never fall between those two nodes
        (:attr:`protected`), so what holds now holds to the end of the pass.
        """
        self.protected = []
        slice_of = self._slice_index()
        for number, call in enumerate(calls):
            for name, value in call.items():
                if not isinstance(value, Ref):
                    continue
                if value.call >= number:
                    raise ValueError(
                        f"call {number} input {name} refers to call {value.call}, not an earlier one"
                    )
                produced = self.producer.get(value.name)
                readers = self.readers.get(name, [])
                if produced is None or not readers:
                    continue
                values_read = [i for i in readers if not self._shape_only(i, name)]
                first_value = values_read[0] if values_read else len(self.nodes)
                before = readers[0] < produced and slice_of[readers[0]] < slice_of[produced]
                if (values_read and slice_of[produced] > slice_of[first_value]) or (
                    before and value.shape is None
                ):
                    self.protected = []
                    return max(number, 1)
                if produced > first_value:
                    self.protected.append((first_value, produced))
        return len(calls)

    def _shape_only(self, index: int, name: str) -> bool:
        node = self.nodes[index]
        return node.op_type == "Shape" and node.domain in ("", "ai.onnx") and list(node.input) == [name]

    def shape_only(self, part: GraphSlice, name: str) -> bool:
        """Every node of ``part`` reading ``name`` reads only its shape."""
        return all(self._shape_only(i, name) for i in range(part.start, part.stop) if name in self.reads[i])

    def _slice_index(self) -> list[int]:
        bounds = [*self.cuts, len(self.nodes)]
        index = [0] * len(self.nodes)
        for number, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            index[start:stop] = [number] * (stop - start)
        return index

    def _allowed(self, cuts: Iterable[int]) -> list[int]:
        """``cuts`` without those that would fall inside a protected hand-over (see chained_prefix)."""
        return [c for c in cuts if not any(first < c <= last for first, last in self.protected)]

    def release_early(self, part: GraphSlice, sizes: Mapping[str, int]) -> bool:
        """Cut ``part`` after the last reader of each large input; True when the slices changed.

        A slice holds its inputs until it ends; a plain run frees a value after its last reader.
        """
        before = len(self.cuts)
        for name in part.inputs:
            if sizes[name] >= LARGE_VALUE:
                self._cut_after_last_reader(name, part.start, part.stop - 1)
        self.cuts = sorted(set(self._allowed(self.cuts)))
        if len(self.cuts) == before:
            return False
        self.slices = self._slices()
        return True

    def _cut_after_last_reader(self, name: str, start: int = 0, stop: int | None = None) -> None:
        stop = len(self.nodes) - 1 if stop is None else stop
        readers = [index for index in range(start, stop) if name in self.reads[index]]
        if readers:
            self.cuts.append(max(readers) + 1)

    def _slices(self) -> list[GraphSlice]:
        bounds = [*self.cuts, len(self.nodes)]
        index_of = {}
        for number, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            for index in range(start, stop):
                index_of[index] = number
        last_reader: dict[str, int] = {}
        for index, reads in enumerate(self.reads):
            for name in reads:
                last_reader[name] = index_of[index]
        wanted, recorded = set(self.wanted), set(self.recorded)
        slices = []
        for number, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            produced = [name for node in self.nodes[start:stop] for name in node.output if name]
            reads = set().union(*self.reads[start:stop])
            own = set(produced)
            outside = reads - own
            slices.append(
                GraphSlice(
                    start,
                    stop,
                    inputs=sorted(
                        n for n in outside if n not in self.initializers and n not in self.constants
                    ),
                    outputs=[
                        name
                        for name in produced
                        if name in wanted
                        or name in self.exposed
                        or (last_reader.get(name, -1) > number and name not in self.constants)
                    ],
                    initializers=sorted(name for name in reads if name in self.initializers),
                    constants=sorted(name for name in outside if name in self.constants),
                    recorded=[name for name in produced if name in recorded and name not in self.exposed],
                    exposed=[name for name in produced if name in self.exposed],
                )
            )
        self.last_reader = last_reader
        return slices

    def _without_copy(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """``node``, or an ``Identity`` for a Cast to the type it already has.

        Such a Cast (an fp32 softmax cast "to the compute dtype") copies its input; onnxruntime
        removes it from a plain run, but not while a reduction reads its output. ``Identity``
        aliases the buffer: the same values without a second attention-sized tensor.
        """
        if not _is_same_type_cast(node, self.types):
            return node
        return helper.make_node("Identity", list(node.input), list(node.output), name=node.name)

    def slice_model(self, part: GraphSlice, inputs: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The slice as a model for ``inputs`` (types and shapes).

        Its nodes, the initializers they read, and three reductions per recorded value.
        """
        outputs = [onnx.ValueInfoProto(name=name) for name in part.outputs]
        recorded = set(part.recorded)
        # Each value's reductions come right after its producer and the session runs nodes in graph
        # order: the value is freed after its last reader (by default onnxruntime may run every
        # reduction at the slice's end and keep every value alive until then).
        nodes = [*(self.constants[name] for name in part.constants)]
        for node in self.nodes[part.start : part.stop]:
            nodes.append(self._without_copy(node))
            for name in (o for o in node.output if o in recorded):
                source = name
                if self.types.get(name) != TensorProto.FLOAT:  # reductions run in float32
                    source = f"{name}__rec_float"
                    nodes.append(helper.make_node("Cast", [name], [source], to=TensorProto.FLOAT))
                for op, suffix in (("ReduceMax", _MAX), ("ReduceMin", _MIN), ("ReduceSum", _SUM)):
                    nodes.append(helper.make_node(op, [source], [name + suffix], keepdims=0))
                    outputs.append(helper.make_tensor_value_info(name + suffix, TensorProto.FLOAT, []))
        graph = helper.make_graph(
            nodes,
            f"slice_{part.start}",
            [
                helper.make_tensor_value_info(
                    name,
                    helper.np_dtype_to_tensor_dtype(array.dtype),
                    [f"{name}_{axis}" for axis in range(array.ndim)],
                )
                for name, array in inputs.items()
            ],
            outputs,
            initializer=[self.initializers[name] for name in part.initializers],
        )
        sliced = helper.make_model(
            graph, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version
        )
        sliced.functions.extend(self.model.functions)
        return sliced


def _is_same_type_cast(node: onnx.NodeProto, types: Mapping[str, int]) -> bool:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.input:
        return False
    target = next((attribute.i for attribute in node.attribute if attribute.name == "to"), None)
    return target is not None and types.get(node.input[0]) == target


class SlicedRecorder:
    """Runs a graph slice by slice on onnxruntime, raising ``ranges`` to each recorded value's peak.

    Args:
        model: The graph (node attributes in memory, initializers' data on disk).
        model_dir: Where its external data lives.
        recorded: Float node outputs whose peaks are recorded.
        types: Element type of every value (:func:`~qeff_vision.numerics.device.value_types`).
        wanted: Graph outputs :meth:`run` returns.
        slice_bytes: Initializer bytes per slice.
        threads: Intra-op threads (0 lets onnxruntime choose).
        initializers: Replaced values of a slice's initializers (MX-rounded weights), given their
            names; called when the slice's session is built.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        model_dir: Path,
        recorded: Sequence[str],
        types: Mapping[str, int],
        wanted: Sequence[str] = (),
        *,
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        threads: int = 0,
        initializers: Callable[[Sequence[str]], Mapping[str, np.ndarray]] | None = None,
    ):
        self.graph = SlicedGraph(model, recorded, types, wanted, slice_bytes)
        self.model_dir = Path(model_dir)
        self.threads = threads
        self.initializers = initializers
        self.ranges: dict[str, float] = dict.fromkeys(recorded, 0.0)
        # Sessions stay loaded between calls only while the whole graph's weights fit one slice.
        self.keep_sessions = sum(self.graph.weight_bytes.values()) <= slice_bytes
        self._sessions: dict[tuple, object] = {}
        self.call_seconds: list[float] = []  # per call of the last pass: seconds in its sessions' runs
        self.on_slice: Callable[[int, int], None] | None = None  # progress, when a pass names none
        self.calls_run = 0  # calls run so far (over all passes)
        self.passes = 0  # passes over the slices (run_many calls, a further pass counted apart)
        self.sessions_built = 0  # onnxruntime sessions built so far (a cost the benchmark reports)

    @property
    def slices(self) -> list[GraphSlice]:
        """The current slices (they gain cuts as mask-carrying values are found)."""
        return self.graph.slices

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run every slice on ``feeds``; the ``wanted`` outputs by name."""
        try:
            return self.run_many([feeds])[0]
        except SliceRunError as exc:  # one call: onnxruntime's own error, as a plain run raises it
            raise exc.error from None

    def run_many(
        self,
        feeds: Sequence[Mapping[str, np.ndarray | Ref]],
        on_slice: Callable[[int, int], None] | None = None,
        keep: Sequence[Iterable[str]] | None = None,
    ) -> list[dict[str, np.ndarray]]:
        """Run calls in one pass over the slices; each call's kept outputs.

        Slice-major: each slice's session is built once and runs every call before the next slice
        is built, so each weight is read once for all the calls (not once per call), and only the
        values crossing the current slice boundary are held, per call. The results are those of
        :meth:`run` on each call in turn (the same sessions on the same values).

        A call may take an earlier call's output as an input (a :class:`Ref`: the KV cache a
        prefill chunk leaves for the next). The pass stays slice-major as long as each such output
        is produced no later than the slice that reads it (a KV update reads and writes the cache
        in one node); a call that needs one sooner ends the pass there, and it and the calls after
        it run in a further pass.

        Args:
            feeds: The calls' inputs (shapes may differ: slice inputs have symbolic dims).
            on_slice: Called with (slices done, slices) after each slice, for progress.
            keep: Per call, the outputs to return (default: the recorder's ``wanted``).

        Raises:
            SliceRunError: onnxruntime failed on one call (its index and the error).
        """
        on_slice = on_slice or self.on_slice
        keep_sets = [set(self.graph.wanted)] * len(feeds) if keep is None else [set(k) for k in keep]
        originals = []
        for feed in feeds:  # a reference to an input passed through is that input
            originals.append({name: self._followed(value, originals) for name, value in feed.items()})
        values = [dict(feed) for feed in originals]
        self.call_seconds = [0.0] * len(values)
        active = self.graph.chained_prefix(values)
        number = 0
        while number < len(self.graph.slices):
            part = self.graph.slices[number]
            sizes = {
                name: max((_nbytes(v.get(name)) for v in values[:active]), default=0) for name in part.inputs
            }
            if self.graph.release_early(part, sizes):
                continue
            found: list[str] = []
            referenced = _referenced(values)
            sessions: dict[tuple, object] = {}
            for index in range(active):
                call = values[index]
                inputs = _resolved(call, part, self.graph, values)
                # A slice nobody reads from (integer arithmetic only its own nodes use) has no
                # outputs: onnxruntime cannot build a session for it, and there is nothing to run.
                outputs = (
                    self._run_slice(part, inputs, sessions, index) if part.outputs or part.recorded else {}
                )
                found = self._record(part, outputs)
                if found:
                    break
                for name in part.exposed:
                    self.ranges[name] = max(self.ranges.get(name, 0.0), masked_peak(outputs[name]))
                # The slice's inputs stay until every call ran it (a cut found later reruns it).
                kept = [
                    name
                    for name in part.outputs
                    if name in keep_sets[index]
                    or (index, name) in referenced
                    or self.graph.last_reader.get(name, -1) > number
                ]
                call.update({name: outputs[name] for name in kept})
                del outputs, inputs
            sessions.clear()
            if not self.keep_sessions:
                release_memory(collect=False)  # the slice's weights and arena go now
            if found:  # mask-carrying values: cut after each and run the slice again for every call
                self.graph.cut_after(found)
                bounds = {(part.start, part.stop) for part in self.graph.slices}
                self._sessions = {key: s for key, s in self._sessions.items() if key[:2] in bounds}
                continue
            # Values past their last reader go: a reference once its reader ran, an output once no
            # call refers to it and it is not kept.
            for call in values[:active]:
                for name in [n for n, v in call.items() if isinstance(v, Ref)]:
                    if self.graph.last_reader.get(name, -1) <= number:
                        del call[name]
            referenced = _referenced(values)
            for index, call in enumerate(values[:active]):
                for name in [n for n in call if self.graph.last_reader.get(n, -1) <= number]:
                    if name not in keep_sets[index] and (index, name) not in referenced:
                        del call[name]
            number += 1
            if on_slice is not None:
                on_slice(number, len(self.graph.slices))
        self.graph.protected = []
        self.passes += 1
        self.calls_run += active
        done = [{name: values[i][name] for name in keep_sets[i]} for i in range(active)]
        if active == len(values):
            return done
        # The rest in a further pass; their references to this pass's calls are arrays by now.
        rest = [
            {
                name: (
                    values[v.call][v.name]
                    if v.call < active
                    else Ref(v.call - active, v.name, v.shape, v.dtype)
                )
                if isinstance(v, Ref)
                else v
                for name, v in feed.items()
            }
            for feed in originals[active:]
        ]
        seconds = self.call_seconds
        later = self.run_many(rest, on_slice, keep_sets[active:])
        self.call_seconds = seconds[:active] + self.call_seconds
        return done + later

    def _followed(self, value, calls: Sequence[Mapping[str, object]]):
        while isinstance(value, Ref) and value.name in self.graph.passthrough:
            value = calls[value.call][self.graph.passthrough[value.name]]
        return value

    def _run_slice(
        self, part: GraphSlice, values: Mapping[str, np.ndarray], sessions: dict, index: int = 0
    ) -> dict[str, np.ndarray]:
        """``part`` on one call's values; ``sessions`` holds this pass's sessions of the slice."""
        inputs = {name: values[name] for name in part.inputs}
        key = (part.start, part.stop, tuple(part.exposed), *(a.dtype.str for a in inputs.values()))
        session = self._sessions.get(key) or sessions.get(key)
        if session is None:
            model = self.graph.slice_model(part, inputs)
            # No arena: a kept session would hold its peak activations between calls.
            replaced = self.initializers(part.initializers) if self.initializers else None
            session = session_for(
                model, self.model_dir, self.threads, replaced, in_graph_order=True, arena=False
            )
            self.sessions_built += 1
            (self._sessions if self.keep_sessions else sessions)[key] = session
        names = [o.name for o in session.get_outputs()]
        start = time.perf_counter()
        try:
            results = dict(zip(names, session.run(names, inputs)))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise SliceRunError(index, exc) from exc
        self.call_seconds[index] += time.perf_counter() - start
        return results

    def _record(self, part: GraphSlice, outputs: Mapping[str, np.ndarray]) -> list[str]:
        """Raise the ranges of ``part``'s reduced values; those holding a sentinel or NaN, if any.

        Nothing is recorded when one is found: the slice runs again after the cuts.
        """
        peaks, found = {}, []
        for name in part.recorded:
            top = max(float(outputs[name + _MAX]), -float(outputs[name + _MIN]))
            if not top < MASK_SENTINEL or np.isnan(outputs[name + _SUM]):
                found.append(name)
            peaks[name] = max(top, 0.0)
        if not found:
            for name, peak in peaks.items():
                self.ranges[name] = max(self.ranges[name], peak)
        return found


def record_ranges(
    recorder: SlicedRecorder,
    feeds: Iterable[Mapping[str, np.ndarray]],
    on_slice: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Run ``recorder`` on every feed, in one pass over its slices; its ranges."""
    recorder.run_many(list(feeds), on_slice)
    return recorder.ranges
