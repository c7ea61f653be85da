"""The onnxruntime body of ``CtxGatherCB`` reads exactly what the continuous-batching cache read means.

The compiler maps the function by name; onnxruntime runs its body. The body branches (fast on
onnxruntime): a leading run 0..K-1 on every row of consecutive slots s..s+B-1 (a decode call's
every slot, a prefill chunk's one) is one Slice, anything else one Gather over the cache viewed as
rows. It must give the same tensor as the former GatherND body and as numpy's
``cache[batch_index[b], h, indices[b, k]]`` for every in-range input: any ``full_batch_size``,
slots in any order (or repeated, or consecutive from any slot), indices repeated, out of order, or
the last position (where padding rows write), read lengths shorter or longer than the cache, and a
leading run on some rows only.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qeff_vision.export import kv_ops

OPSET = 17


def _session(graph_nodes: list, functions: list | None = None) -> ort.InferenceSession:
    inputs = [
        helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["F", "H", "C", "D"]),
        helper.make_tensor_value_info("batch_index", TensorProto.INT64, ["B", 1]),
        helper.make_tensor_value_info("indices", TensorProto.INT64, ["B", "K"]),
    ]
    output = [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", "H", "K", "D"])]
    model = helper.make_model(
        helper.make_graph(graph_nodes, "gather", inputs, output),
        opset_imports=[helper.make_opsetid("", OPSET)],
        functions=functions or [],
    )
    model = kv_ops.attach_functions(model)
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _gather_cb_session() -> ort.InferenceSession:
    node = helper.make_node(
        kv_ops.GATHER_CB, ["cache", "batch_index", "indices"], ["output"], domain=kv_ops.DOMAIN
    )
    return _session([node])


def _gather_nd_session() -> ort.InferenceSession:
    """The former body, inlined: (slot, head, position) triples into GatherND."""
    nodes = [
        *kv_ops._slot_indices("batch_index", "cache", "indices", "nd_indices"),
        helper.make_node("GatherND", ["cache", "nd_indices"], ["output"]),
    ]
    return _session(nodes)


def _reference(cache: np.ndarray, batch_index: np.ndarray, indices: np.ndarray) -> np.ndarray:
    heads = np.arange(cache.shape[1]).reshape(1, -1, 1)
    return cache[batch_index.reshape(-1, 1, 1), heads, indices[:, None, :]]


def test_gather_cb_body_matches_gather_nd_and_numpy_on_random_inputs():
    fast, former = _gather_cb_session(), _gather_nd_session()
    rng = np.random.default_rng(0)
    leading_runs = in_order = runs_from_a_slot = 0
    for case in range(400):
        slots, heads, ctx, width = (int(rng.integers(1, n)) for n in (9, 4, 33, 6))
        rows = int(rng.integers(1, slots + 1))
        distinct = case % 3 != 0  # a call's rows name distinct slots; repeated slots are read too
        batch_index = (rng.permutation(slots)[:rows] if distinct else rng.integers(0, slots, rows)).reshape(
            rows, 1
        )
        length = int(rng.integers(1, ctx + 4))  # a CCL read, a ring read, or repeats
        if case % 4 == 0:  # what the decoder feeds: arange(read_len) on every row
            indices = np.broadcast_to(np.arange(length) % ctx, (rows, length))
            leading_runs += length <= ctx
            if case % 8 == 0:  # a decode call at full_batch_size: every slot, in order
                rows, batch_index = slots, np.arange(slots).reshape(slots, 1)
                indices = np.broadcast_to(np.arange(length) % ctx, (rows, length))
                in_order += length <= ctx
            elif case % 16 == 4:  # every slot, out of order
                rows, batch_index = slots, np.arange(slots)[::-1].reshape(slots, 1)
                indices = np.broadcast_to(np.arange(length) % ctx, (rows, length))
            elif case % 16 == 12:  # consecutive slots from any slot (a prefill chunk: one of them)
                start = int(rng.integers(0, slots - rows + 1))
                batch_index = np.arange(start, start + rows).reshape(rows, 1)
                runs_from_a_slot += length <= ctx and start > 0
        elif case % 4 == 1 and length <= ctx:  # a leading run on every row but the last
            indices = np.broadcast_to(np.arange(length), (rows, length)).copy()
            indices[-1] = rng.integers(0, ctx, length)
        else:  # anything in range, the last position (padding writes) included
            indices = rng.integers(0, ctx, (rows, length))
            indices[:, -1] = ctx - 1
        feeds = {
            "cache": rng.standard_normal((slots, heads, ctx, width)).astype(np.float32),
            "batch_index": batch_index.astype(np.int64),
            "indices": np.ascontiguousarray(indices, dtype=np.int64),
        }
        expected = _reference(feeds["cache"], feeds["batch_index"], feeds["indices"])
        got = fast.run(None, feeds)[0]
        assert got.shape == expected.shape == (rows, heads, length, width)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(got, former.run(None, feeds)[0])
    # both branches ran: full decode calls and slot runs from a later slot among the leading runs
    assert leading_runs > 60 and in_order > 25 and runs_from_a_slot >= 8


def test_gather_body_matches_numpy_on_random_inputs():
    """The single-sequence ``CtxGather`` branches the same way: a leading run is a Slice."""
    inputs = [
        helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["B", "H", "C", "D"]),
        helper.make_tensor_value_info("indices", TensorProto.INT64, ["B", "K"]),
    ]
    output = [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", "H", "K", "D"])]
    node = helper.make_node(kv_ops.GATHER, ["cache", "indices"], ["output"], domain=kv_ops.DOMAIN)
    model = kv_ops.attach_functions(
        helper.make_model(
            helper.make_graph([node], "gather", inputs, output),
            opset_imports=[helper.make_opsetid("", OPSET)],
        )
    )
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    leading_runs = 0
    for case in range(200):
        rows, heads, ctx, width = (int(rng.integers(1, n)) for n in (5, 4, 33, 6))
        length = int(rng.integers(1, ctx + 1))
        if case % 2 == 0:
            indices = np.broadcast_to(np.arange(length), (rows, length)).copy()
            leading_runs += 1
            if case % 4 == 0 and rows > 1:  # one row reads elsewhere: the general branch
                indices[0] = rng.integers(0, ctx, length)
                leading_runs -= 1
        else:
            indices = rng.integers(0, ctx, (rows, length))
        cache = rng.standard_normal((rows, heads, ctx, width)).astype(np.float32)
        got = session.run(None, {"cache": cache, "indices": indices.astype(np.int64)})[0]
        expected = cache[
            np.arange(rows).reshape(-1, 1, 1), np.arange(heads).reshape(1, -1, 1), indices[:, None]
        ]
        np.testing.assert_array_equal(got, expected)
    assert leading_runs > 40


def test_gather_cb_function_keeps_its_name_domain_and_signature():
    function = kv_ops._gather_cb_function(OPSET)
    assert (function.domain, function.name) == ("com.qualcomm.cloud", "CtxGatherCB")
    assert list(function.input) == ["cache", "batch_index", "indices"]
    assert list(function.output) == ["output"]
    assert not function.attribute
    branches = [a.g for node in function.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    assert len(branches) == 2  # leading run of consecutive slots, anything else
    ops, nodes = set(), list(function.node)
    while nodes:  # every op of the body and of its branches, nested ones included
        node = nodes.pop()
        ops.add(node.op_type)
        nodes += [n for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node]
    assert ops <= {
        "Shape",
        "Constant",
        "Gather",
        "Concat",
        "Reshape",
        "Range",
        "Mul",
        "Unsqueeze",
        "Squeeze",
        "Add",
        "Slice",
        "Equal",
        "Cast",
        "ReduceMin",
        "ReduceMax",
        "Sub",
        "GreaterOrEqual",
        "LessOrEqual",
        "And",
        "If",
    }
