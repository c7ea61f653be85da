"""Published quantized checkpoints kept quantized in the graph: the format readers meet the writer.

A tiny checkpoint written in each published format (tests/quantized_fixtures.py, compressed-tensors
fixtures by that library) is exported twice: dequantized to float32 initializers, and with
``keep_quantized`` (the readers' ``WeightPlan.stored`` forms written as ``DequantizeLinear``
inputs). Both graphs run the same prompt on onnxruntime at fp32: greedy tokens identical, logits
equal to float rounding; the kept graph holds quantized initializers where the format has a
one-axis block form (GPTQ act-order has none and stays dequantized) and its weights on disk are
below the float32 graph's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision.exporter import export_model
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers
from tests.quantized_fixtures import write_quantized

EXPERTS = r"\.experts\.\d+\."
CASES = [
    ("qwen2_5_vl", "ct-int4", None, True),
    ("qwen2_5_vl", "awq", None, True),
    ("qwen2_5_vl", "gptq-act-order", None, False),
    ("qwen3_vl", "fp8-block", None, True),
    ("qwen3_vl", "ct-fp8-channel", None, True),
    ("qwen3_vl_moe", "fp8-block", None, True),
    ("kimi_k25", "ct-int4", EXPERTS, True),
]

# The default tier: one integer and one FP8 format (the slow tier every case).
DEFAULT_CASES = {("qwen2_5_vl", "ct-int4"), ("qwen3_vl", "fp8-block")}


def _dequantize_nodes(path) -> int:
    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(node.op_type == "DequantizeLinear" for node in graph.node)


def _data_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*.onnx.data"))


def _run(export, inputs, length):
    bucket = PrefillBucket(length + 3, length + 3)
    generator = generator_for_export(export, LanguageShape((bucket,), bucket.vision_size, length + 64))
    return generator.generate(helpers.as_numpy(inputs), max_new_tokens=6, keep_logits=True)


@pytest.mark.parametrize(
    ("family", "fmt", "only", "kept"),
    helpers.tiered(CASES, DEFAULT_CASES, key=lambda case: case[:2]),
    ids=[f"{c[0]}-{c[1]}" for c in CASES],
)
def test_kept_quantized_graph_runs_like_the_dequantized_one(
    family, fmt, only, kept, tiny_checkpoint, tmp_path
):
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(tiny_checkpoint(family), quantized, fmt, reference, only)
    plain, stored = tmp_path / "plain", tmp_path / "stored"
    export_model(quantized, plain, progress=None)
    export_model(quantized, stored, progress=None, keep_quantized=True)

    assert (_dequantize_nodes(stored / "lang" / "model.onnx") > 0) is kept
    if kept:
        assert _data_bytes(stored) < _data_bytes(plain)

    processor = helpers.load_hf(reference)[1]
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    length = inputs["input_ids"].shape[1]
    ours, theirs = _run(stored, inputs, length), _run(plain, inputs, length)
    assert ours.tokens == theirs.tokens
    worst = max(np.abs(a - b).max() for a, b in zip(ours.logits, theirs.logits))
    span = max(np.ptp(b) for b in theirs.logits)
    assert worst <= 1e-5 * max(span, 1.0)
