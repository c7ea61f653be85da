"""A graph cut into slices of bounded weights, each runnable as a model of its own.

:class:`SlicedGraph` is what :class:`~qeff_vision.numerics.recording.SlicedRecorder` runs: the
graph's nodes, in their (topological) order, cut where a slice's initializers would pass
``slice_bytes``, after values reduced on the host, and after the last reader of a large input
(see :mod:`qeff_vision.numerics.recording` for why). Each slice knows the values it takes from
earlier slices and hands to later ones. Calls run in one pass may hand each other values
(:class:`Ref`); :meth:`SlicedGraph.chained_prefix` says which can, and keeps later cuts from
separating such a hand-over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from qeff_vision.graph_file import tensor_bytes
from qeff_vision.numerics.mask_flow import mask_carriers
from qeff_vision.numerics.same_values import is_same_type_cast

# Inputs from here on make their slice end after their last reader (attention-sized values).
LARGE_VALUE = 64 * 2**20
_MAX, _MIN, _SUM = "__rec_max", "__rec_min", "__rec_sum"
# A mask-carrying value's peak below the sentinel, and its element count, reduced in the graph.
_PEAK, _SIZE = "__rec_peak", "__rec_size"
# 1 when every element of such a value is below the sentinel (no sentinel, no NaN in this call).
_CLEAN = "__rec_clean"
# Magnitudes from here on are attention-mask sentinels (float32's minimum), not activations.
MASK_SENTINEL = 1e30
# Element types onnxruntime's Python API cannot return or take as numpy arrays ("No corresponding
# Numpy type for Tensor Type. bfloat16"): a value of one never crosses a cut (SlicedGraph._allowed).
NO_NUMPY_TYPES = frozenset(
    {
        TensorProto.BFLOAT16,
        TensorProto.FLOAT8E4M3FN,
        TensorProto.FLOAT8E4M3FNUZ,
        TensorProto.FLOAT8E5M2,
        TensorProto.FLOAT8E5M2FNUZ,
    }
)


@dataclass(frozen=True)
class Ref:
    """Output ``name`` of call ``call`` of the same :meth:`SlicedRecorder.run_many` pass, as an input."""

    call: int
    name: str
    shape: tuple[int, ...] | None = None  # known for a retained state: a slice that only reads
    dtype: object = None  # its shape (Shape nodes) runs on a placeholder before it is produced


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
    masked: list[str] = ()  # recorded values holding mask sentinels, reduced in the graph below them


class SlicedGraph:
    """The slices of one graph (structure only: initializers' data stays on disk)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        recorded: Sequence[str],
        types: Mapping[str, int],
        wanted: Sequence[str],
        slice_bytes: int = 512 * 2**20,
    ):
        self.model = model
        graph = model.graph
        self.nodes = list(graph.node)
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
        self.reads = [_reads(node) for node in self.nodes]
        # Values that may hold a mask's sentinel are reduced below it from the start: found at run
        # time instead, each would cost its slice a second run (numerics/mask_flow.py).
        self.masked: set[str] = mask_carriers(model, self.reads, MASK_SENTINEL) & set(self.recorded)
        self.producer = {name: index for index, node in enumerate(self.nodes) for name in node.output if name}
        self.weight_bytes = {name: tensor_bytes(tensor) for name, tensor in self.initializers.items()}
        self.readers: dict[str, list[int]] = {}  # value -> indices of the nodes reading it
        for index, reads in enumerate(self.reads):
            for name in reads:
                self.readers.setdefault(name, []).append(index)
        self.held_until = self._held_until()
        self.protected: list[tuple[int, int]] = []  # node ranges no cut may split (chained calls)
        self.cuts = sorted({0, *self._allowed(self._weight_cuts(slice_bytes))})
        inputs = {value.name for value in graph.input}
        # Outputs that are an input passed through (mllama's cross-attention states): a later call
        # reading one reads the earlier call's input, not something it computes.
        self.passthrough = {
            node.output[0]: node.input[0]
            for node in self.nodes
            if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.input[0] in inputs
        }
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

    def reduce_masked(self, names: Iterable[str]) -> None:
        """Reduce ``names`` (they hold mask sentinels or NaN) below the sentinel from now on.

        A value first gets its masked peak in the graph (no cut: the slice's session stays whole);
        one already reduced so whose float32 copy reaches :data:`LARGE_VALUE` bytes goes to the host
        (:meth:`cut_after`), since the graph's reduction holds two temporaries as large as the value.
        """
        large = [name for name in names if name in self.masked]
        self.masked.update(name for name in names if name not in self.masked)
        self.masked.difference_update(large)
        if large:
            self.cut_after(large)
        else:
            self.slices = self._slices()

    def unmask(self, names: Iterable[str]) -> None:
        """Reduce ``names`` with the three plain reductions again (a call showed them without sentinels).

        For a predicted mask carrier (:mod:`~qeff_vision.numerics.mask_flow`) too large for the
        graph's masked reduction: a sentinel a later call shows is found then, as for any value.
        """
        self.masked.difference_update(names)
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

    def _held_until(self) -> list[int]:
        """Per node index ``c``: where a cut at ``c`` moves so no :data:`NO_NUMPY_TYPES` value crosses it.

        Such a value (the bf16 half of the device emulation's rounding pair, ``x -> bf16 -> x``)
        cannot be a slice's output or input, so a cut between its producer and its last reader
        moves past that reader (index ``c`` itself when nothing spans it).
        """
        held = list(range(len(self.nodes) + 1))
        for name, index in self.producer.items():
            if self.types.get(name) in NO_NUMPY_TYPES and self.readers.get(name):
                last = max(self.readers[name])
                for cut in range(index + 1, last + 1):
                    held[cut] = max(held[cut], last + 1)
        return held

    def _allowed(self, cuts: Iterable[int]) -> list[int]:
        """``cuts`` moved past every value numpy cannot hold, less those past the last node.

        A cut inside a protected hand-over (see chained_prefix) is left out too.
        """
        allowed = []
        for cut in cuts:
            while cut < len(self.held_until) and self.held_until[cut] > cut:
                cut = self.held_until[cut]
            if cut < len(self.nodes) and not any(first < cut <= last for first, last in self.protected):
                allowed.append(cut)
        return allowed

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
                    recorded=[
                        name
                        for name in produced
                        if name in recorded and name not in self.exposed and name not in self.masked
                    ],
                    exposed=[name for name in produced if name in self.exposed],
                    masked=[name for name in produced if name in self.masked and name not in self.exposed],
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
        if not is_same_type_cast(node, self.types):
            return node
        return helper.make_node("Identity", list(node.input), list(node.output), name=node.name)

    def slice_model(self, part: GraphSlice, inputs: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The slice as a model for ``inputs`` (types and shapes).

        Its nodes, the initializers they read, and three reductions per recorded value.
        """
        outputs = [onnx.ValueInfoProto(name=name) for name in part.outputs]
        recorded, masked = set(part.recorded), set(part.masked)
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
            for name in (o for o in node.output if o in masked):
                made, produced = _masked_peak(name, self.types.get(name))
                nodes += made
                outputs += produced
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


def _masked_peak(name: str, element_type: int | None) -> tuple[list, list]:
    """Nodes giving ``name``'s largest magnitude below :data:`MASK_SENTINEL`, its size, and whether all are.

    NaN is left out of the peak and makes the value not all below the sentinel.

    max(Where(|x| < sentinel, |x|, 0)) is the host's ``masked_peak`` in float32: NaN compares
    false, so it and the sentinels count as 0, as do the magnitudes the host leaves out.
    """
    source, nodes = name, []
    if element_type != TensorProto.FLOAT:
        source = f"{name}__rec_float"
        nodes.append(helper.make_node("Cast", [name], [source], to=TensorProto.FLOAT))
    magnitude, below = f"{name}__rec_abs", f"{name}__rec_below"
    bound, zero, kept = f"{name}__rec_bound", f"{name}__rec_zero", f"{name}__rec_kept"
    nodes += [
        helper.make_node("Constant", [], [bound], value_float=MASK_SENTINEL),
        helper.make_node("Constant", [], [zero], value_float=0.0),
        helper.make_node("Abs", [source], [magnitude]),
        helper.make_node("Less", [magnitude, bound], [below]),
        helper.make_node("Where", [below, magnitude, zero], [kept]),
        helper.make_node("ReduceMax", [kept], [name + _PEAK], keepdims=0),
        helper.make_node("Size", [name], [name + _SIZE]),
        helper.make_node("Cast", [below], [f"{name}__rec_below8"], to=TensorProto.UINT8),
        helper.make_node("ReduceMin", [f"{name}__rec_below8"], [name + _CLEAN], keepdims=0),
    ]
    outputs = [
        helper.make_tensor_value_info(name + _PEAK, TensorProto.FLOAT, []),
        helper.make_tensor_value_info(name + _SIZE, TensorProto.INT64, []),
        helper.make_tensor_value_info(name + _CLEAN, TensorProto.UINT8, []),
    ]
    return nodes, outputs
