"""Published quantized formats export and run token-identical to transformers on the dequantized weights.

For every family whose published checkpoints use a format (Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 FP8
block-wise releases, Llama-4-Maverick's per-channel FP8, Kimi-K2.5's int4 routed experts,
Qwen2.5-VL-7B-Instruct-AWQ, GPTQ releases of Qwen2.5-VL), the family's tiny checkpoint is
written in that format (tests/quantized_fixtures.py), exported by streaming the quantized
tensors, and run on onnxruntime at fp32; transformers' ``generate`` runs the same checkpoint
dequantized by the format's own reference (transformers' FP8 dequantization, the
compressed-tensors library, AutoAWQ's / AutoGPTQ's formula). Greedy tokens must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision.export.weights import Checkpoint
from qeff_vision.exporter import export_model
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers
from tests.quantized_fixtures import write_quantized

EXPERTS = r"\.experts\.\d+\."  # Kimi-K2.5 quantizes its routed experts only
CASES = [
    ("qwen3_vl", "fp8-block", None),
    ("qwen3_vl_moe", "fp8-block", None),  # stacked experts, swapped on load
    ("qwen3_5", "fp8-block", None),
    ("qwen3_5_moe", "fp8-block", None),  # per-expert tensors stacked on load
    ("llama4", "fp8-channel", None),  # Maverick's fbgemm_fp8, stacked experts included
    ("kimi_k25", "ct-int4", EXPERTS),
    ("qwen3_vl", "ct-fp8-tensor", None),
    ("qwen3_vl", "ct-fp8-channel", None),
    ("qwen2_5_vl", "ct-int4", None),
    ("qwen2_5_vl", "awq", None),
    ("qwen2_5_vl", "gptq", None),
    ("qwen2_5_vl", "gptq-act-order", None),
    ("qwen2_5_vl", "gptq8", None),
    ("molmo2", "gptq", None),  # fused att_proj / ff_proj cut after dequantization
]
# The default tier runs one case per format family (the slow tier every case).
DEFAULT_CASES = {
    ("qwen3_vl", "fp8-block"),
    ("llama4", "fp8-channel"),
    ("kimi_k25", "ct-int4"),
    ("qwen3_vl", "ct-fp8-channel"),
    ("qwen2_5_vl", "awq"),
    ("qwen2_5_vl", "gptq-act-order"),
}
LOGIT_TOLERANCE = 1e-3


@pytest.mark.parametrize(
    ("family", "fmt", "only"),
    helpers.tiered(CASES, DEFAULT_CASES, key=lambda case: case[:2]),
    ids=[f"{c[0]}-{c[1]}" for c in CASES],
)
def test_quantized_checkpoint_generates_like_transformers(family, fmt, only, tiny_checkpoint, tmp_path):
    """One image, prefill in one chunk, 8 greedy decode steps: tokens identical, logits close."""
    quantized, reference = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(tiny_checkpoint(family), quantized, fmt, reference, only)
    stored = Checkpoint(quantized).quantized
    assert len(stored) >= 4, sorted(stored)  # every layer's linears (Kimi: every expert's)
    out = tmp_path / "export"
    export_model(quantized, out, progress=None)

    model, processor = helpers.load_hf(reference)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=9)
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    generator = generator_for_export(out, LanguageShape((bucket,), bucket.vision_size, length + 64))
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=9, keep_logits=True)
    assert result.tokens == hf_tokens
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, hf_logits))
    assert worst <= LOGIT_TOLERANCE
