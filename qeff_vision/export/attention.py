"""Grouped-query attention for the exported language decoder: no ``repeat_kv`` copy of the cache.

transformers' eager attention (every family we export: ``eager_attention_forward`` in
``modeling_llama``, ``modeling_qwen2_5_vl``, ``modeling_gemma3``, ``modeling_mllama``, ...) first
expands the keys and values of its ``kv_heads`` to all ``heads`` (``repeat_kv``: an Expand and a
Reshape in the graph), so every call writes ``heads / kv_heads`` copies of the whole cache it
attends to before the two matmuls. For a decode call that read is the cache up to the compute
context length for every row of the batch: the copy grows with batch x context, and on
onnxruntime it was, with the cache read itself, the largest per-row cost of a batched decode call
(benchmarks/batched_decode.py).

:func:`grouped_attention` computes the same attention with the query heads folded onto their key
head instead: queries [B, H, S, D] -> [B, KV, G * S, D] (query head ``h`` uses key head
``h // G``, G = H / KV, as ``repeat_kv`` orders them), one matmul per key head against the
un-copied keys, the scores viewed back as [B, H, S, K] for the mask, softcap and softmax, and the
same fold for the values. Every dot product is the one the eager path computes; only which of
them share a matmul call changes.

It is registered with transformers' ``AttentionInterface`` under :data:`NAME` and selected on the
text model's config only (:func:`use_grouped_attention`), so vision towers keep their own path.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.export import blocked_attention

NAME = "qeff_vision_grouped"


def grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention without materializing the repeated key/value heads.

    Args:
        module: The attention module (inference only: ``dropout`` must be unused).
        query: [B, H, S, D].
        key: [B, KV, K, D], H a multiple of KV.
        value: [B, KV, K, D].
        attention_mask: Additive mask broadcastable to [B, H, S, K], or None.
        scaling: Score scale (``head_dim ** -0.5`` when None, as Gemma 3's eager path defaults).
        dropout: Attention dropout; must be 0 (export runs in eval mode).
        softcap: Gemma-style logit soft-capping ``tanh(x / c) * c``, or None.
        **kwargs: What the family passes for other implementations (sliding_window, position_ids,
            ...): the mask already encodes them.

    Returns:
        (attention output [B, S, H, D], attention weights [B, H, S, K]; None when the keys are
        attended in blocks, see :mod:`qeff_vision.export.blocked_attention`).
    """
    if module.training and dropout:
        raise ValueError("grouped attention is for inference export; dropout must be 0")
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if scaling is None:
        scaling = dim**-0.5
    folded = query.reshape(batch, kv_heads, groups * seq, dim)
    blocks = blocked_attention.active().language_count(heads)
    if blocks > 1:  # the scores [B, H, S, K] in key blocks (export/blocked_attention.py)

        def scores_of(start, stop):
            scores = torch.matmul(folded, key[:, :, start:stop].transpose(2, 3)) * scaling
            scores = scores.reshape(batch, heads, seq, -1)
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if attention_mask is not None:
                scores = scores + blocked_attention.key_rows(attention_mask, start, stop)
            return scores.float().reshape(batch, kv_heads, groups * seq, -1)

        output = blocked_attention.key_blocked_attention(folded, key, value, scores_of, blocks)
        output = output.to(query.dtype).reshape(batch, heads, seq, dim).transpose(1, 2).contiguous()
        return output, None
    scores = torch.matmul(folded, key.transpose(2, 3)) * scaling
    scores = scores.reshape(batch, heads, seq, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights.reshape(batch, kv_heads, groups * seq, -1), value)
    output = output.reshape(batch, heads, seq, dim).transpose(1, 2).contiguous()
    return output, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, grouped_attention)
    # Masks the text model would build itself (ours are passed prepared, 4-D) take the eager form.
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


def use_grouped_attention(text_model: nn.Module) -> None:
    """Make ``text_model`` (and every attention layer sharing its config) use :func:`grouped_attention`."""
    _register()
    text_model.config._attn_implementation = NAME
