"""Llama 3.2 Vision export: the cross-attention decoder kind on retained state.

Vision program (QEfficient's IO, ref: QEfficient/transformers/models/mllama/modeling_mllama.py,
``get_onnx_dynamic_axes`` / ``get_output_names``): ``pixel_values`` [batch, max_num_images,
max_num_tiles, 3, S, S], ``aspect_ratio_ids`` [batch, max_num_images], ``aspect_ratio_mask``
[batch, max_num_images, max_num_tiles] -> for every cross-attention layer ``i``, ``past_key.{i}`` /
``past_value.{i}`` [batch, kv_heads, cross_states, head_dim]: that layer's ``k_proj`` + ``k_norm``
and ``v_proj`` over the projected vision states (ref: transformers v5
models/mllama/modeling_mllama.py, ``MllamaTextCrossAttention.forward``, the
``cross_attention_states is not None`` branch).

Language program: ``input_ids``, ``position_ids``, ``cross_attention_mask`` [batch, seq_len,
max_num_images, max_num_tiles] (the processor's, sliced per chunk; -1 marks an image slot the host
padded), then every layer's K/V. Self-
attention layers keep ``ctx_len`` slots (generic :class:`RetainedKVCache`); cross-attention layers
take the vision K/V as retained inputs and return them unchanged, so they cross to the device once
per request and every chunk and decode step reads them. Rows of tokens before the first image are
masked out as transformers does (``full_text_row_masked_out_mask`` zeroes the cross MLP).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.contract.language_io import SLOT_ROLES, LanguageIO, Role
from qeff_vision.errors import UserError
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked
from qeff_vision.export.decoder import FULL_ATTENTION, DecoderParts, attention_masks, layer_inputs
from qeff_vision.export.kv_writes import write_plan
from qeff_vision.export.state_caches import ChunkWrites, CrossKV, RetainedKVCache, layer_objects
from qeff_vision.families.mllama import ASPECT_RATIO_IDS, ASPECT_RATIO_MASK, CROSS_ATTENTION_MASK


def cross_kv(attn: nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One cross-attention layer's key and value states [batch, kv_heads, rows, head_dim]."""
    batch = states.shape[0]
    key = attn.k_proj(states).view(batch, -1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
    value = attn.v_proj(states).view(batch, -1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
    return attn.k_norm(key), value


def tile_rows(patches: int) -> int:
    """Rows of one tile in the tower: its patches and class token, padded to a multiple of 8.

    (ref: transformers v5 models/mllama/modeling_mllama.py, ``MllamaVisionModel.forward``:
    ``num_padding_patches = (8 - (hidden_states.shape[-2] % 8)) % 8``.)
    """
    return patches + (8 - patches % 8) % 8


# Most images of one call the tower's blocks are sized for (a single program's encode entries).
IMAGES = 2


class VisionKV(nn.Module):
    """pixel_values, aspect_ratio_ids, aspect_ratio_mask -> (key, value) of every cross layer."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.vision = model.model.vision_model
        # The tower attends over every tile's rows at once (4 x 1,608 at 560 px: 1.26 GB of fp16
        # scores per image at 16 heads): in query blocks sized for that length and IMAGES images
        # a call (10 blocks of 644 rows; qeff_vision/export/blocked_attention.py), in the trace
        # and in the graph.
        self.rows = tile_rows(self.vision.num_patches) * self.vision.config.max_num_tiles
        self.projector = model.model.multi_modal_projector
        self.hidden = model.model.hidden_size
        text = model.model.language_model
        self.attns = nn.ModuleList(
            text.layers[i].cross_attn for i in model.config.text_config.cross_attention_layers
        )

    def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
        """Encode every tile of every image; project; key/value per cross layer."""
        with query_blocked(self.vision.config, rows=self.rows, batch=IMAGES):
            states = self.vision(
                pixel_values=pixel_values,
                aspect_ratio_ids=aspect_ratio_ids,
                aspect_ratio_mask=aspect_ratio_mask,
            ).last_hidden_state
        states = self.projector(states).reshape(pixel_values.shape[0], -1, self.hidden)
        return tuple(tensor for attn in self.attns for tensor in cross_kv(attn, states))


class CrossCache(RetainedKVCache):
    """Retained cache whose cross-attention layers expose the vision K/V as HF's ``layers[i]``.

    With ``batch_index`` (continuous batching) every cache holds ``full_batch_size`` sequence
    slots: self-attention layers write and read their row's slot (generic CB scatter/gather) and
    cross layers read their row's slot of the vision K/V. ``sees_images`` [batch] (1 for a row
    whose request has an image slot in use, else 0) scales the values a row reads, so a request
    without images reads zeros whatever the slot holds (a previous occupant's states), which is
    what transformers' skipping of the cross layers amounts to (see ``CrossAttentionDecoder``).
    """

    def __init__(self, objects: Mapping[int, object], cross: set[int]):
        super().__init__(objects)
        self.layers = [objects[i] if i in cross else None for i in range(max(objects) + 1)]


class CrossAttentionDecoder(nn.Module):
    """The cross-attention kind's language program; inputs and outputs are the rows of ``io``.

    (input_ids, position_ids, cross_attention_mask, past_* [, batch_index] -> logits,
    past_*_RetainedState.) With ``batch_index`` (continuous batching) the caches, the cross K/V
    included, hold ``full_batch_size`` slots on dim 0; the cross K/V come back unchanged, so the
    host writes a request's states into its slot (docs/design.md, "Continuous batching for the
    cross-attention kind").
    """

    def __init__(self, model: nn.Module, io: LanguageIO):
        super().__init__()
        self.io = io
        self.text = model.model.language_model
        self.lm_head = model.lm_head
        self.cross = set(model.config.text_config.cross_attention_layers)
        self.patches = model.model.vision_model.num_patches
        self.first_self = min(set(range(len(self.text.layers))) - self.cross)

    def forward(self, *inputs):
        """Run one chunk or one decode step; cross layers read the retained vision K/V."""
        from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

        io = self.io
        named = dict(zip(io.input_names, inputs, strict=True))
        input_ids, position_ids = named[io.name(Role.TOKEN_IDS)], named[io.name(Role.POSITIONS)]
        cross_attention_mask = named[io.name(Role.CROSS_MASK)]
        past = layer_inputs(io, named)
        batch_index = named[io.name(Role.KV_SLOT)] if io.has(Role.KV_SLOT) else None
        text = self.text
        hidden = text.embed_tokens(input_ids)
        ctx_len = past[self.first_self][Role.KV_KEY].shape[2]
        # Padding (position -1) writes back what its slot holds, as in the generic decoder.
        writes = write_plan(position_ids, batch_index, past[self.first_self][Role.KV_KEY].shape[0])
        read = torch.arange(ctx_len).view(1, -1).expand(input_ids.shape[0], -1)
        # A row whose request uses no image slot (every slot of its valid tokens padded, -1) must
        # not read cross values: under continuous batching its KV slot may still hold a previous
        # request's states. Chunk padding (position -1) does not count, whatever its mask holds.
        in_use = (cross_attention_mask >= 0).flatten(2).any(dim=2) & (position_ids >= 0)
        sees_images = in_use.any(dim=1)
        write = writes.full_slots(position_ids, ctx_len)
        chunk = ChunkWrites(write, read, position_ids, writes.batch_index, writes.fresh)
        objects = layer_objects({layer: io.layers[layer] for layer in past}, past, chunk)
        for layer in self.cross:  # what a row that sees no image reads: zeros (sees_images)
            objects[layer] = CrossKV(past[layer][Role.KV_KEY], past[layer][Role.KV_VALUE], chunk, sees_images)
        cache = CrossCache(objects, self.cross)
        mask = attention_masks(position_ids, ctx_len, [FULL_ATTENTION], None, None, hidden.dtype)[
            FULL_ATTENTION
        ]
        cross_mask, full_row = _prepare_cross_attention_mask(cross_attention_mask, self.patches, hidden.dtype)
        # transformers lets a row that sees no image attend uniformly to every cross state (only the
        # cross MLP is zeroed for it). Image slots the host padded (mask -1, a compiled program
        # with more slots than the request has images) stay unseen even then, so such a row
        # averages the request's own images, as transformers does without padded slots.
        padded = (cross_attention_mask < 0).repeat_interleave(self.patches, dim=3)
        padded = padded.view(padded.shape[0], padded.shape[1], -1).unsqueeze(1)
        cross_mask = cross_mask.masked_fill(padded, torch.finfo(hidden.dtype).min)
        rotary = text.rotary_emb(hidden, position_ids)
        for layer in text.layers:
            hidden = layer(
                hidden,
                cross_attention_states=None,
                cross_attention_mask=cross_mask,
                attention_mask=mask,
                full_text_row_masked_out_mask=full_row,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rotary,
            )
        hidden = text.norm(hidden)
        last = position_ids.argmax(dim=1, keepdim=True)
        logits = self.lm_head(hidden[torch.arange(hidden.shape[0]).view(-1, 1), last])
        results = {io.name(Role.LOGITS, output=True): logits}
        for row in io.rows(*SLOT_ROLES):
            results[io.output_of(row)] = objects[row.layer].retained(row)
        return tuple(results[name] for name in io.output_names)


class Adapter(ExportAdapter):
    """Torch side of the Llama 3.2 Vision family."""

    # One tile, a 1x2 arrangement, a tall 3x1 one (the tiny tower's tiles are 56 px).
    test_image_sizes = ((50, 50), (100, 150), (300, 120))
    single_mask = True

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """Tower, projector and every cross layer's K/V projections."""
        return VisionKV(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One image of one real tile, padded to max_num_tiles."""
        vision = model.config.vision_config
        tiles, side = vision.max_num_tiles, vision.image_size
        generator = torch.Generator().manual_seed(0)
        mask = torch.zeros(1, 1, tiles, dtype=torch.int64)
        mask[..., 0] = 1
        return {
            symbols.PIXEL_VALUES: torch.randn(
                1, 1, tiles, vision.num_channels, side, side, generator=generator
            ),
            ASPECT_RATIO_IDS: torch.ones(1, 1, dtype=torch.int64),
            ASPECT_RATIO_MASK: mask,
        }

    def hf_image_features(self, model, processed) -> list[torch.Tensor]:
        """Transformers' own cross K/V: what its cross layers cache after a forward with the image.

        Per cross layer, key then value [kv_heads, rows, head_dim] of the first request.
        """
        from transformers import DynamicCache

        ids = torch.full((1, 1), model.config.image_token_index, dtype=torch.int64)
        images = torch.as_tensor(processed[symbols.PIXEL_VALUES]).shape[1]
        tiles = model.config.vision_config.max_num_tiles
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(
                input_ids=ids,
                pixel_values=torch.as_tensor(processed[symbols.PIXEL_VALUES]),
                aspect_ratio_ids=torch.as_tensor(processed[ASPECT_RATIO_IDS]),
                aspect_ratio_mask=torch.as_tensor(processed[ASPECT_RATIO_MASK]),
                cross_attention_mask=torch.ones(1, 1, images, tiles, dtype=torch.int64),
                past_key_values=cache,
                use_cache=True,
            )
        out = []
        for layer in model.config.text_config.cross_attention_layers:
            out += [cache.layers[layer].keys[0], cache.layers[layer].values[0]]
        return out

    def vision_parity_pairs(self, outputs, features, model):
        """One reference per output: each cross-attention layer's key and value states."""
        names = list(self.family.vision_outputs(model))
        return [(outputs[name][0], ref.numpy()) for name, ref in zip(names, features)]

    # ---- language program (cross-attention decoder kind) ----

    def language_decoder(self, model: nn.Module, parts: DecoderParts, io: LanguageIO) -> nn.Module:
        """The cross-attention decoder (compute-context lengths are not supported for this kind)."""
        if io.has(Role.COMP_CTX_LENGTHS):
            raise UserError(
                "compute-context lengths are not supported for the cross-attention decoder kind yet"
            )
        return CrossAttentionDecoder(model, io).eval()


__all__ = ["Adapter", "CROSS_ATTENTION_MASK", "CrossAttentionDecoder", "VisionKV"]
