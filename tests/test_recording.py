"""Calibration recorded slice by slice (numerics/recording.py): the same peaks, memory bounded by a slice.

The reference is the definition: the whole graph in one session with every float node output
exposed, each output's largest magnitude below the mask sentinel taken in numpy. The sliced
recorder must give exactly those peaks, hence the same precision plan, on every family's tiny
default (the calibration prompt through the runtime, the feeds it made captured), on the scaled
Gemma 3 whose plan is not empty, and with slices small enough to cut every layer.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_vision import symbols
from qeff_vision.compile.calibration import RecordingProgram, prompt_ranges
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.graph_file import load_graph
from qeff_vision.numerics.device import float_outputs, session_for, value_types
from qeff_vision.numerics.plan import angle_chains, auto_plan
from qeff_vision.numerics.recording import MASK_SENTINEL, SlicedRecorder, record_ranges
from tests.test_device_precision import scaled  # noqa: F401 - the fixture, shared

FAMILIES = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE]
SEQ_LEN = 96


def exposed_ranges(path, feeds) -> dict[str, float]:
    """Peaks by definition: one session, every float node output a graph output, numpy reductions."""
    model = load_graph(path)
    names = float_outputs(model)
    del model.graph.value_info[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    session = session_for(model, path.parent)
    ranges = dict.fromkeys(names, 0.0)
    for feed in feeds:
        for name, value in zip(names, session.run(names, dict(feed))):
            magnitudes = np.abs(value.astype(np.float32)).reshape(-1)
            kept = magnitudes[magnitudes < MASK_SENTINEL]
            ranges[name] = max(ranges[name], float(kept.max()) if kept.size else 0.0)
    return ranges


def _calibrate(export, monkeypatch, parts=None):
    """(ranges, feeds) of the calibration prompts per program, as compile runs them.

    ``parts``: slices of 1 / ``parts`` of each graph's initializer bytes instead of the default.
    """
    captured: dict[str, list] = {}
    execute = RecordingProgram._execute

    def recording(self, feeds, bound):
        captured.setdefault(self.path.parent.name, []).append(dict(feeds))
        return execute(self, feeds, bound)

    monkeypatch.setattr(RecordingProgram, "_execute", recording)
    if parts is not None:
        init = RecordingProgram.__init__

        def sliced(self, path, specs=None, deferred=False):
            weights = sum(data.stat().st_size for data in path.parent.glob("*.onnx.data"))
            init(self, path, specs, slice_bytes=weights // parts, deferred=deferred)

        monkeypatch.setattr(RecordingProgram, "__init__", sliced)
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: SEQ_LEN,
        symbols.VISION_SIZE: SEQ_LEN,
        symbols.CTX_LEN: 512,
    }
    ranges = prompt_ranges(export, None, [bucket, {**bucket, symbols.SEQ_LEN: 1}], [(100, 150)])
    return ranges, captured


def _check(export, ranges, captured):
    """Each program's plan apart from its rotary angle chains (kept whatever the ranges)."""
    plans = {}
    for program in ("vision", "lang"):
        path = export / program / "model.onnx"
        # Deferred calls' cache inputs are the previous calls' outputs, computed by now.
        feeds = [{name: np.asarray(value) for name, value in feed.items()} for feed in captured[program]]
        expected = exposed_ranges(path, feeds)
        # The same kernels on the same values; a fusion across a cut may move the last bit.
        assert ranges[program] == pytest.approx(expected, rel=1e-6, abs=0), program
        model = onnx.load(str(path), load_external_data=False)
        plan = auto_plan(model, ranges[program])
        assert plan == auto_plan(model, expected)
        angles = angle_chains(model)
        plans[program] = [name for name in plan if name not in angles]
    return plans


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_records_the_peaks_of_the_whole_graph(family, exported, monkeypatch):
    export = exported(family)
    ranges, captured = _calibrate(export, monkeypatch)
    assert _check(export, ranges, captured) == {"vision": [], "lang": []}  # tiny: nothing near fp16's range


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_small_slices_cut_every_layer_and_record_the_same_peaks(family, exported, monkeypatch):
    """Slices of an eighth of the weights: every session released after its run (Qwen3.5's Gated
    DeltaNet Scan included), the same peaks."""
    export = exported(family)
    ranges, captured = _calibrate(export, monkeypatch, parts=8)
    _check(export, ranges, captured)
    path = export / "lang" / "model.onnx"
    model = load_graph(path)
    budget = (path.parent / "model.onnx.data").stat().st_size // 8
    recorder = SlicedRecorder(
        model, path.parent, float_outputs(model), value_types(model), slice_bytes=budget
    )
    assert len(recorder.slices) >= 8 and not recorder.keep_sessions


def test_a_plan_that_keeps_nodes_is_unchanged(scaled, monkeypatch):  # noqa: F811 - the fixture
    """The scaled Gemma 3 overflows fp16: sliced or whole, the calibration keeps the same nodes."""
    _, export, _, _ = scaled
    ranges, captured = _calibrate(export, monkeypatch, parts=8)
    plans = _check(export, ranges, captured)
    assert "/text_model/layers.0/post_feedforward_layernorm/CustomRMSNorm_output_0" in plans["lang"]


def _layers(depth: int, width: int = 64):
    """x -> depth x (MatMul by a weight, Add a mask of float32's minimum on one column) -> y."""
    rng = np.random.default_rng(depth)
    nodes, weights = [], []
    mask = np.zeros((1, width), np.float32)
    mask[0, -1] = np.finfo(np.float32).min
    weights.append(numpy_helper.from_array(mask, "mask"))
    value = "x"
    for layer in range(depth):
        weights.append(
            numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{layer}")
        )
        nodes.append(helper.make_node("MatMul", [value, f"w{layer}"], [f"h{layer}"]))
        nodes.append(helper.make_node("Add", [f"h{layer}", "mask"], [f"masked{layer}"]))
        nodes.append(helper.make_node("Softmax", [f"masked{layer}"], [f"p{layer}"], axis=-1))
        value = f"p{layer}"
    graph = helper.make_graph(
        nodes,
        "layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
        [helper.make_tensor_value_info(value, TensorProto.FLOAT, [2, width])],
        initializer=weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def saved_recorder(model: onnx.ModelProto, path, wanted, slice_bytes: int) -> SlicedRecorder:
    """A recorder of every float output of ``model``, saved at ``path`` with its weights outside."""
    path.parent.mkdir()
    onnx.save_model(model, str(path), save_as_external_data=True, size_threshold=1024)
    model = load_graph(path)
    types = value_types(model)
    recorded = float_outputs(model, types)
    return SlicedRecorder(model, path.parent, recorded, types, wanted, slice_bytes=slice_bytes)


@pytest.mark.parametrize("on_host", [False, True], ids=["in-graph", "host"])
def test_slice_weights_do_not_grow_with_depth(tmp_path, monkeypatch, on_host):
    """Twice the layers, the same largest slice; masked sums reduced without the sentinel.

    In the graph (no cut: one slice per two weights), or, for values of LARGE_VALUE bytes and more
    (every value here when it is 1 byte), on the host with a cut after each.
    """
    from qeff_vision.numerics import recording

    if on_host:
        monkeypatch.setattr(recording, "LARGE_VALUE", 1)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)}
    largest = {}
    for depth in (4, 8):
        path = tmp_path / f"d{depth}" / "model.onnx"
        recorder = saved_recorder(_layers(depth), path, [f"p{depth - 1}"], 2 * 64 * 64 * 4)
        ranges = record_ranges(recorder, [feed, feed])
        assert ranges == exposed_ranges(path, [feed])
        assert all(ranges[f"masked{layer}"] < MASK_SENTINEL for layer in range(depth))
        reduced = recorder.graph.exposed if on_host else recorder.graph.masked
        assert sorted(reduced) == sorted(f"masked{layer}" for layer in range(depth))
        assert not (recorder.graph.masked if on_host else recorder.graph.exposed)
        sizes = [
            sum(recorder.graph.weight_bytes[name] for name in part.initializers) for part in recorder.slices
        ]
        largest[depth] = max(sizes)
        assert len(recorder.slices) >= (depth if on_host else depth // 2) and not recorder.keep_sessions
        if not on_host:  # the weights' cuts only
            assert [part.start for part in recorder.slices] == recorder.graph._weight_cuts(2 * 64 * 64 * 4)
    assert largest[8] == largest[4] <= 2 * 64 * 64 * 4 + 64 * 4


def test_a_slice_of_weights_alone_runs_once_for_every_call(tmp_path, monkeypatch):
    """A tied head's Transpose of a weight reads nothing from the calls: one run per pass, not a copy
    per call (at full depth each copy was 1.24 GB), and the calls' results and peaks unchanged."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    embedding = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "embedding")
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["embedding"], ["head"], perm=[1, 0]),
            helper.make_node("Relu", ["x"], ["h"]),
            helper.make_node("MatMul", ["h", "head"], ["logits"]),
        ],
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 64])],
        [embedding],
    )
    path = tmp_path / "tied" / "model.onnx"
    path.parent.mkdir()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, size_threshold=1024)
    model = load_graph(path)
    types = value_types(model)
    feeds = [{"x": rng.standard_normal((n, 32)).astype(np.float32)} for n in (1, 3, 5)]

    def recorder():
        return SlicedRecorder(
            model, path.parent, float_outputs(model, types), types, ["logits"], slice_bytes=1
        )

    one_by_one = recorder()
    expected = [one_by_one.run(feed)["logits"] for feed in feeds]
    runs = []
    original = SlicedRecorder._run_slice

    def counted(self, part, values, sessions, index=0):
        runs.append((part.start, index))
        return original(self, part, values, sessions, index)

    monkeypatch.setattr(SlicedRecorder, "_run_slice", counted)
    one_pass = recorder()
    results = one_pass.run_many(feeds)
    constant = [part.start for part in one_pass.slices if not part.inputs]
    assert constant, [(p.start, p.stop, p.inputs) for p in one_pass.slices]
    assert [index for start, index in runs if start in constant] == [0] * len(constant)
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got["logits"], want)
    assert one_pass.ranges == one_by_one.ranges


def test_a_rearranged_value_takes_its_inputs_peak_without_a_reduction(tmp_path):
    """Reshape, Transpose, Neg and a same-type Cast hold their input's magnitudes: not reduced in a
    slice, their peaks copied, equal to the definition's (sentinels left out as for their input)."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal((8, 12)).astype(np.float32), "w")
    lowest = np.zeros((1, 12), np.float32)
    lowest[0, 3] = np.finfo(np.float32).min
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Constant", [], ["mask"], value=numpy_helper.from_array(lowest)),
        helper.make_node("Add", ["h", "mask"], ["scores"]),
        helper.make_node("Cast", ["scores"], ["same"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([-1, 3, 4]))),
        helper.make_node("Reshape", ["same", "shape"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["swapped"], perm=[1, 0, 2]),
        helper.make_node("Neg", ["h"], ["negated"]),
        helper.make_node("Softmax", ["swapped"], ["p"], axis=-1),
        helper.make_node("Relu", ["negated"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rearranged",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [
            helper.make_tensor_value_info("p", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        ],
        [weight],
    )
    path = tmp_path / "rearranged" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    model = load_graph(path)
    types = value_types(model)
    recorder = SlicedRecorder(model, path.parent, float_outputs(model, types), types, ["p", "y"])
    assert recorder.same == {"same": "scores", "heads": "scores", "swapped": "scores", "negated": "h"}
    assert not set(recorder.same) & {name for part in recorder.slices for name in part.recorded + part.masked}
    feeds = [{"x": rng.standard_normal((rows, 8)).astype(np.float32)} for rows in (2, 5)]
    ranges = record_ranges(recorder, feeds)
    assert ranges == exposed_ranges(path, feeds)
    assert ranges["swapped"] == ranges["scores"] < MASK_SENTINEL and ranges["negated"] == ranges["h"] > 0
