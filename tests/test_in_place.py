"""Retained state written in place on onnxruntime: only where the graph reads it first, same results.

:func:`qeff_vision.runtime.in_place.aliasable` lets an output share its input's buffer only when a
``ScatterND`` (directly, or ending a local function such as ``CtxScatterCB``) produces it from that
input and every other reader runs before it; :class:`~qeff_vision.runtime.in_place.BoundRunner`
then gives the same outputs as ``session.run`` call after call, and earlier results stay intact.
The engine tests (tests/test_batched_engine.py) run every family's continuous-batching export
this way against transformers.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qeff_vision.export import kv_ops
from qeff_vision.runtime.in_place import BoundRunner, aliasable

RETAINED = {"cache": "cache_RetainedState"}


def _model(path, nodes, extra_outputs=()):
    inputs = [
        helper.make_tensor_value_info("cache", TensorProto.FLOAT, [3, 2, 5, 4]),
        helper.make_tensor_value_info("batch_index", TensorProto.INT64, [2, 1]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [2, 1]),
        helper.make_tensor_value_info("updates", TensorProto.FLOAT, [2, 2, 1, 4]),
    ]
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
        for name in ("cache_RetainedState", *extra_outputs)
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    onnx.save(kv_ops.attach_functions(model), path)
    return path


def _scatter_cb(data="cache", updates="updates", out="cache_RetainedState"):
    return helper.make_node(
        kv_ops.SCATTER_CB, [data, "batch_index", "positions", updates], [out], domain=kv_ops.DOMAIN
    )


def _read(out):
    """A reader of the input cache (CtxGatherCB of every position of the call's slots)."""
    return [
        helper.make_node(
            "Constant",
            [],
            ["all"],
            value=helper.make_tensor("all", TensorProto.INT64, [2, 5], [0, 1, 2, 3, 4] * 2),
        ),
        helper.make_node(kv_ops.GATHER_CB, ["cache", "batch_index", "all"], [out], domain=kv_ops.DOMAIN),
    ]


def test_a_scatter_that_reads_its_input_first_is_written_in_place(tmp_path):
    # The only reader of the cache is the scatter itself (through CtxScatterCB's body).
    assert aliasable(_model(tmp_path / "a.onnx", [_scatter_cb()]), RETAINED) == {"cache"}
    # A read feeding the scatter's updates runs before it (a ring read, updated, written back).
    nodes = [
        *_read("old"),
        helper.make_node("ReduceMean", ["old"], ["mean"], axes=[2], keepdims=1),
        helper.make_node("Add", ["mean", "updates"], ["fresh"]),
        _scatter_cb(updates="fresh"),
    ]
    assert aliasable(_model(tmp_path / "b.onnx", nodes), RETAINED) == {"cache"}
    # Only its shape is read elsewhere.
    nodes = [_scatter_cb(), helper.make_node("Shape", ["cache"], ["shape"])]
    assert aliasable(_model(tmp_path / "c.onnx", nodes), RETAINED) == {"cache"}


def test_a_reader_after_the_scatter_or_another_writer_keeps_the_copy(tmp_path):
    # A read not ordered before the scatter could see the new rows: no aliasing.
    nodes = [_scatter_cb(), *_read("seen")]
    assert aliasable(_model(tmp_path / "a.onnx", nodes, ["seen"]), RETAINED) == set()
    # The output is not a scatter into the input.
    nodes = [helper.make_node("Identity", ["cache"], ["cache_RetainedState"])]
    assert aliasable(_model(tmp_path / "b.onnx", nodes), RETAINED) == set()
    nodes = [
        helper.make_node("Identity", ["cache"], ["copy"]),
        _scatter_cb(data="copy"),
    ]
    assert aliasable(_model(tmp_path / "c.onnx", nodes), RETAINED) == set()


def test_bound_runs_match_session_run_and_keep_earlier_results(tmp_path):
    # A read of the cache feeds the rows written back (as a window ring's read-update-write).
    nodes = [
        *_read("old"),
        helper.make_node("ReduceMean", ["old"], ["mean"], axes=[2], keepdims=1),
        helper.make_node("Add", ["mean", "updates"], ["fresh"]),
        _scatter_cb(updates="fresh"),
    ]
    path = _model(tmp_path / "m.onnx", nodes, ["old"])
    assert aliasable(path, RETAINED) == {"cache"}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    runner = BoundRunner(session, names)
    rng = np.random.default_rng(0)
    state = {"cache": rng.standard_normal((3, 2, 5, 4)).astype(np.float32)}
    expected_cache = state["cache"].copy()
    earlier = []
    for _ in range(6):
        feeds = {
            "batch_index": rng.permutation(3)[:2].reshape(2, 1).astype(np.int64),
            "positions": rng.integers(0, 5, (2, 1)).astype(np.int64),
            "updates": rng.standard_normal((2, 2, 1, 4)).astype(np.float32),
        }
        expected = dict(zip(names, session.run(names, {**feeds, "cache": expected_cache})))
        buffer = state["cache"]
        got = runner.run(feeds, state, RETAINED, aliasable(path, RETAINED))
        assert got["cache_RetainedState"] is buffer, "written into the input's own array"
        np.testing.assert_array_equal(buffer, expected["cache_RetainedState"])
        np.testing.assert_array_equal(got["old"], expected["old"])
        earlier.append((got["old"], expected["old"]))
        expected_cache = expected["cache_RetainedState"]
    for got, expected in earlier:  # later calls did not reuse an earlier result's buffer
        np.testing.assert_array_equal(got, expected)
