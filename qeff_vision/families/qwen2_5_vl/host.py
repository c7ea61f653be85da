"""Qwen2.5-VL host protocol (also Qwen3-VL's base): images and clips in prompt order, M-RoPE positions.

Numpy only. Images and clips (``pixel_values`` / ``pixel_values_videos`` with their
``*_grid_thw``) are items in the order their placeholders appear; positions are [4, 1, L]: the
text slot, then M-RoPE t/h/w.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.video_pruning import KEPT_ROWS, PRUNED_POSITIONS
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.qwen2_5_vl import (
    GRID_HEIGHT,
    IMAGE_GRID_THW,
    PATCH_IDS,
    WINDOW_BLOCKS,
    WINDOW_LAYOUT,
    patches,
)


def _output(processed: Mapping[str, Any], key: str, absent: np.ndarray) -> Any:
    """A processor output (not config), or ``absent`` for a prompt without that modality."""
    return processed[key] if key in processed else absent


class Host(BaseHost):
    """Images and clips by their grids (t, h, w)."""

    pixel_inputs = (symbols.PIXEL_VALUES, "pixel_values_videos")  # stills or clips

    @staticmethod
    def _grids(processed: Mapping[str, Any], key: str) -> list[tuple[int, int, int]]:
        grids = np.asarray(_output(processed, key, np.zeros((0, 3))), dtype=np.int64).reshape(-1, 3)
        return [tuple(int(x) for x in grid) for grid in grids.tolist()]

    def vision_items(self, processed: Mapping[str, Any]) -> list[tuple[str, int]]:
        """(``image`` | ``video``, index) of every image and clip, in prompt order.

        Walks the placeholders: the first placeholder of a kind with none pending starts that
        kind's next item, which then owns its t * h * w / merge^2 placeholders (a Qwen3-VL clip's
        are several runs, one per temporal patch, with timestamp text between them).
        """
        merge = self.family.vision(self.model).merge
        image_id, *video_id = self.family.placeholder_token_ids(self.model)
        kinds = {image_id: "image"}
        if "pixel_values_videos" in processed and video_id:
            kinds[video_id[0]] = "video"
        counts = {
            kind: [t * h * w // (merge * merge) for t, h, w in self._grids(processed, f"{kind}_grid_thw")]
            for kind in ("image", "video")
        }
        if KEPT_ROWS in processed:  # a pruned prompt: each clip has only its kept rows' placeholders
            counts["video"] = [int(rows) for rows in processed[KEPT_ROWS]]
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
                    break  # more placeholders than items: find_segments reports it
                order.append((kind, taken[kind]))
                pending[kind] = counts[kind][taken[kind]]
                taken[kind] += 1
            pending[kind] -= 1
        return order

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Pixel rows per image or clip in prompt order; the grid (t, h, w) in image_grid_thw's shape."""
        sources = {}
        for kind, pixels_key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            pixels = np.asarray(_output(processed, pixels_key, np.zeros((0, 1))), dtype=np.float32)
            grids = self._grids(processed, f"{kind}_grid_thw")
            starts = np.cumsum([0] + [t * h * w for t, h, w in grids]).tolist()
            sources[kind] = (pixels, grids, starts)
        inputs = []
        for kind, index in self.vision_items(processed):
            pixels, grids, starts = sources[kind]
            grid_t, grid_h, grid_w = grids[index]
            inputs.append(
                {
                    symbols.PIXEL_VALUES: pixels[starts[index] : starts[index + 1]],
                    IMAGE_GRID_THW: np.zeros((1, grid_t, grid_h, grid_w), dtype=np.int64),
                }
            )
        return inputs

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """grid_t * grid_h * grid_w / merge^2 per image or clip in prompt order (a pruned clip: kept rows)."""
        merge = self.family.vision(self.model).merge
        grids = {kind: self._grids(processed, f"{kind}_grid_thw") for kind in ("image", "video")}
        kept = processed.get(KEPT_ROWS)
        return [
            int(kept[index])
            if kind == "video" and kept is not None
            else int(np.prod(grids[kind][index])) // (merge * merge)
            for kind, index in self.vision_items(processed)
        ]

    def pruning_grids(self, processed: Mapping[str, Any]) -> list[tuple[int, int, int] | None]:
        """Per item in prompt order: a clip's merged (temporal patches, rows, columns); None for an image."""
        merge = self.family.vision(self.model).merge
        videos = self._grids(processed, "video_grid_thw")
        return [
            (videos[index][0], videos[index][1] // merge, videos[index][2] // merge)
            if kind == "video"
            else None
            for kind, index in self.vision_items(processed)
        ]

    def evs_item_positions(self, processed: Mapping[str, Any]) -> list[tuple[np.ndarray, int]]:
        """Per item in prompt order: M-RoPE t/h/w of each row as if the item began at 0, and its width.

        vLLM's ``compute_mrope_for_media`` (ref: vLLM v0.33.0 vllm/multimodal/video_prune/evs.py),
        which differs from the unpruned rule (:meth:`prompt_positions`) in two ways: a clip's
        ``second_per_grid_ts`` is truncated to an integer before it scales the temporal index
        (``_postprocess_video_embeds_evs`` casts it to long), and the text after an item resumes at
        its start + its merged width, not + max(height, width).
        """
        merge = self.family.vision(self.model).merge
        videos = self._grids(processed, "video_grid_thw")
        images = self._grids(processed, "image_grid_thw")
        seconds = np.asarray(_output(processed, "second_per_grid_ts", np.ones(len(videos)))).reshape(-1)
        per_second = self.family.vision(self.model).tokens_per_second
        items = []
        for kind, index in self.vision_items(processed):
            grid_t, grid_h, grid_w = videos[index] if kind == "video" else images[index]
            # Images: tokens_per_second = seconds = 1.0 (compute_mrope_for_media's defaults).
            factor = per_second * int(seconds[index]) if kind == "video" else 1.0
            frames = np.arange(grid_t)
            # torch: an int64 arange times a Python float computes in float32, then .long() truncates.
            temporal = (
                frames * factor
                if isinstance(factor, int)
                else (frames.astype(np.float32) * np.float32(factor))
            )
            t, h, w = np.meshgrid(
                temporal.astype(np.int64),
                np.arange(grid_h // merge),
                np.arange(grid_w // merge),
                indexing="ij",
            )
            items.append((np.stack([t.ravel(), h.ravel(), w.ravel()]), grid_w // merge))
        return items

    def pruned_positions(self, processed: Mapping[str, Any], keep: np.ndarray, masks) -> np.ndarray:
        """VLLM's positions of a pruned prompt (ref: ``recompute_mrope_positions``, 4-channel case).

        Every item, image or clip, starts one past the token before it (its vision start) and
        places its kept rows at their :meth:`evs_item_positions`; the text after it resumes at its
        start + its width. Row 0 (the KV slot) counts the kept tokens.
        """
        segments = self.segments(processed)
        starts = {segment.start: number for number, segment in enumerate(segments)}
        items = self.evs_item_positions(processed)
        slot = np.cumsum(keep) - 1  # each kept token's index in the pruned prompt
        length = int(keep.sum())
        rope = np.zeros((3, length), dtype=np.int64)
        index, next_position = 0, 0
        while index < len(keep):
            number = starts.get(index)
            if number is None:
                rope[:, slot[index]] = next_position
                next_position, index = next_position + 1, index + 1
                continue
            segment, (relative, width), mask = segments[number], items[number], masks[number]
            tokens = np.concatenate([np.arange(start, start + size) for start, size in segment.token_runs])
            kept = relative if mask is None else relative[:, mask]
            rope[:, slot[tokens[keep[tokens]]]] = kept + next_position
            next_position, index = next_position + width, segment.stop
        text = np.arange(length, dtype=np.int64).reshape(1, length)
        return np.concatenate([text, rope], axis=0).reshape(4, 1, length)

    def position_items(self, processed: Mapping[str, Any]) -> list[tuple[tuple[int, int, int], np.ndarray]]:
        """Per placeholder item in prompt order: its (t, h, w) grid and the temporal offset of each t.

        Qwen2.5-VL spaces a clip's temporal patches by ``tokens_per_second * second_per_grid_t``
        (float32, truncated; ref: Qwen2_5_VLModel.get_rope_index / get_vision_position_ids); an
        image has one temporal patch at offset 0.
        """
        videos = self._grids(processed, "video_grid_thw")
        images = self._grids(processed, "image_grid_thw")
        seconds = np.asarray(_output(processed, "second_per_grid_ts", np.ones(len(videos))), dtype=np.float32)
        per_second = np.float32(self.family.vision(self.model).tokens_per_second)
        items = []
        for kind, index in self.vision_items(processed):
            if kind == "image":
                items.append((images[index], np.zeros(1, np.int64)))
            else:
                grid = videos[index]
                interval = per_second * np.float32(seconds.reshape(-1)[index])
                items.append((grid, (np.arange(grid[0], dtype=np.float32) * interval).astype(np.int64)))
        return items

    def prompt_positions(self, processed: Mapping[str, Any]) -> np.ndarray:
        """Row 0: text position (the KV slot); rows 1-3: M-RoPE t/h/w (ref: Qwen2_5_VLModel.get_rope_index).

        Text tokens advance all three rows together; an item of merged grid (t, h, w) starting at
        offset s takes t = s + temporal offset, h = s + row, w = s + column, and the next text token
        starts at s + max(h, w) (transformers v5's rule, which for images equals the largest
        position + 1).
        """
        if PRUNED_POSITIONS in processed:  # a pruned prompt: the recomputation made with its masks
            return np.asarray(processed[PRUNED_POSITIONS], dtype=np.int64)
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64)[0]
        merge = self.family.vision(self.model).merge
        placeholder = np.isin(input_ids, self.family.placeholder_token_ids(self.model))
        items = iter(self.position_items(processed) if placeholder.any() else [])
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

    # ---- patch buckets (the patch-bucket vision program, see patches.py) ----

    def patch_layout(self, items, bucket):
        """(patch_ids, window_layout) of the images packed into the bucket, or None (see patches.py)."""
        if any(item[IMAGE_GRID_THW].shape[1] != 1 for item in items):
            # Packing ids carry (row, col, image, window) per patch, not time: clips keep their
            # per-(resolution, frames) programs (vision.videos), which spec validation requires.
            raise UserError("a video clip needs a per-resolution vision program; patch buckets encode images")
        vision = self.family.vision(self.model)
        geometry = patches.Geometry(vision.merge, vision.window)
        grids = [tuple(item[IMAGE_GRID_THW].shape[2:]) for item in items]
        return patches.pack_patch_ids(grids, bucket[GRID_HEIGHT], bucket[WINDOW_BLOCKS], geometry)

    def pack_vision_inputs(self, items, bucket, layout=None):
        """Pixel rows one image after another, zero-padded to the bucket; ids from the grids."""
        layout = self.patch_layout(items, bucket) if layout is None else layout
        if layout is None:
            return None
        rows = [item[symbols.PIXEL_VALUES] for item in items]
        pixels = np.zeros((bucket[GRID_HEIGHT], rows[0].shape[1]), dtype=rows[0].dtype)
        pixels[: sum(len(r) for r in rows)] = np.concatenate(rows, axis=0)
        return {symbols.PIXEL_VALUES: pixels, PATCH_IDS: layout[0], WINDOW_LAYOUT: layout[1]}

    def item_patches(self, item) -> int:
        """Pixel rows of the image (one per patch)."""
        return int(item[symbols.PIXEL_VALUES].shape[0])

    def item_rows(self, item) -> int:
        """Merged tokens: patches / merge^2."""
        return self.item_patches(item) // self.family.vision(self.model).merge ** 2
