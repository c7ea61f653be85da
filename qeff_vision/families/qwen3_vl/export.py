"""Qwen3-VL export: a vision tower whose grid, position table and rotary positions follow symbolic shapes.

transformers computes the rotary positions and the per-frame attention segments with Python loops
over ``grid_thw.tolist()`` (ref: transformers v5 vision_utils.py, ``get_vision_position_ids`` /
``get_vision_attention_seqlens``), which tracing freezes into constants of the example image. Here
every index comes from tensor arithmetic on the *shape* of ``image_grid_thw``
[batch, time, grid_h, grid_w] (QEfficient's layout), so one graph serves every resolution:

* patches are in the processor's block-major order (2x2 merge blocks, row-major over the merged
  grid); row and column of each patch are decoded from its index;
* the learned position table (a square grid) is resampled to the image's grid by bilinear
  interpolation with aligned corners, written as four gathers and weights
  (ref: vision_utils.py, ``get_vision_interpolation_indices_and_weights``, ``mode="bilinear"``,
  ``align_corners=True`` as ``Qwen3VLVisionModel`` sets);
* attention runs per temporal patch (frame): a block mask instead of ``cu_seqlens`` splits.

The decoder gets the deepstack rows through the generic stacked-row inputs: the k-th gathered
block is added to the output of layer k at the placeholder positions (``torch.where`` instead of
transformers' boolean-index assignment, which does not trace to a fixed-shape graph).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.blocked_attention import query_blocked_attention
from qeff_vision.export.decoder import DecoderParts
from qeff_vision.families.qwen2_5_vl import IMAGE_GRID_THW
from qeff_vision.families.qwen2_5_vl.export import Adapter as Qwen2_5_VLAdapter
from qeff_vision.families.qwen3_vl import DEEPSTACK_FEATURES


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a ``side``-long table and their weights for positions ``index`` of an axis of ``size``.

    ``align_corners=True``: the axis ends map to 0 and side - 1.
    """
    source = index.to(torch.float32) * (side - 1) / torch.clamp(size.to(torch.float32) - 1, min=1)
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = torch.clamp(floor.to(torch.int64).unsqueeze(-1) + offsets, 0, side - 1)
    weights = torch.clamp(1 - (source.unsqueeze(-1) - floor.unsqueeze(-1) - offsets).abs(), min=0)
    return taps, weights


def block_major_grid(image_grid_thw: torch.Tensor, merge: int):
    """Per-patch (frame segment, row, column, grid_h, grid_w) in the processor's block-major patch order.

    The Qwen2-VL image processor (and GLM-4.1V's, which reuses its layout) emits patches in
    ``merge x merge`` blocks, row-major over blocks; the grid sizes are the symbolic shape of
    ``image_grid_thw`` so the export follows the specialization.
    """
    batch, time = image_grid_thw.shape[0], image_grid_thw.shape[1]
    grid_h, grid_w = image_grid_thw.shape[2], image_grid_thw.shape[3]
    patches_per_frame = grid_h * grid_w
    patch = torch.arange(batch * time * patches_per_frame)
    frame = patch // patches_per_frame
    local = patch % patches_per_frame
    token, inner = local // (merge * merge), local % (merge * merge)
    merged_w = grid_w // merge
    row = (token // merged_w) * merge + inner // merge
    col = (token % merged_w) * merge + inner % merge
    ones = torch.ones_like(patch)
    return frame, row, col, ones * grid_h, ones * grid_w


class VisionEncoder(nn.Module):
    """pixel_values [N, C*T*P*P], image_grid_thw [B, t, gh, gw] -> vision_embeds (, deepstack_features)."""

    def __init__(self, visual: nn.Module, deepstack: Sequence[int] | None = None):
        super().__init__()
        self.visual = visual
        config = visual.config
        self.merge = config.spatial_merge_size
        self.side = visual.num_grid_per_side
        # Qwen3.5's tower is this one without deepstack mergers: it passes ``deepstack=()``.
        self.deepstack = list(config.deepstack_visual_indexes if deepstack is None else deepstack)
        self.out_hidden = config.out_hidden_size

    def _grid_indices(self, image_grid_thw: torch.Tensor):
        """Per-patch (frame segment, row, column, grid_h, grid_w): :func:`block_major_grid`."""
        return block_major_grid(image_grid_thw, self.merge)

    def _position_table(self, row, col, heights, widths) -> torch.Tensor:
        """The learned square position table resampled to each patch's (row, column)."""
        side = self.side
        h_taps, h_weights = _bilinear_taps(row, heights, side)
        w_taps, w_weights = _bilinear_taps(col, widths, side)
        indices = (h_taps.unsqueeze(-1) * side + w_taps.unsqueeze(-2)).reshape(-1, 4)
        weights = (h_weights.unsqueeze(-1) * w_weights.unsqueeze(-2)).reshape(-1, 4)
        return (self.visual.pos_embed(indices) * weights.unsqueeze(-1)).sum(1)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        """Encode a batch of same-resolution images (or clips of the same frame count)."""
        visual = self.visual
        frame, row, col, heights, widths = self._grid_indices(image_grid_thw)
        hidden = visual.patch_embed(pixel_values)
        hidden = hidden + self._position_table(row, col, heights, widths).to(hidden.dtype)
        cos, sin = visual.rotary_pos_emb(hidden, torch.stack([row, col], dim=-1))
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
        features = []
        for index, block in enumerate(visual.blocks):  # a patch attends the patches of its frame
            hidden = hidden + self._attention(block.attn, block.norm1(hidden), cos, sin, frame)
            hidden = hidden + block.mlp(block.norm2(hidden))
            if index in self.deepstack:
                features.append(visual.deepstack_merger_list[self.deepstack.index(index)](hidden))
        batch = image_grid_thw.shape[0]
        merged = visual.merger(hidden).reshape(batch, -1, self.out_hidden)
        if not self.deepstack:
            return merged
        stacked = torch.stack([f.reshape(batch, -1, self.out_hidden) for f in features], dim=0)
        return merged, stacked

    @staticmethod
    def _attention(attn: nn.Module, hidden, cos, sin, segment) -> torch.Tensor:
        """Attention among patches of the same ``segment`` [N], in query blocks (scores bounded)."""
        length = hidden.shape[0]
        qkv = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 2, 0, 3)
        query, key, value = qkv[0], qkv[1], qkv[2]  # [heads, N, head_dim]
        cos_h, sin_h = cos.transpose(0, 1), sin.transpose(0, 1)
        query = (query.float() * cos_h + _rotate_half(query.float()) * sin_h).to(value.dtype)
        key = (key.float() * cos_h + _rotate_half(key.float()) * sin_h).to(value.dtype)
        output = query_blocked_attention(query, key, value, attn.scaling, segments=segment)
        return attn.proj(output.transpose(0, 1).reshape(length, -1))


def _dense_deepstack(text_model: nn.Module):
    """``_deepstack_process`` that also takes dense rows [batch, seq, hidden] (traceable).

    transformers passes the rows of the image positions only and assigns through a boolean index;
    our decoder passes one (gathered) row per token and selects with ``torch.where``. Other calls
    keep transformers' own behaviour, so patching a shared model does not change its ``generate``.
    """
    original = type(text_model)._deepstack_process.__get__(text_model)

    def process(hidden_states, visual_pos_masks, visual_embeds):
        if visual_embeds.dim() != hidden_states.dim():
            return original(hidden_states, visual_pos_masks, visual_embeds)
        added = hidden_states + visual_embeds.to(hidden_states.dtype)
        return torch.where(visual_pos_masks.unsqueeze(-1), added, hidden_states)

    return process


def _deepstack_kwargs(is_image: torch.Tensor, gathered: Mapping[str, torch.Tensor]) -> dict:
    return {"visual_pos_masks": is_image, "deepstack_visual_embeds": gathered[DEEPSTACK_FEATURES]}


class Adapter(Qwen2_5_VLAdapter):
    """Torch side of the Qwen3-VL family (positions and vision-input splitting as Qwen2.5-VL's)."""

    # Qwen3VLTextModel builds its own causal mask from what it is given; a 4-D mask passes through.
    single_mask = True

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The symbolic-grid vision tower returning (vision_embeds, deepstack_features)."""
        return VisionEncoder(model.model.visual).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One 4x6-patch image: not square, smaller than the position table on both axes."""
        config = model.config.vision_config
        grid_h, grid_w = 2 * config.spatial_merge_size, 3 * config.spatial_merge_size
        features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        generator = torch.Generator().manual_seed(0)
        return {  # two temporal patches, so the frame axis is traced as what it is
            symbols.PIXEL_VALUES: torch.randn(2 * grid_h * grid_w, features, generator=generator),
            IMAGE_GRID_THW: torch.zeros(1, 2, grid_h, grid_w, dtype=torch.int64),
        }

    def _hf_vision(self, model, processed):
        grid = torch.as_tensor(processed["image_grid_thw"])
        with torch.no_grad():
            output = model.model.visual(torch.as_tensor(processed["pixel_values"]), grid_thw=grid)
        counts = (grid.prod(dim=-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        return output, counts

    def hf_image_features(self, model, processed):
        """Transformers' vision tower on the processor outputs, split per image."""
        output, counts = self._hf_vision(model, processed)
        return list(torch.split(output.pooler_output, counts))

    @staticmethod
    def _cut_video_features(video, masks):
        """The clips' merged rows and each deepstack layer's rows kept by ``masks``."""
        video = Qwen2_5_VLAdapter._cut_video_features(video, masks)
        video.deepstack_features = [
            tuple(rows[mask] for rows, mask in zip(layer, masks)) for layer in video.deepstack_features
        ]
        return video

    def hf_stacked_rows(self, model, processed):
        """Transformers' deepstack features per image: [num_feature_layers, tokens, hidden]."""
        output, counts = self._hf_vision(model, processed)
        stacked = torch.stack(list(output.deepstack_features))
        return {DEEPSTACK_FEATURES: list(torch.split(stacked, counts, dim=1))}

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The shared layout plus the deepstack rows and how the text model takes them."""
        parts = super().decoder_parts(model)
        parts.stacked_rows = {DEEPSTACK_FEATURES: len(model.config.vision_config.deepstack_visual_indexes)}
        parts.stacked_rows_kwargs = _deepstack_kwargs
        parts.text_model._deepstack_process = _dense_deepstack(parts.text_model)
        return parts
