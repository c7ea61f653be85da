"""How weights are stored: float16 + Cast, quantized + DequantizeLinear-21, the opset move, the readers.

The quantized stored forms come from the weight_bytes benchmark's double of a quantized checkpoint
(int4 group-32 symmetric, int4 with zero points, fp8 per channel, fp8 128x128 blocks expanded
along the rows), on 2-D and stacked 3-D shapes, odd ones included (a partial last block).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qeff_vision import graph_file
from qeff_vision.export.opset_upgrade import upgrade_opset
from qeff_vision.export.weight_forms import (
    FLOAT16,
    QUANTIZED_OPSET,
    WeightForm,
    float_tensors,
    fp16_changes,
    pack_int4,
    quantized_tensors,
    transposed,
)
from qeff_vision.export.weights import append_tensor
from tests import helpers

bench = helpers.load_benchmark("weight_bytes")
SHAPES = [(64, 96), (40, 160), (3, 48, 64), (130, 256)]


def test_fp16_changes_count_what_fp16_would_change():
    values = torch.tensor([1.0, 0.5, 70000.0, -1e5, 3e-8, 2.0**-16 + 2.0**-30, 1.0 + 2.0**-20, float("inf")])
    changes = fp16_changes("w", values)
    assert (changes.beyond_range, changes.below_normal, changes.extra_bits) == (2, 2, 1)
    assert changes.kept_float32
    # A bf16 weight in fp16's normal range is exact; below it only rounding (written fp16, reported).
    bf16 = (torch.randn(4096) * 0.02).to(torch.bfloat16).to(torch.float32)
    normal = torch.where(bf16.abs() < 2.0**-14, torch.zeros_like(bf16), bf16)
    assert fp16_changes("w", normal) is None
    tiny = fp16_changes("w", torch.cat([normal, torch.tensor([2.0**-26, -(2.0**-20 + 2.0**-26)])]))
    assert (tiny.beyond_range, tiny.below_normal, tiny.extra_bits) == (0, 2, 0) and not tiny.kept_float32


def test_float16_form_casts_where_fp16_keeps_the_values_and_keeps_the_rest_float32():
    exact = torch.tensor([[1.0, -0.25], [3.0, 2.0**-10]])
    stored = float_tensors("w", exact, WeightForm(FLOAT16))
    (tensor, payload), node = stored.tensors[0], stored.node
    assert tensor.name == "w_fp16" and tensor.data_type == TensorProto.FLOAT16 and payload.nbytes == 8
    assert (node.op_type, list(node.input), list(node.output)) == ("Cast", ["w_fp16"], ["w"])
    overflow = float_tensors("w", exact * 2.0**16, WeightForm(FLOAT16))  # 65,536 and 196,608 overflow
    assert overflow.node is None and overflow.tensors[0][0].data_type == TensorProto.FLOAT
    assert (overflow.fp16.beyond_range, overflow.fp16.extra_bits) == (2, 0)
    plain = float_tensors("w", exact, WeightForm())
    assert plain.node is None and plain.tensors[0][0].name == "w" and plain.fp16 is None


@pytest.mark.parametrize("count", [1, 2, 7, 64])
@pytest.mark.parametrize("signed", [True, False])
def test_int4_packing_round_trips(count, signed):
    rng = np.random.default_rng(count)
    values = (
        rng.integers(-8, 8, count).astype(np.int8) if signed else rng.integers(0, 16, count).astype(np.uint8)
    )
    packed = pack_int4(values)
    assert packed.size == (count + 1) // 2
    assert np.array_equal(graph_file.unpack_int4(packed, count, signed), values)


def _graph_of(stored, path, shape):
    """A one-node graph computing the stored weight (external data as export writes it)."""
    with open(path.with_suffix(".data"), "wb") as data:
        for tensor, payload in stored.tensors:
            append_tensor(data, tensor, payload, path.with_suffix(".data").name)
    output = helper.make_tensor_value_info("w", TensorProto.FLOAT, list(shape))
    graph = helper.make_graph([stored.node], "g", [], [output], initializer=[t for t, _ in stored.tensors])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", QUANTIZED_OPSET)], ir_version=10)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    return graph_file.load_graph(path)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scheme", bench.SCHEMES)
def test_dequantize_linear_computes_the_checkpoint_values(scheme, shape, tmp_path):
    """DequantizeLinear-21 (onnxruntime) and graph_file's reader give QuantizedWeight.dequantize exactly."""
    torch.manual_seed(0)
    weight = bench.quantize(torch.randn(shape) * 0.05, scheme)
    expected = weight.dequantize(torch.float32).numpy()
    model = _graph_of(quantized_tensors("w", weight, torch.float32), tmp_path / "q.onnx", shape)
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    assert np.array_equal(session.run(None, {})[0], expected)
    assert np.array_equal(graph_file.weight_values(model, "w", tmp_path), expected)
    stored = sum(graph_file.tensor_bytes(t) for t in model.graph.initializer)
    assert stored <= 1.25 * bench.stored_bytes(shape, scheme) + 4 * np.prod(shape[:-1])  # expanded scales
    if len(shape) == 2:  # a weight the writer stores transposed (its reader was a Transpose)
        flipped = _graph_of(
            quantized_tensors("w", transposed(weight), torch.float32), tmp_path / "t.onnx", shape[::-1]
        )
        assert np.array_equal(graph_file.weight_values(flipped, "w", tmp_path), expected.T)


def test_opset_upgrade_moves_reduction_axes_to_inputs_and_keeps_results(tmp_path):
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1),
        helper.make_node("ReduceMax", ["x"], ["n"], axes=[0, 1], keepdims=0),
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
    ]
    axes = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, d)
            for n, d in (("m", [3, 1]), ("n", []), ("s", [3, 1]))
        ],
        initializer=[axes],
    )
    function = helper.make_function(
        "custom",
        "F",
        ["a"],
        ["b"],
        [helper.make_node("ReduceMin", ["a"], ["b"], axes=[1])],
        [helper.make_opsetid("", 17)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)]
    )
    model.functions.append(function)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    upgrade_opset(model, QUANTIZED_OPSET)
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}[""] == QUANTIZED_OPSET
    assert model.functions[0].opset_import[0].version == QUANTIZED_OPSET and len(model.functions[0].node) == 2
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
