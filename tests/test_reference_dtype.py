"""``reference.model_in_dtype``: transformers' bf16 reference as ``from_pretrained(dtype=...)`` loads it.

The real-width ai200 case converts the loaded model in place (``copy=False``) so it never holds
transformers' fp32 and bf16 models at once (issue 49: mllama and Llama 4 passed a 10 GB budget).
In place or copied, the bf16 model is the same: float weights in bf16, rotary ``inv_freq`` kept in
fp32 and complex buffers (Llama 4's vision ``freqs_ci``) kept complex, as transformers computes them.
"""

from __future__ import annotations

import pytest
import torch

from qeff_vision.reference import load_reference_model, model_in_dtype

FAMILIES = ("qwen2_5_vl", "llama4")  # rotary inv_freq; complex freqs_ci


@pytest.mark.parametrize("family", FAMILIES)
def test_in_place_conversion_is_the_copy(family, tiny_checkpoint):
    original = load_reference_model(tiny_checkpoint(family))
    copied = model_in_dtype(original, torch.bfloat16)
    assert next(original.parameters()).dtype == torch.float32  # the copy leaves the model alone
    converted = load_reference_model(tiny_checkpoint(family))
    same = model_in_dtype(converted, torch.bfloat16, copy=False)
    assert same is converted
    expected = dict(copied.named_buffers()) | dict(copied.named_parameters())
    found = dict(same.named_buffers()) | dict(same.named_parameters())
    assert expected.keys() == found.keys()
    kept = 0
    for name, value in expected.items():
        assert found[name].dtype == value.dtype, name
        assert torch.equal(found[name], value), name
        if name.endswith("inv_freq") or value.is_complex():
            assert value.dtype in (torch.float32, torch.complex64), (name, value.dtype)
            kept += 1
        elif value.is_floating_point():
            assert value.dtype == torch.bfloat16, name
    assert kept, f"{family}: no rotary buffer to keep"
