"""The runtime's onnxruntime graph (functions inlined, equal constants shared) computes the same bits.

:func:`qeff_vision.numerics.ort_graph.prepared_for_onnxruntime` only changes how onnxruntime sees
the graph: the index arithmetic each inlined KV call repeats becomes identical nodes, computed
once. Every output of every call must be bit-identical to the exported file loaded as is, on the
calls a real batched run makes (prefill chunks into different slots, decode steps at batch F),
and the repeated arithmetic must actually be merged (fewer nodes after onnxruntime's optimizer).
The parity suites (tests/test_batched_engine.py and the per-family runtime tests) run every family
through these sessions against transformers.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qeff_vision.numerics.device import session_for
from qeff_vision.numerics.ort_graph import prepared_for_onnxruntime, share_constants
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from tests import helpers
from tests.family_runtime import FamilyRuntime


def _session(model_or_path, optimized_path=None, data_dir=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    if data_dir is not None:
        key = "session.model_external_initializers_file_folder_path"
        options.add_session_config_entry(key, str(data_dir))
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _int64(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def test_equal_constants_become_one_initializer_read_by_subgraphs_too():
    branch_nodes = [helper.make_node("Add", ["x", "c2"], ["branch_out"])]  # c2 from the enclosing scope
    untyped = onnx.TypeProto()
    branch = helper.make_graph(branch_nodes, "then", [], [helper.make_value_info("branch_out", untyped)])
    other = helper.make_graph(
        [helper.make_node("Sub", ["x", "c1"], ["other_out"])],
        "else",
        [],
        [helper.make_value_info("other_out", onnx.TypeProto())],
    )
    nodes = [
        _int64("c1", [1, 2, 3]),
        _int64("c2", [1, 2, 3]),  # equal to c1
        _int64("c3", [4, 5, 6]),
        _int64("kept", [1, 2, 3]),  # a graph output: stays a node
        helper.make_node("Add", ["x", "c1"], ["a"]),
        helper.make_node("Add", ["a", "c3"], ["b"]),
        helper.make_node("ReduceMin", ["x"], ["low"], keepdims=0),
        helper.make_node("Greater", ["low", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["chosen"], then_branch=branch, else_branch=other),
        helper.make_node("Add", ["b", "chosen"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, [3]) for n in ("y", "kept")],
        initializer=[onnx.numpy_helper.from_array(np.array(0, np.int64), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    shared = share_constants(onnx.ModelProto.FromString(model.SerializeToString()))
    onnx.checker.check_model(shared)
    constants = [n for n in shared.graph.node if n.op_type == "Constant"]
    assert [n.output[0] for n in constants] == ["kept"]
    assert len(shared.graph.initializer) == 3  # zero, [1, 2, 3] once, [4, 5, 6]
    by_output = {n.output[0]: n for n in shared.graph.node}
    then_branch = next(a.g for a in by_output["chosen"].attribute if a.name == "then_branch")
    assert then_branch.node[0].input[1] == by_output["a"].input[1]  # c2 is c1's initializer
    for x in ([1, 5, 9], [-4, 0, 2]):  # both branches
        feeds = {"x": np.array(x, np.int64)}
        for got, expected in zip(_session(shared).run(None, feeds), _session(model).run(None, feeds)):
            np.testing.assert_array_equal(got, expected)


def test_prepared_language_graph_is_bit_identical_on_a_batched_run_and_smaller(
    hf_model, cb_exported, tmp_path
):
    family = "qwen2_5_vl"
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, cb_exported(family), model, processor)
    calls = []
    run = runtime.language.run_retained

    def recording(feeds, state, retained):
        calls.append(({k: v.copy() for k, v in feeds.items()}, {k: v.copy() for k, v in state.items()}))
        return run(feeds, state, retained)

    runtime.language.run_retained = recording
    requests = [
        EngineRequest(runtime.inputs(("<image>", "Describe."), [helpers.image(64, 64, seed=1)]), 4, 0),
        EngineRequest(runtime.inputs(("A poem about the sea, please.",), []), 4, 0),
        EngineRequest(runtime.inputs(("<image>", "What?"), [helpers.image(96, 64, seed=2)]), 3, 1),
    ]
    BatchedEngine(runtime.generator((32, 128)), full_batch_size=3).run(requests)
    assert {len(next(iter(state.values()))) for _, state in calls} == {3}
    batches = collections.Counter(len(feeds["input_ids"]) for feeds, _ in calls)
    assert batches[1] >= 3 and batches[3] >= 3  # prefill chunks (one slot) and decode steps (all)

    path = runtime.language.path
    native = _session(str(path), tmp_path / "native.onnx")
    prepared = session_for(prepared_for_onnxruntime(path), path.parent, threads=1)
    names = [o.name for o in native.get_outputs()]
    for feeds, state in calls:
        inputs = {**feeds, **state}
        for got, expected in zip(prepared.run(names, inputs), native.run(names, inputs)):
            np.testing.assert_array_equal(got, expected)

    # The KV calls' shared arithmetic is merged: onnxruntime's optimized graph is smaller.
    _session(prepared_for_onnxruntime(path), tmp_path / "prepared.onnx", path.parent)
    sizes = {
        name: len(onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph.node)
        for name in ("native", "prepared")
    }
    assert sizes["prepared"] < 0.9 * sizes["native"], sizes
