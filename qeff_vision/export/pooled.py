"""The pooling language program (spec ``task: embed | score``): one call over a whole prompt, no cache.

It reuses the token-merge decoder's pieces (:mod:`qeff_vision.export.decoder`): the same
``vision_embeds`` merge rule and stacked rows, masks from positions, and the Hugging Face text
model's own layers, called without a cache. Keys are the call's own tokens, so a query at position
p sees the tokens at positions 0..p (within its window or block on ring layers); padding (position
-1) sees nothing and is seen by nothing. The last valid position is pooled
(:mod:`qeff_vision.contract.tasks`): its final hidden state, L2-normalized (``embed``), or the
sigmoid of the difference of its "yes" and "no" logits (``score``; only those two rows of the
output projection are multiplied).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.contract.tasks import EMBED, SCORE, SCORE_TOKENS, is_pooling
from qeff_vision.errors import UserError
from qeff_vision.export.decoder import (
    DecoderParts,
    merge_vision_rows,
    same_image_links,
    text_model_kwargs,
)
from qeff_vision.export.ring_plan import span_overlay

#: Keeps the norm of an all-zero row finite (torch.nn.functional.normalize's default eps).
NORM_EPS = 1e-12


def score_token_ids(model_dir: str | Path) -> tuple[int, int]:
    """Vocabulary ids of ``yes`` and ``no`` in the checkpoint's tokenizer.

    Raises:
        UserError: The tokenizer has no single token for one of them.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = tokenizer.get_vocab()
    missing = [token for token in SCORE_TOKENS if token not in vocab]
    if missing:
        raise UserError(
            f"{model_dir}: the tokenizer has no single token {missing[0]!r}, so no "
            f"sigmoid(logit('yes') - logit('no')) score (task: score needs a reranker checkpoint)"
        )
    return tuple(vocab[token] for token in SCORE_TOKENS)


def checked_task(family, task: str, model_dir: str | Path, stateful: bool) -> tuple[int, int] | None:
    """The score tokens' ids for ``task`` (None unless ``score``), once ``task`` is known to apply.

    Raises:
        UserError: ``family`` does not declare ``task``, a pooling task meets an option that needs a
            cache (``stateful``: continuous batching, CCL, the sampler, full-length ring caches), or
            a ``score`` checkpoint's tokenizer has no ``yes`` / ``no`` token.
    """
    if task not in family.tasks:
        raise UserError(
            f"{family.title} does not declare task {task!r} (it declares {', '.join(family.tasks)})"
        )
    if is_pooling(task) and stateful:
        raise UserError(
            f"task {task} has no KV cache: no continuous batching, CCL, sampler or full-length KV"
        )
    return score_token_ids(model_dir) if task == SCORE else None


def chunk_masks(
    positions: torch.Tensor,
    layer_types: Sequence[str],
    parts: DecoderParts,
    same_image: torch.Tensor | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Additive masks [batch, 1, seq, seq] per layer type, keys being the call's own tokens."""
    query, key = positions.unsqueeze(-1), positions.unsqueeze(-2)
    causal = (key <= query) & (key >= 0) & (query >= 0)
    minimum = torch.finfo(dtype).min
    masks = {}
    for layer_type in set(layer_types):
        allowed = causal
        if same_image is not None and parts.links_images(layer_type):
            allowed = allowed | same_image
        overlay = span_overlay(layer_type, key, query, parts.ring_span(layer_type))
        if overlay is not None:  # the ring kind's window or block (ring_plan.py)
            allowed = allowed & overlay
        masks[layer_type] = torch.where(allowed, 0.0, minimum).to(dtype).unsqueeze(1)
    return masks


class PooledDecoder(nn.Module):
    """Pooling language program over the rows of ``io`` (:func:`~qeff_vision.contract.tasks.pooled_io`)."""

    def __init__(
        self, parts: DecoderParts, io: LanguageIO, task: str, score_ids: tuple[int, int] | None = None
    ):
        super().__init__()
        if task == SCORE and score_ids is None:
            raise ValueError("task score needs the ids of its two tokens")
        self.parts, self.io, self.task = parts, io, task
        self.embed_tokens = parts.embed_tokens
        self.text_model = parts.text_model
        self.lm_head = parts.lm_head
        self.score_ids = score_ids

    def forward(self, *inputs):
        """Pool one whole prompt per row; ``inputs`` are the table's input rows in graph order."""
        parts, io = self.parts, self.io
        named = dict(zip(io.input_names, inputs, strict=True))
        input_ids, position_ids = named[io.name(Role.TOKEN_IDS)], named[io.name(Role.POSITIONS)]
        vision_row, *stacked_rows = io.rows(Role.VISION_ROWS)
        image_idx = named[io.name(Role.VISION_CURSOR)]
        text_positions = position_ids if parts.position_rows is None else position_ids[0]
        inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds, _ = merge_vision_rows(
            input_ids, inputs_embeds, named[vision_row.name], image_idx, parts.placeholder_ids
        )
        same_image = same_image_links(input_ids, parts.image_token_id) if parts.bidirectional_images else None
        masks = chunk_masks(text_positions, parts.layer_types, parts, same_image, inputs_embeds.dtype)
        extra = text_model_kwargs(parts, input_ids, image_idx, named, stacked_rows)
        if not parts.mask_per_layer_type:
            (masks,) = masks.values()
        hidden = self.text_model(
            inputs_embeds=inputs_embeds,
            attention_mask=masks,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=False,
            **extra,
        ).last_hidden_state
        last = text_positions.argmax(dim=1)  # the last valid (largest) position of each row
        pooled = hidden[torch.arange(hidden.shape[0]), last].float()  # [batch, hidden]
        if self.task == EMBED:
            norm = torch.sqrt(torch.clamp((pooled * pooled).sum(dim=-1, keepdim=True), min=NORM_EPS**2))
            return (pooled / norm).to(hidden.dtype)
        rows = self.lm_head.weight[list(self.score_ids)].float()  # [2, hidden]: yes, no
        logits = torch.matmul(pooled, rows.transpose(0, 1))
        return torch.sigmoid(logits[:, :1] - logits[:, 1:]).to(hidden.dtype)
