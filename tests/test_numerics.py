"""The fp16 device emulation and precision plans on small hand-built graphs (no checkpoint).

Graph: x -> Mul(x, 300) -> Mul(., 300) -> Div(., 1e4) -> y. With |x| = 1 the middle value is
90,000, beyond fp16's 65,504: at device precision it is inf unless the plan keeps it in fp32.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_vision.errors import UserError
from qeff_vision.numerics.device import FP16_MAX, MxEmulation, device_graph, device_session, session_for
from qeff_vision.numerics.mx import FP6_E2M3, FP6_E3M2, INT8, mx_round, mxint8_nodes
from qeff_vision.numerics.plan import (
    PLAN_KEY,
    auto_plan,
    check_plan_names,
    first_overflow,
    non_matmul_outputs,
    read_plan,
    value_ranges,
    write_plan,
)

FEED = {"x": np.array([[1.0, -1.0, 0.5]], dtype=np.float32)}


def _graph() -> onnx.ModelProto:
    scale = numpy_helper.from_array(np.array(300.0, dtype=np.float32), "scale")
    shrink = numpy_helper.from_array(np.array(1e4, dtype=np.float32), "shrink")
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["first"], name="first_mul"),
        helper.make_node("Mul", ["first", "scale"], ["big"], name="big_mul"),
        helper.make_node("Div", ["big", "shrink"], ["y"], name="shrink_div"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[scale, shrink],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, tmp_path):
    return session_for(model, tmp_path).run(None, FEED)[0]


def test_device_graph_keeps_io_types_and_overflows_without_a_plan(tmp_path):
    device = device_graph(_graph())
    assert device.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert device.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    result = _run(device, tmp_path)
    assert result.dtype == np.float32 and not np.isfinite(result[0, :2]).any()
    assert np.isclose(result[0, 2], 4.5, rtol=1e-3)  # 0.5 * 9e4 = 45,000 stays in range


def test_plan_keeps_the_overflowing_value_and_its_reader_in_fp32(tmp_path):
    model = _graph()
    ranges = value_ranges(model, tmp_path, [FEED])
    assert ranges["big"] == pytest.approx(9e4)
    plan = auto_plan(model, ranges)
    # "big" overflows; "shrink_div" reads it, so its output stays fp32 too; "first" (300) is safe.
    assert plan == ["big", "y"]
    assert len(plan) < non_matmul_outputs(model) + 1
    result = _run(device_graph(model, plan), tmp_path)
    assert np.allclose(result, FEED["x"] * 9.0, rtol=1e-3)
    overflow = first_overflow(model, ranges)
    assert (overflow.node, overflow.output) == ("big_mul", "big")
    assert "big_mul" in overflow.describe("lang") and f"{FP16_MAX:.0f}" in overflow.describe("lang")
    assert first_overflow(model, ranges, plan) is None


def test_mask_sentinels_are_not_overflow(tmp_path):
    """float32's minimum (attention masks) saturates harmlessly; it must not enter the plan."""
    nodes = [
        helper.make_node("Constant", [], ["minimum"], value_float=float(np.finfo(np.float32).min)),
        helper.make_node("Add", ["x", "minimum"], ["masked"], name="mask_add"),
        helper.make_node("Softmax", ["masked"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert auto_plan(model, value_ranges(model, tmp_path, [FEED])) == []
    assert np.isfinite(_run(device_graph(model), tmp_path)).all()


def test_plan_file_is_the_compilers_format(tmp_path):
    path = tmp_path / "node_precision.yaml"
    write_plan(path, ["/a/Add_output_0", "/b/CustomRMSNorm_output_0"])
    assert path.read_text().splitlines()[:3] == [f"{PLAN_KEY}:", "", "  - /a/Add_output_0"]
    assert read_plan(path) == ["/a/Add_output_0", "/b/CustomRMSNorm_output_0"]
    (tmp_path / "bad.yaml").write_text("- just a list\n")
    with pytest.raises(UserError, match=PLAN_KEY):
        read_plan(tmp_path / "bad.yaml")
    with pytest.raises(UserError, match="not node outputs"):
        check_plan_names(_graph(), ["big", "missing"], "plan.yaml")


def test_mx_rounding_follows_the_ocp_rules():
    """One block of 8: the shared scale is 2^(floor(log2 100) - emax); elements round half to even."""
    block = np.array([[0.0, 1.0, 7.5, 25.0, 0.3, -3.3, 100.0, 1e-3]], dtype=np.float32)
    # FP6 E2M3: emax 2 -> scale 16; 1/16 is half the smallest subnormal (0.125) -> 0 (even).
    assert mx_round(block, FP6_E2M3, block=8).tolist() == [[0, 0, 8, 24, 0, -4, 96, 0]]
    # FP6 E3M2: emax 4 -> scale 4; 0.3/4 -> 0.0625 step grid -> 0.25 after scaling.
    assert mx_round(block, FP6_E3M2, block=8).tolist() == [[0, 1, 8, 24, 0.25, -3.5, 96, 0]]
    # MXINT8: emax 0 -> scale 64; elements are multiples of 2^-6 in [-2, 127/64].
    assert mx_round(block, INT8, block=8).tolist() == [[0, 1, 8, 25, 0, -3, 100, 0]]
    # Saturation: the block maximum never exceeds the element format's largest value times the scale.
    assert mx_round(np.array([[7.9, 0.1]], dtype=np.float32), FP6_E2M3, block=2).tolist() == [[7.5, 0.125]]


def test_mxint8_graph_matches_the_reference(tmp_path):
    """The in-graph MXINT8 rounding of KV outputs equals mx_round along head_dim."""
    keys = (np.random.default_rng(0).standard_normal((1, 2, 5, 16)) * 3).astype(np.float32)
    graph = helper.make_graph(
        mxint8_nodes("k", "y", "q_"),
        "g",
        [helper.make_tensor_value_info("k", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rounded = session_for(model, tmp_path).run(None, {"k": keys})[0]
    assert np.array_equal(rounded, mx_round(keys, INT8))
    assert 0 < np.abs(rounded - keys).max() < 0.05


def test_mxfp6_weights_reach_the_session(tmp_path):
    """MatMul weights are replaced by their MXFP6 rounding (constant folding must not undo it)."""
    weight = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8) + 0.013
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
            initializer=[numpy_helper.from_array(weight, "w")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    x = {"x": np.ones((1, 8), dtype=np.float32)}
    plain = device_session(path).run(None, x)[0]
    mx = device_session(path, mx=MxEmulation("fp6_e2m3")).run(None, x)[0]
    expected = x["x"] @ mx_round(weight, FP6_E2M3, axis=0)
    assert np.allclose(mx, expected, rtol=1e-3) and not np.allclose(plain, mx, rtol=1e-3)


def test_spec_names_missing_plan_files_and_images(tmp_path):
    """`validate` reports a node precision file or calibration image that does not exist."""
    from qeff_vision.errors import SpecError
    from qeff_vision.spec import load_spec
    from tests.compile_fixtures import write_spec

    spec = write_spec(
        tmp_path / "spec.yaml",
        compile_section={
            "language": {"node_precision": "missing.yaml"},
            "calibration": {"images": ["nowhere.png"], "prompts": ["Describe."]},
        },
    )
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    text = str(error.value)
    assert "compile.language.node_precision: no such plan file 'missing.yaml'" in text
    assert "compile.calibration.images: no such image 'nowhere.png'" in text


def test_device_session_hands_onnxruntime_the_rounded_weights_with_the_same_outputs(tmp_path):
    """A weight only fp16 nodes read is given to onnxruntime already rounded (no fp32 original and
    folded copy held side by side at load); one a plan node reads too keeps its fp32 value. The
    outputs are bit-identical to the graph that rounds through Cast pairs (overflow, subnormals
    and ties included)."""
    rng = np.random.default_rng(0)
    shared = rng.normal(size=(8, 8)).astype(np.float32)
    only_fp16 = rng.normal(size=(8, 8)).astype(np.float32)
    only_fp16[0, :4] = [7e4, -7e4, 3e-6, 1.0 + 2.0**-11]  # beyond fp16, subnormal, a tie
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "shared"], ["kept"], name="kept_mm"),
                helper.make_node("MatMul", ["x", "shared"], ["halved"], name="halved_mm"),
                helper.make_node("MatMul", ["x", "only_fp16"], ["third"], name="third_mm"),
                helper.make_node("Concat", ["kept", "halved", "third"], ["y"], axis=0, name="cat"),
            ],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
            initializer=[
                numpy_helper.from_array(shared, "shared"),
                numpy_helper.from_array(only_fp16, "only_fp16"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    plan = ["kept"]
    feed = {"x": rng.normal(size=(1, 8)).astype(np.float32)}
    session = device_session(path, plan)
    given, _ = session.replaced_initializers
    assert set(given) == {"only_fp16"}
    with np.errstate(over="ignore"):
        rounded = only_fp16.astype(np.float16).astype(np.float32)
    assert np.array_equal(given["only_fp16"], rounded, equal_nan=True)
    folded = session_for(device_graph(onnx.load(str(path), load_external_data=False), plan), tmp_path)
    ours, theirs = session.run(None, feed)[0], folded.run(None, feed)[0]
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert not np.isfinite(ours[2]).all() and np.isfinite(ours[:2]).all()


def test_a_session_on_large_weights_runs_without_the_arena(tmp_path, monkeypatch):
    """session_for keeps onnxruntime's CPU arena for a graph whose weights fit ARENA_WEIGHT_BYTES and
    drops it above (weight-sized values stay in an arena at its grown size: Kimi-K2.5's real-width
    fp32 run 8.34 -> 6.06 GB); an explicit ``arena`` wins, and the results are the same."""
    from qeff_vision.numerics import device

    model = _graph()
    small = session_for(model, tmp_path)
    assert small.get_session_options().enable_cpu_mem_arena
    monkeypatch.setattr(device, "ARENA_WEIGHT_BYTES", 4)  # the graph's two float32 scalars are 8 bytes
    large = session_for(model, tmp_path)
    assert not large.get_session_options().enable_cpu_mem_arena
    assert session_for(model, tmp_path, arena=True).get_session_options().enable_cpu_mem_arena
    np.testing.assert_array_equal(small.run(None, FEED)[0], large.run(None, FEED)[0])


def test_moving_fp16_values_adds_no_rounding(tmp_path):
    """A Gather of a rounded weight (read expert slices) is not rounded again: its values are fp16
    values already, and a round trip would copy it twice. A Gather of a value the plan keeps in fp32
    is rounded, as the device computes it in fp16. Results equal rounding everything."""
    weight = numpy_helper.from_array(np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3) / 7, "w")
    ids = numpy_helper.from_array(np.array([2, 0, 3], dtype=np.int64), "ids")
    nodes = [
        helper.make_node("Gather", ["w", "ids"], ["slices"], name="read"),
        helper.make_node("Mul", ["x", "x"], ["kept"], name="kept_mul"),
        helper.make_node("Gather", ["kept", "ids_x"], ["picked"], name="pick", axis=1),
        helper.make_node("MatMul", ["picked", "slices"], ["y"], name="matmul"),
    ]
    ids_x = numpy_helper.from_array(np.array([0, 1, 2], dtype=np.int64), "ids_x")
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[weight, ids, ids_x],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    emulated = device_graph(model, ["kept"])
    cast_inputs = {n.input[0] for n in emulated.graph.node if n.op_type == "Cast"}
    assert "slices__exact" not in cast_inputs and "picked__exact" in cast_inputs
    feed = {"x": np.array([[1.1, -0.3, 0.7]], dtype=np.float32)}
    got = session_for(emulated, tmp_path).run(None, feed)[0]

    def half(array):
        return array.astype(np.float16).astype(np.float32)

    slices = half(numpy_helper.to_array(weight))[[2, 0, 3]]
    picked = half(feed["x"] * feed["x"])  # kept in fp32, then rounded where the fp16 Gather reads it
    np.testing.assert_allclose(got, half(picked @ slices), rtol=1e-3)
