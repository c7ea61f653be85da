"""Qwen2.5-VL export: a vision tower whose grid, windows and rotary positions follow symbolic shapes.

transformers computes the window order, the rotary positions and the attention segments with
Python loops over ``grid_thw.tolist()`` (ref: transformers v5 vision_utils.py,
``get_vision_window_index`` / ``get_vision_position_ids``), which tracing freezes into constants of
the example image. Here every index comes from tensor arithmetic on the *shape* of
``image_grid_thw`` [batch, 1, grid_h, grid_w], so one graph serves every resolution.

Window blocks attend at window cost: each patch gets a slot in a [windows, window_patches] grid
(window-major, every window padded to the full window, padding masked as keys), queries, keys and
values are gathered into that grid, attention runs batched over windows, and the rows are gathered
back into the processor's order. Attention is permutation-equivariant, so this equals
transformers' "reorder, attend per window, reorder back" (``get_vision_window_index``), with
O(P x window) work instead of the O(P^2) of a masked full attention. ``windowed=False`` keeps the
masked-full form (a patch attends to patches with the same window id) for comparison.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked_attention
from qeff_vision.families.qwen2_5_vl import (
    IMAGE_GRID_THW,
    PATCH_IDS,
    WINDOW_LAYOUT,
    patches,
)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionEncoder(nn.Module):
    """pixel_values [B*t*gh*gw, C*T*P*P], image_grid_thw [B, t, gh, gw] -> vision_embeds [B, tokens, D]."""

    def __init__(self, visual: nn.Module, windowed: bool = True):
        super().__init__()
        self.visual = visual
        self.windowed = windowed
        config = visual.config
        self.merge = config.spatial_merge_size
        # Window side in merged tokens (112 px / 14 px / 2 = 4 in the published checkpoints).
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_attention_blocks = set(config.fullatt_block_indexes)
        self.out_hidden = config.out_hidden_size

    def _grid_indices(self, image_grid_thw: torch.Tensor):
        """Per-patch (frame, row, column, window) ids in the processor's block-major patch order.

        A clip's temporal patches are frames of their own (transformers attends per frame:
        ``cu_seqlens`` repeats h * w for each of the t patches, windows likewise).
        """
        batch, time = image_grid_thw.shape[0], image_grid_thw.shape[1]
        grid_h, grid_w = image_grid_thw.shape[2], image_grid_thw.shape[3]
        merge = self.merge
        merged_w = grid_w // merge
        patches_per_image = grid_h * grid_w
        patch = torch.arange(batch * time * patches_per_image)
        image = patch // patches_per_image
        local = patch % patches_per_image
        token, inner = local // (merge * merge), local % (merge * merge)
        token_row, token_col = token // merged_w, token % merged_w
        row = token_row * merge + inner // merge
        col = token_col * merge + inner % merge
        windows_w = (merged_w + self.window - 1) // self.window
        windows_h = (grid_h // merge + self.window - 1) // self.window
        window = (token_row // self.window) * windows_w + token_col // self.window
        window = window + image * (windows_h * windows_w)
        # Slot inside the padded window: (merged row, merged col) within the window, then the
        # merge x merge patches of that merged token.
        in_window = (token_row % self.window) * self.window + token_col % self.window
        slot = window * (self.window * self.window * merge * merge) + in_window * (merge * merge) + inner
        return image, row, col, window, slot, batch * time * windows_h * windows_w

    def _window_layout(self, slot: torch.Tensor, windows, cos, sin, dtype: torch.dtype):
        """Padded window-major layout shared by every window block.

        Returns (cos, sin) as [windows, 1, S, head_dim], the gather index into [patches + 1 zero
        row] (padding slots point at the zero row), the additive key mask [windows, 1, 1, S] and
        ``slot`` (where each patch sits in the layout).
        """
        patches = slot.shape[0]
        size = self.window * self.window * self.merge * self.merge
        # Padding slots point at the appended zero row (index == patches).
        gather = torch.full((windows * size,), patches, dtype=torch.int64)
        gather = gather.scatter(0, slot, torch.arange(patches))
        valid = (gather < patches).reshape(-1, 1, 1, size)
        mask = torch.where(valid, 0.0, torch.finfo(dtype).min).to(dtype)

        def padded(table: torch.Tensor) -> torch.Tensor:  # [N, 1, head_dim] -> [windows, 1, S, head_dim]
            table = torch.cat([table, torch.zeros_like(table[:1])], dim=0)[gather]
            return table.reshape(-1, size, 1, table.shape[-1]).transpose(1, 2)

        return padded(cos), padded(sin), gather, mask, slot

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode a batch of same-resolution images."""
        image, row, col, window, slot, windows = self._grid_indices(image_grid_thw)
        hidden = self.visual.patch_embed(pixel_values)
        cos, sin = self._rotary(hidden, row, col)
        layout = self._window_layout(slot, windows, cos, sin, hidden.dtype) if self.windowed else None
        window_segment = None if self.windowed else window
        hidden = self._blocks(hidden, cos, sin, image, layout, window_segment)
        merged = self.visual.merger(hidden)
        return merged.reshape(image_grid_thw.shape[0], -1, self.out_hidden)

    def _rotary(self, hidden: torch.Tensor, row: torch.Tensor, col: torch.Tensor):
        """Vision rotary cos/sin [N, 1, head_dim] from each patch's row and column."""
        cos, sin = self.visual.rotary_pos_emb(hidden, torch.stack([row, col], dim=-1))
        return cos.unsqueeze(1).float(), sin.unsqueeze(1).float()

    def _blocks(self, hidden, cos, sin, image, layout, window) -> torch.Tensor:
        """Every block: full attention where the checkpoint has it, window attention elsewhere.

        ``image`` [N] is each patch's image number (full attention stays within an image);
        ``layout`` (the padded window form, see :meth:`_window_attention`) or ``window`` [N] (the
        masked-full form: each patch's window number) says how window blocks attend.
        """
        for index, block in enumerate(self.visual.blocks):
            normed = block.norm1(hidden)
            if index in self.full_attention_blocks:
                hidden = hidden + self._attention(block.attn, normed, cos, sin, image)
            elif layout is not None:
                hidden = hidden + self._window_attention(block.attn, normed, *layout)
            else:
                hidden = hidden + self._attention(block.attn, normed, cos, sin, window)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return hidden

    @staticmethod
    def _rotated_qkv(attn: nn.Module, hidden, cos, sin):
        """Query, key, value [heads, N, head_dim] with the 2-D rotary applied to query and key."""
        length = hidden.shape[0]
        qkv = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 2, 0, 3)
        query, key, value = qkv[0], qkv[1], qkv[2]
        cos_h, sin_h = cos.transpose(0, 1), sin.transpose(0, 1)
        query = query * cos_h + _rotate_half(query) * sin_h
        key = key * cos_h + _rotate_half(key) * sin_h
        return query, key, value

    def _window_attention(self, attn: nn.Module, hidden, cos, sin, gather, mask, slot) -> torch.Tensor:
        """Attention batched over padded window blocks: scores [blocks, heads, S, S].

        ``cos``/``sin`` are already in the padded layout [blocks, 1, S, head_dim]; ``mask`` is
        additive, [blocks, 1, 1 or S, S]. Empty slots are zero rows; as keys they are masked, as
        queries their outputs are never gathered back (``slot`` may point one past the layout, at
        an appended zero row, for patches outside every window).
        """
        size = cos.shape[-2]
        padded = torch.cat([hidden, torch.zeros_like(hidden[:1])], dim=0)[gather]
        qkv = attn.qkv(padded).reshape(-1, size, 3, attn.num_heads, cos.shape[-1]).permute(2, 0, 3, 1, 4)
        query, key, value = qkv[0], qkv[1], qkv[2]  # [blocks, heads, S, head_dim]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        scores = torch.matmul(query, key.transpose(-1, -2)) * attn.scaling + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        output = torch.matmul(weights, value).permute(0, 2, 1, 3).reshape(gather.shape[0], -1)
        output = torch.cat([output, torch.zeros_like(output[:1])], dim=0)
        # Back to the processor's order: patch i sits at slot[i].
        return attn.proj(output[slot])

    @classmethod
    def _attention(cls, attn: nn.Module, hidden, cos, sin, segment) -> torch.Tensor:
        """Attention among patches of the same ``segment`` [N], in query blocks (scores bounded)."""
        length = hidden.shape[0]
        query, key, value = cls._rotated_qkv(attn, hidden, cos, sin)
        output = query_blocked_attention(query, key, value, attn.scaling, segments=segment)
        return attn.proj(output.transpose(0, 1).reshape(length, -1))


class PatchBucketEncoder(VisionEncoder):
    """pixel_values [patches, C*T*P*P], patch_ids [patches, 5], window_layout [blocks, S] -> [1, rows, H].

    The patch-bucket form: the host packs one or more images (any sizes) into a bucket of
    ``patches`` rows and sends the ids the grid form derives from ``image_grid_thw``
    (:mod:`qeff_vision.families.qwen2_5_vl.patches`). Full-attention blocks mask by image number,
    window blocks by window number inside each block of the layout, so padding patches and other
    images change no valid row.
    """

    def forward(
        self, pixel_values: torch.Tensor, patch_ids: torch.Tensor, window_layout: torch.Tensor
    ) -> torch.Tensor:
        """Encode the packed images; rows of image i follow those of image i - 1, padding last."""
        hidden = self.visual.patch_embed(pixel_values)
        cos, sin = self._rotary(hidden, patch_ids[:, patches.ROW], patch_ids[:, patches.COL])
        gather = window_layout.reshape(-1)
        # Window number of each slot (-1 for empty slots, through the appended row).
        window = torch.cat([patch_ids[:, patches.WINDOW], torch.full_like(patch_ids[:1, 0], -1)])[gather]
        window = window.reshape(window_layout.shape)
        same = window.unsqueeze(-1) == window.unsqueeze(-2)
        mask = torch.where(same, 0.0, torch.finfo(hidden.dtype).min).to(hidden.dtype).unsqueeze(1)

        def padded(table: torch.Tensor) -> torch.Tensor:  # [N, 1, head_dim] -> [blocks, 1, S, head_dim]
            table = torch.cat([table, torch.zeros_like(table[:1])], dim=0)[gather]
            return table.reshape(window_layout.shape[0], window_layout.shape[1], 1, -1).transpose(1, 2)

        layout = (padded(cos), padded(sin), gather, mask, patch_ids[:, patches.SLOT])
        hidden = self._blocks(hidden, cos, sin, patch_ids[:, patches.IMAGE], layout, None)
        return self.visual.merger(hidden).reshape(1, -1, self.out_hidden)


class Adapter(ExportAdapter):
    """Torch side of the Qwen2.5-VL family."""

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The symbolic-grid vision tower."""
        return VisionEncoder(model.model.visual).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A two-temporal-patch 8x12-patch clip: two windows wide and two frames, tiny in memory."""
        config = model.config.vision_config
        grid_h, grid_w = 2 * config.spatial_merge_size * 2, 3 * config.spatial_merge_size * 2
        features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        generator = torch.Generator().manual_seed(0)
        return {
            symbols.PIXEL_VALUES: torch.randn(2 * grid_h * grid_w, features, generator=generator),
            IMAGE_GRID_THW: torch.zeros(1, 2, grid_h, grid_w, dtype=torch.int64),
        }

    def patch_bucket_encoder(self, model: nn.Module) -> nn.Module:
        """The patch-bucket vision tower (packed images, ids from the host)."""
        return PatchBucketEncoder(model.model.visual).eval()

    def patch_bucket_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """An 8x12-patch and a 4x4-patch image packed into 128 patches (windows shared, padding)."""
        config = model.config.vision_config
        geometry = patches.Geometry(config.spatial_merge_size, self._window(config))
        grids = [(8, 12), (4, 4)]
        ids, layout = patches.pack_patch_ids(grids, 128, geometry.window_blocks(128), geometry)
        features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        generator = torch.Generator().manual_seed(0)
        return {
            symbols.PIXEL_VALUES: torch.randn(128, features, generator=generator),
            PATCH_IDS: torch.from_numpy(ids),
            WINDOW_LAYOUT: torch.from_numpy(layout),
        }

    @staticmethod
    def _window(config) -> int:
        return config.window_size // config.spatial_merge_size // config.patch_size

    def hf_pruned_encoder_outputs(self, model, processed, keep):
        """Images as transformers encodes them; each clip's rows (and stacked rows) cut by ``keep``."""
        inner = model.model
        tensor = {name: torch.as_tensor(value) for name, value in processed.items()}
        outputs = {}
        with torch.no_grad():
            if "pixel_values" in tensor:
                outputs["image"] = inner.get_image_features(
                    tensor["pixel_values"], tensor["image_grid_thw"], return_dict=True
                )
            video = inner.get_video_features(
                tensor["pixel_values_videos"], tensor["video_grid_thw"], return_dict=True
            )
        masks = torch.split(
            torch.as_tensor(keep, dtype=torch.bool), [len(rows) for rows in video.pooler_output]
        )
        outputs["video"] = self._cut_video_features(video, masks)
        return outputs

    @staticmethod
    def _cut_video_features(video, masks):
        """The clips' merged rows kept by ``masks`` (one per clip)."""
        video.pooler_output = tuple(rows[mask] for rows, mask in zip(video.pooler_output, masks))
        return video

    def hf_image_features(self, model, processed):
        """Transformers' vision tower on the processor outputs, split per image."""
        grid = torch.as_tensor(processed["image_grid_thw"])
        with torch.no_grad():
            output = model.model.visual(torch.as_tensor(processed["pixel_values"]), grid_thw=grid)
        merged = output.pooler_output
        counts = (grid.prod(dim=-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        return list(torch.split(merged, counts))
