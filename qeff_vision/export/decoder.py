"""Family-agnostic language decoder wrapper: the language program of the IO contract.

It reuses the Hugging Face text model's own layers and replaces only what export needs:
  * each layer's state is retained-state tensors driven by its kind's export-time object
    (:mod:`qeff_vision.export.state_caches`); a KV cache is updated with ``CtxScatter`` at the
    token positions and read with ``CtxGather`` (see :mod:`qeff_vision.export.kv_ops`);
  * the attention mask is built from positions, so padding tokens (position -1) attend to nothing;
    they write back the value already at their index, where no other token of the call writes
    (:mod:`qeff_vision.export.kv_writes`), so they change nothing whatever their ``batch_index``;
  * image rows are merged by the rule of the IO contract: the t-th placeholder of the chunk takes
    row ``image_idx + t`` of the flattened ``vision_embeds``; ``image_idx_output`` adds the chunk's
    placeholder count, so it never goes backwards;
  * logits come from the last valid position only;
  * attention runs transformers' eager computation with query heads folded onto their key head
    (:mod:`qeff_vision.export.attention`, set by the exporter): no ``repeat_kv`` copy of the cache.

With continuous batching (the table's ``batch_index`` row, role ``KV_SLOT``) the caches hold
``full_batch_size`` slots on dim 0 and ``batch_index`` [batch, 1] names the slot of each row:
full-context layers write and read through ``CtxScatterCB`` / ``CtxGatherCB``, window rings read
their rows out of the slot and write back the ring slots the chunk changes, so each row sees only
its own sequence
(docs/design.md, "Continuous batching protocol").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from qeff_vision.contract.language_io import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SLOT_ROLES,
    LanguageIO,
    Role,
)
from qeff_vision.contract.states import kind_for_layer_type
from qeff_vision.export.kv_writes import write_plan
from qeff_vision.export.ring_plan import RingPlan, overlay_span, ring_mask, span_overlay
from qeff_vision.export.state_caches import ChunkWrites, RetainedKVCache, layer_objects

__all__ = [
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "DecoderParts",
    "LanguageDecoder",
    "RetainedKVCache",
    "RingPlan",
]


@dataclass
class DecoderParts:
    """What a family hands the generic decoder.

    Attributes:
        embed_tokens: Token embedding module (including any family scaling).
        text_model: The HF text model; called with ``inputs_embeds``, a per-layer-type mask dict,
            ``position_ids`` and a cache object with ``update``.
        lm_head: Output projection.
        image_token_id: Placeholder token id.
        layer_types: Attention type per layer (``full_attention`` / ``sliding_attention`` /
            ``chunked_attention``).
        sliding_window: Window of sliding layers (keys with position > query - window are seen).
        attention_chunk_size: Block of chunked layers (a key is seen iff in the query's block of
            positions and not later); their ring holds ``min(ctx_len, attention_chunk_size)`` slots.
        position_rows: None for [batch, seq] positions; R for [R, batch, seq] (row 0 = text position).
        bidirectional_images: Placeholders of the same image attend to each other both ways.
        mask_per_layer_type: The text model takes ``{layer_type: mask}`` (models with per-layer-type
            masks, e.g. Qwen2, Gemma 3). False: it takes one 4-D mask, which it passes through
            ``create_causal_mask`` unchanged (e.g. Llama); needs a single layer type.
        stacked_rows: Extra inputs after ``vision_embeds`` (``Family.stacked_vision_rows``), each
            [depth, vision_batch, vision_size, hidden]: name -> depth. Their rows are gathered by
            the same merge rule as ``vision_embeds`` (a chunk's t-th placeholder takes row
            ``image_idx + t``).
        video_token_id: Video placeholder id (families with video): its tokens take rows too.
        stacked_rows_kwargs: Turns (placeholder mask [batch, seq], {name: gathered rows
            [depth, batch, seq, hidden]}) into keyword arguments of the text model.
        bidirectional_layer_types: With ``bidirectional_images``, the layer types whose masks
            link an image's placeholders both ways; None for every type (Gemma 3). Gemma 4's
            ``use_bidirectional_attention == "vision"`` links them on sliding layers only.
        token_kwargs: Turns the chunk's token ids [batch, seq] into keyword arguments of the text
            model computed from the ids themselves (Gemma 4's per-layer embeddings).
    """

    embed_tokens: nn.Module
    text_model: nn.Module
    lm_head: nn.Module
    image_token_id: int
    layer_types: Sequence[str]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    position_rows: int | None = None
    bidirectional_images: bool = False
    mask_per_layer_type: bool = True
    stacked_rows: Mapping[str, int] = field(default_factory=dict)
    stacked_rows_kwargs: Callable | None = None
    video_token_id: int | None = None
    bidirectional_layer_types: tuple[str, ...] | None = None
    token_kwargs: Callable | None = None

    def ring_span(self, layer_type: str) -> int | None:
        """Window or block of a ring layer type; None for a type that keeps the whole context.

        Read by the type's kind (its ``span_attribute`` names the field of these parts).
        """
        return overlay_span(layer_type, self)

    def links_images(self, layer_type: str) -> bool:
        """Whether layers of ``layer_type`` see an image's placeholders both ways."""
        types = self.bidirectional_layer_types
        return self.bidirectional_images and (types is None or layer_type in types)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Ids whose tokens take vision rows in prompt order: images, then video frames if any."""
        return (
            (self.image_token_id,)
            if self.video_token_id is None
            else (self.image_token_id, self.video_token_id)
        )


def layer_inputs(io: LanguageIO, named: Mapping[str, torch.Tensor]) -> dict[int, dict]:
    """Layer -> {role: input tensor} of every layer with state rows of its own, in layer order."""
    layers: dict[int, dict] = {}
    for row in io.rows(*SLOT_ROLES):
        layers.setdefault(row.layer, {})[row.role] = named[row.name]
    return layers


def ring_layers(parts: DecoderParts, io: LanguageIO | None = None) -> list[bool]:
    """Which layers keep a ring (sliding window or attention chunk) instead of the whole context.

    A window or chunked layer type keeps a ring unless ``io`` declares its cache full length
    (``retain_full_kv``): then it is a full-context cache read under the type's mask. A shared
    layer follows the layer whose cache it reads.
    """
    rings = [bool(parts.ring_span(t)) for t in parts.layer_types]
    if io is None or not io.layers:
        return rings
    return [ring and io.source_state(layer).ring for layer, ring in enumerate(rings)]


def ring_type(parts: DecoderParts, io: LanguageIO | None = None) -> str | None:
    """The one layer type whose layers keep a ring (they share one :class:`RingPlan`), or None."""
    types = {t for t, ring in zip(parts.layer_types, ring_layers(parts, io)) if ring}
    if len(types) > 1:
        raise ValueError(f"ring layers of one kind only (one ring plan per chunk), got {sorted(types)}")
    return next(iter(types), None)


def attention_masks(
    positions: torch.Tensor,
    ctx_len: int | torch.Tensor,
    layer_types: Sequence[str],
    sliding_window: int | None,
    same_image: torch.Tensor | None,
    dtype: torch.dtype,
    linked_types: Sequence[str] | None = None,
    attention_chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Additive masks [batch, 1, seq, ctx] per layer type from token positions.

    A query at position p sees slots j <= p (and j > p - window on sliding layers, j in p's block
    of ``attention_chunk_size`` positions on chunked layers: a ring layer kept full length). Padding
    queries (p = -1) see nothing; their rows stay finite (no NaN) because the mask adds the
    dtype's minimum instead of -inf. ``same_image`` [batch, seq, seq] adds bidirectional links
    between placeholders of one image, on the ``linked_types`` only (every type when None).
    """
    slots = torch.arange(ctx_len).view(1, 1, -1)
    query = positions.unsqueeze(-1)
    causal = (slots <= query) & (query >= 0)
    linked_causal = causal
    if same_image is not None:
        # Scatter the chunk-local [seq, seq] links into slot space at the keys' positions.
        key_slots = torch.where(positions >= 0, positions, torch.zeros_like(positions))
        onehot = key_slots.unsqueeze(-1) == slots  # [batch, seq_k, ctx]
        linked = torch.matmul(same_image.to(dtype), onehot.to(dtype)) > 0
        linked_causal = causal | linked
    minimum = torch.finfo(dtype).min
    masks = {}
    spans = {"sliding_window": sliding_window, "attention_chunk_size": attention_chunk_size}
    for layer_type in set(layer_types):
        allowed = linked_causal if linked_types is None or layer_type in linked_types else causal
        # A ring layer kept full length is read under its kind's overlay (ring_plan.py).
        overlay = span_overlay(layer_type, slots, query, overlay_span(layer_type, spans))
        if overlay is not None:
            allowed = allowed & overlay
        masks[layer_type] = torch.where(allowed, 0.0, minimum).to(dtype).unsqueeze(1)
    return masks


def same_image_links(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[batch, seq, seq] True where both tokens are placeholders of the same contiguous image run."""
    is_image = input_ids == image_token_id
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0), value=False)[:, :-1]
    run_id = torch.cumsum(starts.to(torch.int64), dim=1)
    same_run = run_id.unsqueeze(-1) == run_id.unsqueeze(-2)
    return same_run & is_image.unsqueeze(-1) & is_image.unsqueeze(-2)


def vision_row_index(input_ids: torch.Tensor, image_idx: torch.Tensor, image_token_id, rows: int):
    """(placeholder mask, row of the flattened vision rows each token takes) for one chunk.

    Every gather index stays in range (no sentinel): non-placeholders are masked afterwards. A
    decode step (seq_len 1, reserved for decode) merges nothing: a generated placeholder id is an
    ordinary token to transformers, which merges image rows into the prompt only.
    """
    seq_len = torch.ones_like(input_ids).sum(dim=1, keepdim=True)  # a tensor, so tracing keeps it
    ids = (image_token_id,) if isinstance(image_token_id, int) else tuple(image_token_id)
    is_placeholder = input_ids == ids[0]
    for other in ids[1:]:
        is_placeholder = is_placeholder | (input_ids == other)
    is_image = is_placeholder & (seq_len > 1)
    ordinal = torch.cumsum(is_image.to(torch.int64), dim=1) - 1
    return is_image, torch.clamp(ordinal + image_idx.reshape(1, 1), min=0, max=rows - 1)


def merge_vision_rows(
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor,
    vision_embeds: torch.Tensor,
    image_idx: torch.Tensor,
    image_token_id,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace placeholder embeddings with vision rows; return (embeds, image_idx_output)."""
    hidden = inputs_embeds.shape[-1]
    rows = vision_embeds.reshape(-1, hidden)
    is_image, row_index = vision_row_index(input_ids, image_idx, image_token_id, rows.shape[0])
    gathered = rows[row_index]
    merged = torch.where(is_image.unsqueeze(-1), gathered.to(inputs_embeds.dtype), inputs_embeds)
    placeholders = is_image.to(torch.int64).sum(dim=1).max().reshape(1, 1)
    return merged, image_idx.reshape(1, 1) + placeholders


def gather_stacked_rows(
    input_ids: torch.Tensor, stacked: torch.Tensor, image_idx: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """[depth, batch, seq, hidden] rows of a stacked input [depth, vision_batch, vision_size, hidden]."""
    depth, hidden = stacked.shape[0], stacked.shape[-1]
    rows = stacked.reshape(depth, -1, hidden)
    _, row_index = vision_row_index(input_ids, image_idx, image_token_id, rows.shape[1])
    return rows[:, row_index]


def text_model_kwargs(
    parts: DecoderParts,
    input_ids: torch.Tensor,
    image_idx: torch.Tensor,
    named: Mapping[str, torch.Tensor],
    stacked_rows: Sequence,
) -> dict:
    """The text model's family keywords: per-token inputs and the stacked vision rows each chunk gathers."""
    extra = {}
    if parts.token_kwargs is not None:
        extra.update(parts.token_kwargs(input_ids))
    if stacked_rows:
        gathered = {
            row.name: gather_stacked_rows(input_ids, named[row.name], image_idx, parts.placeholder_ids)
            for row in stacked_rows
        }
        is_image, _ = vision_row_index(input_ids, image_idx, parts.placeholder_ids, 1)
        extra.update(parts.stacked_rows_kwargs(is_image, gathered))
    return extra


def _slot_count(io: LanguageIO, named: Mapping[str, torch.Tensor], layers: Sequence[int]) -> int | None:
    """Slots on the position axis of the first of ``layers`` (its state says which axis), or None."""
    for layer in layers:
        state, row = io.layers[layer], io.layer_rows(layer)[0]
        if state.slot_axis is not None:
            return named[row.name].shape[state.slot_axis]
    return None


def _only_mask(masks: dict[str, torch.Tensor]) -> torch.Tensor:
    if len(masks) != 1:
        raise ValueError(f"one 4-D mask needs a single layer type, got {sorted(masks)}")
    return next(iter(masks.values()))


class LanguageDecoder(nn.Module):
    """The language program of the token-merge kind; its inputs and outputs are the rows of ``io``."""

    def __init__(self, parts: DecoderParts, io: LanguageIO):
        super().__init__()
        self.parts = parts
        self.io = io
        self.embed_tokens = parts.embed_tokens
        self.text_model = parts.text_model
        self.lm_head = parts.lm_head

    def forward(self, *inputs):
        """Run one chunk (prefill) or one token (decode); see the module docstring for the contract.

        ``inputs`` are the table's input rows in graph order; returns its output rows in order.
        """
        parts, io = self.parts, self.io
        named = dict(zip(io.input_names, inputs, strict=True))
        input_ids, position_ids = named[io.name(Role.TOKEN_IDS)], named[io.name(Role.POSITIONS)]
        vision_row, *stacked_rows = io.rows(Role.VISION_ROWS)  # vision_embeds first, then stacked
        vision_embeds, image_idx = named[vision_row.name], named[io.name(Role.VISION_CURSOR)]
        past = layer_inputs(io, named)  # only layers with rows: a shared layer has none
        # With CCL, full-context layers read only as many leading slots as ``comp_ctx_lengths`` has
        # elements (QEfficient's mechanism; the host picks a length that covers every position
        # written so far).
        read_len = named[io.name(Role.COMP_CTX_LENGTHS)].shape[0] if io.has(Role.COMP_CTX_LENGTHS) else None
        batch_index = named[io.name(Role.KV_SLOT)] if io.has(Role.KV_SLOT) else None
        text_positions = position_ids if parts.position_rows is None else position_ids[0]
        inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds, image_idx_output = merge_vision_rows(
            input_ids, inputs_embeds, vision_embeds, image_idx, parts.placeholder_ids
        )
        rings = ring_layers(parts, io)  # per decoder layer; the cache is keyed by layer
        # Slots of the full-context layers (a window layer's ring is shorter); 1 when all are windows.
        ctx_len = _slot_count(io, named, [layer for layer in past if not rings[layer]])
        ctx_len = 1 if ctx_len is None else ctx_len  # (no truth test: a traced size is a tensor)
        # Padding (position -1) writes back what its slot holds, where no other token writes.
        slots = next(iter(next(iter(past.values())).values())).shape[0]
        writes = write_plan(text_positions, batch_index, slots)
        write_slots = writes.full_slots(text_positions, ctx_len)
        read_len = ctx_len if read_len is None else read_len
        read_slots = torch.arange(read_len).view(1, -1).expand(input_ids.shape[0], -1)
        same_image = same_image_links(input_ids, parts.image_token_id) if parts.bidirectional_images else None
        full_types = [t for t, is_ring in zip(parts.layer_types, rings) if not is_ring]
        linked = [t for t in set(parts.layer_types) if parts.links_images(t)]
        dtype = inputs_embeds.dtype
        window = parts.sliding_window
        masks = attention_masks(
            text_positions,
            read_len,
            full_types,
            window,
            same_image,
            dtype,
            linked,
            parts.attention_chunk_size,
        )
        plan = None
        ringed = ring_type(parts, io)
        if ringed is not None:
            ring_len = _slot_count(io, named, [layer for layer in past if rings[layer]])
            ring_writes = None if batch_index is None else writes.ring_slots(ring_len)
            plan = RingPlan.for_chunk(text_positions, ring_len, ring_writes)
            ring_links = same_image if parts.links_images(ringed) else None
            masks[ringed] = ring_mask(
                text_positions,
                plan.key_positions,
                parts.ring_span(ringed),
                ring_links,
                dtype,
                kind=kind_for_layer_type(ringed),
            )
        chunk = ChunkWrites(write_slots, read_slots, text_positions, writes.batch_index, writes.fresh, plan)
        objects = layer_objects({layer: io.layers[layer] for layer in past}, past, chunk)
        cache = RetainedKVCache(objects)
        extra = text_model_kwargs(parts, input_ids, image_idx, named, stacked_rows)
        outputs = self.text_model(
            inputs_embeds=inputs_embeds,
            attention_mask=masks if parts.mask_per_layer_type else _only_mask(masks),
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        hidden = outputs.last_hidden_state
        last = text_positions.argmax(dim=1, keepdim=True)  # the last valid (largest) position
        batch = torch.arange(hidden.shape[0]).view(-1, 1)
        logits = self.lm_head(hidden[batch, last])
        results = {io.name(Role.LOGITS, output=True): logits}
        results[io.name(Role.VISION_CURSOR, output=True)] = image_idx_output
        for row in (vision_row, *stacked_rows):  # returned unchanged: the device keeps them resident
            results[io.output_of(row)] = named[row.name]
        for row in io.rows(*SLOT_ROLES):  # each layer's object returns its own rows
            results[io.output_of(row)] = objects[row.layer].retained(row)
        return tuple(results[name] for name in io.output_names)
