"""Molmo2 host protocol: an image is its crops and pooling indices; its segment is its whole token span."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.segments import IMAGE, PlanError, Segment
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.molmo2 import IMAGE_TOKEN_POOLING

IMAGE_GRIDS = "image_grids"
IMAGE_NUM_CROPS = "image_num_crops"


class Host(BaseHost):
    """Per image: its crops, and its pooling indices counted from its own first patch."""

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Pooled tokens per image: low_h * low_w + high_h * high_w of its ``image_grids`` row."""
        grids = np.asarray(processed[IMAGE_GRIDS]).reshape(-1, 4)
        return [int(low_h * low_w + high_h * high_w) for low_h, low_w, high_h, high_w in grids]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: ``pixel_values`` [crops, patches, patch_dim] and its pooling rows (int64).

        The processor numbers a prompt's patches across all its images; each image's vision call
        sees only its own crops, so its indices are shifted back by the patches before it
        (-1, a padded slot, stays -1).
        """
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        pooling = np.asarray(processed[IMAGE_TOKEN_POOLING]).astype(np.int64)
        crops = [int(n) for n in np.asarray(processed[IMAGE_NUM_CROPS]).reshape(-1)]
        tokens = self.placeholder_counts(processed)
        if sum(crops) != pixels.shape[0] or sum(tokens) != pooling.shape[0]:
            raise UserError(
                f"{pixels.shape[0]} crops and {pooling.shape[0]} pooled tokens in the processor outputs, "
                f"but the images need {sum(crops)} and {sum(tokens)}"
            )
        patches = pixels.shape[1]
        crop_offsets, token_offsets = np.cumsum([0, *crops]), np.cumsum([0, *tokens])
        inputs = []
        for index in range(len(crops)):
            rows = pooling[token_offsets[index] : token_offsets[index + 1]]
            first_patch = crop_offsets[index] * patches
            inputs.append(
                {
                    symbols.PIXEL_VALUES: pixels[crop_offsets[index] : crop_offsets[index + 1]],
                    IMAGE_TOKEN_POOLING: np.where(rows >= 0, rows - first_patch, -1),
                }
            )
        return inputs

    def segments(self, processed: Mapping[str, Any]) -> list[Segment]:
        """One indivisible segment per image over its whole span, low-res start to the last ``<im_end>``.

        The span's start, column and end tokens attend to its placeholders both ways, so the
        segment covers them too (its tokens then differ from its rows: the planner keeps it whole).
        Every image token of the prompt attends to every other one, so the images after the first
        are ``joined``: the planner keeps the prompt's images, and the text between them, in one chunk.
        """
        if not self.has_images(processed):
            return []
        ids = np.asarray(processed["input_ids"]).reshape(-1)
        vision = self.family.vision(self.model)
        block = np.isin(ids, vision.image_token_ids)
        start_id = int(self.config["low_res_image_start_token_id"])
        patch_id = self.family.image_token_id(self.model)
        counts = self.placeholder_counts(processed)
        starts = [int(s) for s in np.flatnonzero(ids == start_id)]
        if len(starts) != len(counts):
            raise PlanError(f"the prompt has {len(starts)} image starts but {len(counts)} images")
        segments = []
        for index, (start, rows) in enumerate(zip(starts, counts)):
            limit = starts[index + 1] if index + 1 < len(starts) else len(ids)
            outside = np.flatnonzero(~block[start:limit])
            stop = start + (int(outside[0]) if len(outside) else limit - start)
            found = int((ids[start:stop] == patch_id).sum())
            if found != rows:
                raise PlanError(f"image {index} has {found} placeholder tokens in its span, expected {rows}")
            # Each image after the first shares the first one's chunk: they attend to each other.
            segments.append(Segment(start, rows, ((start, stop - start),), IMAGE, patch_id, joined=index > 0))
        return segments
