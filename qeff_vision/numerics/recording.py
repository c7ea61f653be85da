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
  below the sentinel. It gets them in the graph from then on (``ReduceMax`` of ``Where(|x| <
  sentinel, |x|, 0)``, no cut: decision 047); one whose float32 copy reaches :data:`LARGE_VALUE`
  bytes instead ends its slice right after its producer and, now a slice output, is reduced on
  the host in fixed-size chunks; the next slice ends after its last reader (a slice holds its
  inputs until it ends). So does every slice input of :data:`LARGE_VALUE` bytes or more, found on
  the first call that feeds it. Either change is found on the call that first sees the sentinel
  (that slice runs again) and kept for later calls. A recorded ``Constant``'s peak is taken from
  its value, without a run.

The peaks are exactly those of the whole graph with every value exposed (tests/test_recording.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qeff_vision.fsutil import release_memory
from qeff_vision.numerics.arena import shrinking_run_options
from qeff_vision.numerics.device import session_for
from qeff_vision.numerics.same_values import same_magnitudes
from qeff_vision.numerics.slicing import (
    _CLEAN,
    _MAX,
    _MIN,
    _PEAK,
    _SIZE,
    _SUM,
    LARGE_VALUE,
    MASK_SENTINEL,
    GraphSlice,
    Ref,
    SlicedGraph,
)

__all__ = [
    "LARGE_VALUE",
    "GraphSlice",
    "Ref",
    "SlicedGraph",
    "SlicedRecorder",
    "SliceRunError",
    "record_ranges",
]

# Initializer bytes per slice: a real-width decoder layer is a few slices, a tiny graph one.
DEFAULT_SLICE_BYTES = 512 * 2**20
# Elements per host-side chunk when reducing a masked value (bounded temporaries).
HOST_CHUNK = 1 << 22


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


def _constant_peaks(model: onnx.ModelProto, recorded: Sequence[str]) -> dict[str, float]:
    """Peaks of the recorded outputs of ``Constant`` nodes, from their values (as a run records them)."""
    wanted, peaks = set(recorded), {}
    for node in model.graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or node.output[0] not in wanted:
            continue
        attribute = node.attribute[0] if len(node.attribute) == 1 else None
        if attribute is None or attribute.name not in ("value", "value_float", "value_floats"):
            continue
        value = helper.get_attribute_value(attribute)
        array = numpy_helper.to_array(value) if attribute.name == "value" else np.asarray(value)
        peaks[node.output[0]] = masked_peak(np.asarray(array))
    return peaks


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
        # A Constant's peak is known from the graph: recording it in a slice would only cost a cut
        # (a sentinel constant, the mask's fill value, is reduced on the host: 2 cuts per layer).
        self.constant_peaks = _constant_peaks(model, recorded)
        # A reshaped or transposed value's peak is its input's: copied, not reduced again.
        self.same = same_magnitudes(model, recorded, types)
        computed = [name for name in recorded if name not in self.constant_peaks and name not in self.same]
        self.graph = SlicedGraph(model, computed, types, wanted, slice_bytes)
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
        self._run_options = shrinking_run_options()

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
        if feeds:
            for name, peak in self.constant_peaks.items():
                self.ranges[name] = max(self.ranges[name], peak)
        keep_sets = [set(self.graph.wanted)] * len(feeds) if keep is None else [set(k) for k in keep]
        originals = []
        for feed in feeds:  # a reference to an input passed through is that input
            originals.append({name: self._followed(value, originals) for name, value in feed.items()})
        values = [dict(feed) for feed in originals]
        self.call_seconds = [0.0] * len(values)
        active = self.graph.chained_prefix(values)
        # Per call, the node index up to which it has run: after a slice changes (new cuts, values
        # reduced below the sentinel) only the calls that have not run its nodes run it.
        reached = [0] * active
        number = 0
        while number < len(self.graph.slices):
            part = self.graph.slices[number]
            sizes = {
                name: max((_nbytes(v.get(name)) for v in values[:active]), default=0) for name in part.inputs
            }
            if self.graph.release_early(part, sizes):
                continue
            found: list[str] = []
            large: list[str] = []
            clean: list[str] = []
            referenced = _referenced(values)
            sessions: dict[tuple, object] = {}
            # A slice that reads nothing from the calls (a weight's Transpose: the tied language
            # head, 1.24 GB at full depth) computes the same values for every call: it runs once
            # and every call holds the same arrays, not a copy each.
            constant = not part.inputs
            shared: dict[str, np.ndarray] | None = None
            for index in range(active):
                if reached[index] >= part.stop:
                    continue
                call = values[index]
                inputs = _resolved(call, part, self.graph, values)
                if shared is not None:
                    outputs = shared
                else:
                    # A slice nobody reads from (integer arithmetic only its own nodes use) has no
                    # outputs: onnxruntime cannot build a session for it, and there is nothing to run.
                    outputs = (
                        self._run_slice(part, inputs, sessions, index)
                        if part.outputs or part.recorded
                        else {}
                    )
                    found, large, clean = self._record(part, outputs)
                    if found:
                        break
                    for name in part.exposed:
                        self.ranges[name] = max(self.ranges.get(name, 0.0), masked_peak(outputs[name]))
                    shared = outputs if constant else None
                # The slice's inputs stay until every call ran it (a cut found later reruns it).
                kept = [
                    name
                    for name in part.outputs
                    if name in keep_sets[index]
                    or (index, name) in referenced
                    or self.graph.last_reader.get(name, -1) > number
                ]
                call.update({name: outputs[name] for name in kept})
                reached[index] = part.stop
                del outputs, inputs
                if large or clean:  # recorded; the calls after this one reduce them otherwise
                    break
            sessions.clear()
            if not self.keep_sessions:
                release_memory(collect=False)  # the slice's weights and arena go now
            if found or large or clean:  # reduced below the sentinel (found: this call runs again)
                if clean:
                    self.graph.unmask(clean)
                if found or large:
                    self.graph.reduce_masked(found or large)
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
        for name, source in self.same.items():
            self.ranges[name] = max(self.ranges[name], self.ranges[source])
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
        key = (
            part.start,
            part.stop,
            tuple(part.exposed),
            tuple(part.masked),
            *(a.dtype.str for a in inputs.values()),
        )
        session = self._sessions.get(key) or sessions.get(key)
        if session is None:
            model = self.graph.slice_model(part, inputs)
            # No arena of its own: a kept session would hold its peak activations between calls.
            # The shared one gives them back after each run (numerics/arena.py).
            replaced = self.initializers(part.initializers) if self.initializers else None
            session = session_for(
                model, self.model_dir, self.threads, replaced, in_graph_order=True, shared_arena=True
            )
            self.sessions_built += 1
            (self._sessions if self.keep_sessions else sessions)[key] = session
        names = [o.name for o in session.get_outputs()]
        start = time.perf_counter()
        try:
            results = dict(zip(names, session.run(names, inputs, self._run_options)))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise SliceRunError(index, exc) from exc
        self.call_seconds[index] += time.perf_counter() - start
        return results

    def _record(
        self, part: GraphSlice, outputs: Mapping[str, np.ndarray]
    ) -> tuple[list[str], list[str], list[str]]:
        """Raise the ranges of ``part``'s reduced values; (found, large, clean).

        ``found``: values holding a sentinel or NaN that were not reduced below it; nothing is
        recorded then, and the slice runs again for this call. ``large`` and ``clean``: values
        reduced below the sentinel in the graph whose float32 copy reaches :data:`LARGE_VALUE`
        bytes (the graph's reduction holds two temporaries as large as the value), holding
        sentinels (later calls reduce them on the host) or not (later calls reduce them as plain
        values). Their peaks are right and recorded.
        """
        peaks, found, large, clean = {}, [], [], []
        for name in part.recorded:
            top = max(float(outputs[name + _MAX]), -float(outputs[name + _MIN]))
            if not top < MASK_SENTINEL or np.isnan(outputs[name + _SUM]):
                found.append(name)
            peaks[name] = max(top, 0.0)
        for name in part.masked:
            if int(outputs[name + _SIZE]) * 4 >= LARGE_VALUE:
                (clean if int(outputs[name + _CLEAN]) else large).append(name)
            peaks[name] = max(float(outputs[name + _PEAK]), 0.0) if int(outputs[name + _SIZE]) else 0.0
        if found:
            return found, [], []
        for name, peak in peaks.items():
            self.ranges[name] = max(self.ranges[name], peak)
        return [], large, clean


def record_ranges(
    recorder: SlicedRecorder,
    feeds: Iterable[Mapping[str, np.ndarray]],
    on_slice: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Run ``recorder`` on every feed, in one pass over its slices; its ranges."""
    recorder.run_many(list(feeds), on_slice)
    return recorder.ranges
