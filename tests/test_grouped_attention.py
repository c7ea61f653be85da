"""The exported decoder's attention folds query heads onto their key head instead of repeating K/V.

:func:`~qeff_vision.export.attention.grouped_attention` must compute transformers' eager attention
(``repeat_kv`` then two matmuls) for every head grouping, mask and Gemma's soft-capping; the
exported language graphs must then carry no ``repeat_kv`` expansion, and the parity tests of every
family (tests/test_family_harness.py, tests/test_batched_engine.py) run on those graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import onnx
import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward as gemma3_eager
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

from qeff_vision.export.attention import grouped_attention
from qeff_vision.export.blocked_attention import AttentionBlocking, blocking

SHAPES = [  # heads, kv_heads, query length, key length
    (4, 2, 1, 37),
    (8, 2, 5, 64),
    (4, 4, 3, 9),
    (6, 1, 2, 11),
    (12, 3, 128, 160),
]


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("heads,kv_heads,seq,keys", SHAPES)
def test_grouped_attention_computes_eager_attention(heads, kv_heads, seq, keys, blocks):
    """Whole, and in key blocks with the online softmax (blocks of unequal length when K % 3 != 0)."""
    with blocking(AttentionBlocking(language_blocks=blocks)):
        _check_grouped_attention(heads, kv_heads, seq, keys, blocks)


def _check_grouped_attention(heads, kv_heads, seq, keys, blocks):
    generator = torch.Generator().manual_seed(heads * 100 + keys)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, head_dim=16)
    query = torch.randn(3, heads, seq, 16, generator=generator)
    key = torch.randn(3, kv_heads, keys, 16, generator=generator)
    value = torch.randn(3, kv_heads, keys, 16, generator=generator)
    visible = torch.rand(3, 1, seq, keys, generator=generator) > 0.3
    visible[..., 0] = True  # every query sees something
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)

    expected, expected_weights = llama_eager(module, query, key, value, mask, 0.25)
    got, weights = grouped_attention(module, query, key, value, mask, 0.25)
    assert got.shape == expected.shape == (3, seq, heads, 16)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    if blocks == 1:
        torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-6)
    else:
        assert weights is None  # never whole

    expected, _ = gemma3_eager(module, query, key, value, mask, scaling=None, softcap=5.0)
    got, _ = grouped_attention(module, query, key, value, mask, None, softcap=5.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_grouped_attention_refuses_training_dropout():
    module = SimpleNamespace(training=True)
    query, key = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="dropout"):
        grouped_attention(module, query, key, key, None, 1.0, dropout=0.1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_exported_language_graph_has_no_repeated_kv_heads(exported, family):
    graph = onnx.load(str(exported(family) / "lang" / "model.onnx"), load_external_data=False).graph
    attention = [node for node in graph.node if "/self_attn/" in node.name]
    assert sum(node.op_type == "MatMul" for node in attention) >= 4  # q/k/v/o and the scores
    # repeat_kv: an Expand of the [B, KV, 1, K, D] states to [B, KV, G, K, D], reshaped to H heads
    # (window layers' ring indices are expanded too, into a GatherElements).
    reshapes = {name for node in attention if node.op_type == "Reshape" for name in node.input}
    assert not [n.name for n in attention if n.op_type == "Expand" and n.output[0] in reshapes]
