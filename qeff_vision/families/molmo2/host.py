"""Molmo2 host protocol: an image is its crops and pooling indices, a clip its frames.

A segment spans the whole image (or clip) block, start to end tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.segments import IMAGE, VIDEO, PlanError, Segment
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.molmo2 import IMAGE_TOKEN_POOLING

IMAGE_GRIDS = "image_grids"
IMAGE_NUM_CROPS = "image_num_crops"
VIDEO_PIXELS = "pixel_values_videos"
VIDEO_POOLING = "video_token_pooling"
VIDEO_GRIDS = "video_grids"


def _items(pixels, pooling, crops: list[int], tokens: list[int]) -> list[dict[str, np.ndarray]]:
    """Per item: its crops (or frames) and its pooling rows, counted from its own first patch.

    The processor numbers a prompt's patches across all its items; each item's vision call sees
    only its own crops, so its indices are shifted back by the patches before it (-1, a padded
    slot, stays -1).
    """
    pixels = np.asarray(pixels).astype(np.float32)  # video frames may come as uint8 (exact)
    pooling = np.asarray(pooling).astype(np.int64)
    if sum(crops) != pixels.shape[0] or sum(tokens) != pooling.shape[0]:
        raise UserError(
            f"{pixels.shape[0]} crops and {pooling.shape[0]} pooled tokens in the processor outputs, "
            f"but the images need {sum(crops)} and {sum(tokens)}"
        )
    crop_offsets, token_offsets = np.cumsum([0, *crops]), np.cumsum([0, *tokens])
    items = []
    for index in range(len(crops)):
        rows = pooling[token_offsets[index] : token_offsets[index + 1]]
        first_patch = crop_offsets[index] * pixels.shape[1]
        items.append(
            {
                symbols.PIXEL_VALUES: pixels[crop_offsets[index] : crop_offsets[index + 1]],
                IMAGE_TOKEN_POOLING: np.where(rows >= 0, rows - first_patch, -1),
            }
        )
    return items


class Host(BaseHost):
    """Images (crops, 2x2 pooling) then clips (frames, 3x3 pooling), in prompt order, through one program."""

    pixel_inputs = (symbols.PIXEL_VALUES, VIDEO_PIXELS)  # image crops or video frames

    def _image_tokens(self, processed: Mapping[str, Any]) -> list[int]:
        if IMAGE_GRIDS not in processed:
            return []
        grids = np.asarray(processed[IMAGE_GRIDS]).reshape(-1, 4)
        return [int(low_h * low_w + high_h * high_w) for low_h, low_w, high_h, high_w in grids]

    def _video_tokens(self, processed: Mapping[str, Any]) -> list[int]:
        if VIDEO_GRIDS not in processed:
            return []
        return [int(np.prod(grid)) for grid in np.asarray(processed[VIDEO_GRIDS]).reshape(-1, 3)]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Pooled tokens per image (low_h * low_w + high_h * high_w), then per clip (frames x rows x cols).

        The chat template puts every image before the video, so this is prompt order.
        """
        return self._image_tokens(processed) + self._video_tokens(processed)

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image its crops and pooling rows, then per clip its frames and pooling rows.

        ``pixel_values`` [crops or frames, patches, patch_dim] and ``image_token_pooling``: one vision
        program serves both.
        """
        if symbols.PIXEL_VALUES in processed and VIDEO_PIXELS in processed:
            # ref: transformers v5.23 Molmo2Model.forward raises on both; its mask and rows assume one kind.
            raise UserError("Molmo2 takes images or one video per prompt, not both")
        items = []
        if symbols.PIXEL_VALUES in processed:
            crops = [int(n) for n in np.asarray(processed[IMAGE_NUM_CROPS]).reshape(-1)]
            pixels, pooling = processed[symbols.PIXEL_VALUES], processed[IMAGE_TOKEN_POOLING]
            items += _items(pixels, pooling, crops, self._image_tokens(processed))
        if VIDEO_PIXELS in processed:
            frames = [int(grid[0]) for grid in np.asarray(processed[VIDEO_GRIDS]).reshape(-1, 3)]
            pixels, pooling = processed[VIDEO_PIXELS], processed[VIDEO_POOLING]
            items += _items(pixels, pooling, frames, self._video_tokens(processed))
        return items

    def segments(self, processed: Mapping[str, Any]) -> list[Segment]:
        """One indivisible segment per image, then per clip, over its whole span.

        An image's span runs from its low-res start to its last ``<im_end>``; a clip's from its
        first frame start to its last frame end (timestamps included).
        The span's start, column and end tokens attend to its placeholders both ways, so the
        segment covers them too (its tokens then differ from its rows: the planner keeps it whole).
        Every image token of the prompt attends to every other one, so the items after the first
        are ``joined``: the planner keeps the prompt's images, and the text between them, in one chunk.
        """
        if not self.has_images(processed):
            return []
        ids = np.asarray(processed["input_ids"]).reshape(-1)
        block = np.isin(ids, self.family.vision(self.model).image_token_ids)
        patch_id = self.family.image_token_id(self.model)
        spans = self._image_spans(ids, block, len(self._image_tokens(processed)))
        if self._video_tokens(processed):  # the one clip (the processor allows one): the rest of the block
            rest = np.flatnonzero(block[spans[-1][1] if spans else 0 :]) + (spans[-1][1] if spans else 0)
            spans.append((int(rest[0]), int(rest[-1]) + 1))
        counts = self.placeholder_counts(processed)
        if len(spans) != len(counts):
            raise PlanError(f"the prompt has {len(spans)} image or clip spans but {len(counts)} items")
        segments = []
        images = len(self._image_tokens(processed))
        for index, ((start, stop), rows) in enumerate(zip(spans, counts)):
            found = int((ids[start:stop] == patch_id).sum())
            if found != rows:
                raise PlanError(f"item {index} has {found} placeholder tokens in its span, expected {rows}")
            modality = IMAGE if index < images else VIDEO
            segments.append(
                Segment(start, rows, ((start, stop - start),), modality, patch_id, joined=index > 0)
            )
        return segments

    def _image_spans(self, ids: np.ndarray, block: np.ndarray, images: int) -> list[tuple[int, int]]:
        """[start, stop) of each image: from its low-res start token to the end of its run of block tokens."""
        start_id = int(self.config["low_res_image_start_token_id"])
        starts = [int(s) for s in np.flatnonzero(ids == start_id)]
        if len(starts) != images:
            raise PlanError(f"the prompt has {len(starts)} image starts but {images} images")
        spans = []
        for index, start in enumerate(starts):
            limit = starts[index + 1] if index + 1 < len(starts) else len(ids)
            outside = np.flatnonzero(~block[start:limit])
            spans.append((start, start + (int(outside[0]) if len(outside) else limit - start)))
        return spans
