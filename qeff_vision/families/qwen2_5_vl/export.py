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

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.families import get_family
from qeff_vision.families.base import ModelDescription
from qeff_vision.families.qwen2_5_vl import (
    GRID_HEIGHT,
    IMAGE_GRID_THW,
    PATCH_IDS,
    WINDOW_BLOCKS,
    WINDOW_LAYOUT,
    patches,
)


def _segment_mask(segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, N, N] mask letting token i attend token j iff segment[i] == segment[j]."""
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    return torch.where(same, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(0)


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
        window_mask = None if self.windowed else _segment_mask(window, hidden.dtype)
        hidden = self._blocks(hidden, cos, sin, _segment_mask(image, hidden.dtype), layout, window_mask)
        merged = self.visual.merger(hidden)
        return merged.reshape(image_grid_thw.shape[0], -1, self.out_hidden)

    def _rotary(self, hidden: torch.Tensor, row: torch.Tensor, col: torch.Tensor):
        """Vision rotary cos/sin [N, 1, head_dim] from each patch's row and column."""
        cos, sin = self.visual.rotary_pos_emb(hidden, torch.stack([row, col], dim=-1))
        return cos.unsqueeze(1).float(), sin.unsqueeze(1).float()

    def _blocks(self, hidden, cos, sin, full_mask, layout, window_mask) -> torch.Tensor:
        """Every block: full attention where the checkpoint has it, window attention elsewhere.

        ``layout`` (the padded window form, see :meth:`_window_attention`) or ``window_mask`` (the
        masked-full form) says how window blocks attend.
        """
        for index, block in enumerate(self.visual.blocks):
            normed = block.norm1(hidden)
            if index in self.full_attention_blocks:
                hidden = hidden + self._attention(block.attn, normed, cos, sin, full_mask)
            elif layout is not None:
                hidden = hidden + self._window_attention(block.attn, normed, *layout)
            else:
                hidden = hidden + self._attention(block.attn, normed, cos, sin, window_mask)
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
    def _attention(cls, attn: nn.Module, hidden, cos, sin, mask) -> torch.Tensor:
        length = hidden.shape[0]
        query, key, value = cls._rotated_qkv(attn, hidden, cos, sin)
        scores = torch.matmul(query, key.transpose(1, 2)) * attn.scaling + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        output = torch.matmul(weights, value).transpose(0, 1).reshape(length, -1)
        return attn.proj(output)


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
        full_mask = _segment_mask(patch_ids[:, patches.IMAGE], hidden.dtype)
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
        hidden = self._blocks(hidden, cos, sin, full_mask, layout, None)
        return self.visual.merger(hidden).reshape(1, -1, self.out_hidden)


class Adapter(ExportAdapter):
    """Torch side of the Qwen2.5-VL family."""

    family = get_family("qwen2_5_vl")

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

    def pack_vision_inputs(self, model_config, items, bucket):
        """Pixel rows one image after another, zero-padded to the bucket; ids from the grids."""
        vision = model_config["vision_config"]
        window = vision["window_size"] // vision["spatial_merge_size"] // vision["patch_size"]
        geometry = patches.Geometry(vision["spatial_merge_size"], window)
        if any(item[IMAGE_GRID_THW].shape[1] != 1 for item in items):
            # Packing ids carry (row, col, image, window) per patch, not time: clips keep their
            # per-(resolution, frames) programs (vision.videos), which spec validation requires.
            raise UserError("a video clip needs a per-resolution vision program; patch buckets encode images")
        grids = [tuple(item[IMAGE_GRID_THW].shape[2:]) for item in items]
        packed = patches.pack_patch_ids(grids, bucket[GRID_HEIGHT], bucket[WINDOW_BLOCKS], geometry)
        if packed is None:
            return None
        rows = [item[symbols.PIXEL_VALUES] for item in items]
        pixels = np.zeros((bucket[GRID_HEIGHT], rows[0].shape[1]), dtype=rows[0].dtype)
        pixels[: sum(len(r) for r in rows)] = np.concatenate(rows, axis=0)
        return {symbols.PIXEL_VALUES: pixels, PATCH_IDS: packed[0], WINDOW_LAYOUT: packed[1]}

    def item_patches(self, item) -> int:
        """Pixel rows of the image (one per patch)."""
        return int(item[symbols.PIXEL_VALUES].shape[0])

    def item_rows(self, model_config, item) -> int:
        """Merged tokens: patches / merge^2."""
        return self.item_patches(item) // model_config["vision_config"]["spatial_merge_size"] ** 2

    def hf_image_features(self, model, processed):
        """Transformers' vision tower on the processor outputs, split per image."""
        grid = torch.as_tensor(processed["image_grid_thw"])
        with torch.no_grad():
            output = model.model.visual(torch.as_tensor(processed["pixel_values"]), grid_thw=grid)
        merged = output.pooler_output
        counts = (grid.prod(dim=-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        return list(torch.split(merged, counts))

    # ---- images and clips in prompt order (host side, numpy only) ----

    @staticmethod
    def _grids(processed: Mapping[str, Any], key: str) -> list[tuple[int, int, int]]:
        grids = np.asarray(processed.get(key, np.zeros((0, 3))), dtype=np.int64).reshape(-1, 3)
        return [tuple(int(x) for x in grid) for grid in grids.tolist()]

    def vision_items(self, model_config, processed: Mapping[str, Any]) -> list[tuple[str, int]]:
        """(``image`` | ``video``, index) of every image and clip, in prompt order.

        Walks the placeholders: the first placeholder of a kind with none pending starts that
        kind's next item, which then owns its t * h * w / merge^2 placeholders (a Qwen3-VL clip's
        are several runs, one per temporal patch, with timestamp text between them).
        """
        merge = model_config["vision_config"]["spatial_merge_size"]
        kinds = {model_config["image_token_id"]: "image"}
        if "pixel_values_videos" in processed:
            kinds[model_config["video_token_id"]] = "video"
        counts = {
            kind: [t * h * w // (merge * merge) for t, h, w in self._grids(processed, f"{kind}_grid_thw")]
            for kind in ("image", "video")
        }
        if "input_ids" not in processed:  # an image processor's output alone: its own order
            return [("image", i) for i in range(len(counts["image"]))] + [
                ("video", i) for i in range(len(counts["video"]))
            ]
        order: list[tuple[str, int]] = []
        taken, pending = {"image": 0, "video": 0}, {"image": 0, "video": 0}
        for token in np.asarray(processed["input_ids"]).reshape(-1).tolist():
            kind = kinds.get(token)
            if kind is None:
                continue
            if not pending[kind]:
                if taken[kind] >= len(counts[kind]):
                    break  # more placeholders than items: find_image_spans reports it
                order.append((kind, taken[kind]))
                pending[kind] = counts[kind][taken[kind]]
                taken[kind] += 1
            pending[kind] -= 1
        return order

    def vision_inputs(self, model_config, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Pixel rows per image or clip in prompt order; the grid (t, h, w) in image_grid_thw's shape."""
        sources = {}
        for kind, pixels_key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            pixels = np.asarray(processed.get(pixels_key, np.zeros((0, 1))), dtype=np.float32)
            grids = self._grids(processed, f"{kind}_grid_thw")
            starts = np.cumsum([0] + [t * h * w for t, h, w in grids]).tolist()
            sources[kind] = (pixels, grids, starts)
        inputs = []
        for kind, index in self.vision_items(model_config, processed):
            pixels, grids, starts = sources[kind]
            grid_t, grid_h, grid_w = grids[index]
            inputs.append(
                {
                    symbols.PIXEL_VALUES: pixels[starts[index] : starts[index + 1]],
                    IMAGE_GRID_THW: np.zeros((1, grid_t, grid_h, grid_w), dtype=np.int64),
                }
            )
        return inputs

    def placeholder_counts(self, model_config, processed: Mapping[str, Any]) -> list[int]:
        """grid_t * grid_h * grid_w / merge^2 per image or clip, in prompt order."""
        merge = model_config["vision_config"]["spatial_merge_size"]
        grids = {kind: self._grids(processed, f"{kind}_grid_thw") for kind in ("image", "video")}
        return [
            int(np.prod(grids[kind][index])) // (merge * merge)
            for kind, index in self.vision_items(model_config, processed)
        ]

    def position_items(self, model_config, processed) -> list[tuple[tuple[int, int, int], np.ndarray]]:
        """Per placeholder item in prompt order: its (t, h, w) grid and the temporal offset of each t.

        Qwen2.5-VL spaces a clip's temporal patches by ``tokens_per_second * second_per_grid_t``
        (float32, truncated; ref: Qwen2_5_VLModel.get_rope_index / get_vision_position_ids); an
        image has one temporal patch at offset 0.
        """
        videos = self._grids(processed, "video_grid_thw")
        images = self._grids(processed, "image_grid_thw")
        seconds = np.asarray(processed.get("second_per_grid_ts", np.ones(len(videos))), dtype=np.float32)
        per_second = np.float32(model_config["vision_config"].get("tokens_per_second", 4))
        items = []
        for kind, index in self.vision_items(model_config, processed):
            if kind == "image":
                items.append((images[index], np.zeros(1, np.int64)))
            else:
                grid = videos[index]
                interval = per_second * np.float32(seconds.reshape(-1)[index])
                items.append((grid, (np.arange(grid[0], dtype=np.float32) * interval).astype(np.int64)))
        return items

    def prompt_positions(self, model_config, processed) -> np.ndarray:
        """Row 0: text position (the KV slot); rows 1-3: M-RoPE t/h/w (ref: Qwen2_5_VLModel.get_rope_index).

        Text tokens advance all three rows together; an item of merged grid (t, h, w) starting at
        offset s takes t = s + temporal offset, h = s + row, w = s + column, and the next text token
        starts at s + max(h, w) (transformers v5's rule, which for images equals the largest
        position + 1).
        """
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64)[0]
        merge = model_config["vision_config"]["spatial_merge_size"]
        placeholder = np.isin(input_ids, self.family.placeholder_token_ids(_description(model_config)))
        items = iter(self.position_items(model_config, processed) if placeholder.any() else [])
        length = input_ids.shape[0]
        rope = np.zeros((3, length), dtype=np.int64)
        index, next_position = 0, 0
        while index < length:
            if placeholder[index]:
                (grid_t, grid_h, grid_w), offsets = next(items)
                merged_h, merged_w = grid_h // merge, grid_w // merge
                count = grid_t * merged_h * merged_w
                t, h, w = np.meshgrid(offsets, np.arange(merged_h), np.arange(merged_w), indexing="ij")
                rope[:, index : index + count] = np.stack([t.ravel(), h.ravel(), w.ravel()]) + next_position
                next_position += max(merged_h, merged_w)
                index += count
            else:
                rope[:, index] = next_position
                next_position += 1
                index += 1
        text = np.arange(length, dtype=np.int64).reshape(1, length)
        return np.concatenate([text, rope], axis=0).reshape(4, 1, length)

    def decode_positions(self, prompt_positions: np.ndarray, step: int) -> np.ndarray:
        """Row 0 continues the text slots; M-RoPE rows continue from the prompt's largest position.

        (A prompt that ends inside an image has its largest M-RoPE value before the last token.)
        """
        text = prompt_positions[0, :, -1:] + 1 + step
        rope = np.broadcast_to(prompt_positions[1:].max() + 1 + step, (3, 1, 1))
        return np.concatenate([text[None], rope], axis=0).astype(np.int64)


def _description(model_config) -> ModelDescription:
    return ModelDescription(model_config)
