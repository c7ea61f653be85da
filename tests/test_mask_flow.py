"""Mask sentinels known before the run (numerics/mask_flow.py) and the runs a found one costs.

A value holding a mask's sentinel is reduced below it. Predicted from the graph's constants, it is
reduced so from the first call and no slice runs twice; found at run time (a float mask given as an
input), only the call that showed it runs its slice again, not the calls before it. The peaks are
those of the whole graph with every value exposed, whichever way they were taken.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_vision.numerics.mask_flow import mask_carriers
from qeff_vision.numerics.recording import MASK_SENTINEL, SlicedRecorder, record_ranges
from qeff_vision.numerics.slicing import _reads
from tests.test_recording import exposed_ranges, saved_recorder

WIDTH = 64
LOWEST = float(np.finfo(np.float32).min)


def _graph(depth: int, mask: str) -> onnx.ModelProto:
    """x -> depth x (MatMul, masked scores, Softmax); the mask a ``constant``, a ``fill`` or an ``input``.

    ``where``: the scores keep their value where the boolean input ``keep`` says so, else the
    sentinel (the mask built in the graph, as an exported ``masked_fill`` is).
    """
    rng = np.random.default_rng(depth)
    nodes, weights = [], []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])]
    if mask == "constant":
        column = np.zeros((1, WIDTH), np.float32)
        column[0, -1] = LOWEST
        nodes.append(helper.make_node("Constant", [], ["mask"], value=numpy_helper.from_array(column)))
    elif mask == "fill":
        shape = numpy_helper.from_array(np.array([1, WIDTH], np.int64))
        nodes.append(helper.make_node("Constant", [], ["shape"], value=shape))
        fill = numpy_helper.from_array(np.array([LOWEST], np.float32))
        nodes.append(helper.make_node("ConstantOfShape", ["shape"], ["mask"], value=fill))
    elif mask == "where":
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, ["n", WIDTH]))
        nodes.append(helper.make_node("Constant", [], ["lowest"], value_float=LOWEST))
    else:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, WIDTH]))
    value = "x"
    for layer in range(depth):
        weights.append(
            numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), f"w{layer}")
        )
        nodes.append(helper.make_node("MatMul", [value, f"w{layer}"], [f"h{layer}"]))
        if mask == "where":
            nodes.append(helper.make_node("Where", ["keep", f"h{layer}", "lowest"], [f"masked{layer}"]))
        else:
            nodes.append(helper.make_node("Add", [f"h{layer}", "mask"], [f"masked{layer}"]))
        nodes.append(helper.make_node("Softmax", [f"masked{layer}"], [f"p{layer}"], axis=-1))
        value = f"p{layer}"
    graph = helper.make_graph(
        nodes,
        "layers",
        inputs,
        [helper.make_tensor_value_info(value, TensorProto.FLOAT, ["n", WIDTH])],
        initializer=weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _recorder(tmp_path, depth: int, mask: str):
    path = tmp_path / mask / "model.onnx"
    return saved_recorder(_graph(depth, mask), path, [f"p{depth - 1}"], 2 * WIDTH * WIDTH * 4), path


def _runs(monkeypatch) -> Counter:
    """(slice start, call) -> onnxruntime runs, counted from here on."""
    runs: Counter = Counter()
    original = SlicedRecorder._run_slice

    def counted(self, part, values, sessions, index=0):
        runs[(part.start, index)] += 1
        return original(self, part, values, sessions, index)

    monkeypatch.setattr(SlicedRecorder, "_run_slice", counted)
    return runs


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)


def test_values_computed_from_a_sentinel_constant_are_carriers_up_to_the_softmax():
    for mask in ("constant", "fill", "where"):
        model = _graph(3, mask)
        carriers = mask_carriers(model, [_reads(node) for node in model.graph.node], MASK_SENTINEL)
        assert {f"masked{layer}" for layer in range(3)} <= carriers, mask
        assert not {f"h{layer}" for layer in range(3)} & carriers, mask  # before the mask
        assert not {f"p{layer}" for layer in range(3)} & carriers, mask  # a softmax is bounded
    model = _graph(3, "input")  # a float mask given as an input: only a run can tell
    assert not mask_carriers(model, [_reads(node) for node in model.graph.node], MASK_SENTINEL)


def test_a_predicted_mask_runs_every_slice_once_per_call(tmp_path, monkeypatch):
    for mask in ("constant", "fill"):
        recorder, path = _recorder(tmp_path, 4, mask)
        layers = {f"masked{layer}" for layer in range(4)}
        # A ConstantOfShape's fill is computed, and recorded, in the run.
        assert recorder.graph.masked == (layers | {"mask"} if mask == "fill" else layers)
        feeds = [{"x": _x(rows, rows)} for rows in (1, 3, 2)]
        runs = _runs(monkeypatch)
        ranges = record_ranges(recorder, feeds)
        assert set(runs.values()) == {1}, runs
        assert len(runs) == len(recorder.slices) * len(feeds)
        assert ranges == exposed_ranges(path, feeds)
        assert all(ranges[f"masked{layer}"] < MASK_SENTINEL for layer in range(4))


def test_a_sentinel_found_in_a_run_reruns_only_the_call_that_shows_it(tmp_path, monkeypatch):
    """Calls 0 and 1 have no sentinel in their mask input, call 2 has: call 2 alone runs twice."""
    recorder, path = _recorder(tmp_path, 4, "input")
    assert not recorder.graph.masked
    clear, masked = np.zeros((1, WIDTH), np.float32), np.zeros((1, WIDTH), np.float32)
    masked[0, ::3] = LOWEST
    feeds = [{"x": _x(2, 0), "mask": clear}, {"x": _x(5, 1), "mask": clear}, {"x": _x(3, 2), "mask": masked}]
    runs = _runs(monkeypatch)
    ranges = record_ranges(recorder, feeds)
    assert ranges == exposed_ranges(path, feeds)
    assert sorted(recorder.graph.masked) == [f"masked{layer}" for layer in range(4)]
    assert {count for (_, call), count in runs.items() if call < 2} == {1}, runs
    # Each slice with a masked value runs twice for call 2 (found, then reduced below the sentinel).
    assert sorted(count for (_, call), count in runs.items() if call == 2) == [2] * len(recorder.slices)


def test_a_large_predicted_mask_goes_back_to_plain_reductions_until_a_call_shows_a_sentinel(
    tmp_path, monkeypatch
):
    """From LARGE_VALUE bytes on (every value here): a call without sentinels unmasks the value;
    the call that shows one is reduced below it, and the calls after it reduce it on the host."""
    from qeff_vision.numerics import recording

    monkeypatch.setattr(recording, "LARGE_VALUE", 1)
    recorder, path = _recorder(tmp_path, 2, "where")
    assert sorted(recorder.graph.masked) == ["masked0", "masked1"]
    everything = np.ones((2, WIDTH), bool)
    some = everything.copy()
    some[:, 5] = False
    feeds = [
        {"x": _x(2, 0), "keep": everything},
        {"x": _x(2, 1), "keep": some},
        {"x": _x(2, 2), "keep": some},
        {"x": _x(2, 3), "keep": everything},
    ]
    runs = _runs(monkeypatch)
    ranges = record_ranges(recorder, feeds)
    assert ranges == exposed_ranges(path, feeds)
    assert all(ranges[name] < MASK_SENTINEL for name in ("masked0", "masked1"))
    assert sorted(recorder.graph.exposed) == ["masked0", "masked1"] and not recorder.graph.masked
    # Call 0: the one slice, values reduced below the sentinel in the graph, then unmasked.
    assert [key for key in runs if key[1] == 0] == [(0, 0)] and runs[(0, 0)] == 1
    # Call 1 showed the sentinels to the plain reductions: it ran the slice again with them reduced
    # below it in the graph, and that run's peaks stand (no third run after the host cuts).
    assert [key for key in runs if key[1] == 1] == [(0, 1)] and runs[(0, 1)] == 2
    # The calls after it run the slices cut for the host's reductions, each once.
    assert len(recorder.slices) > 1
    for call in (2, 3):
        assert {key: count for key, count in runs.items() if key[1] == call} == {
            (part.start, call): 1 for part in recorder.slices
        }
