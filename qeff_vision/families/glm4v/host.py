"""GLM-4.1V host protocol: images in prompt order, M-RoPE positions [4, 1, L].

Numpy only. The processor's ``pixel_values`` rows are the images' patches one image after another
(``image_grid_thw`` [n, 3]); each image's grid rides on the shape of its own ``image_grid_thw``
[1, 1, grid_h, grid_w] (the vision program's input).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.families.glm4v import IMAGE_GRID_THW
from qeff_vision.families.host import Host as BaseHost


class Host(BaseHost):
    """Images by their grids (1, h, w); clips are refused (see the family's ``features.video``)."""

    refused_inputs = {"pixel_values_videos": "video"}

    def _grids(self, processed: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        if "image_grid_thw" not in processed:  # a text-only prompt (processor output, not config)
            return []
        grids = np.asarray(processed["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        return [tuple(int(x) for x in grid) for grid in grids.tolist()]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Pixel rows per image; the grid (1, h, w) in image_grid_thw's shape."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        grids = self._grids(processed)
        starts = np.cumsum([0] + [t * h * w for t, h, w in grids]).tolist()
        return [
            {
                symbols.PIXEL_VALUES: pixels[starts[i] : starts[i + 1]],
                IMAGE_GRID_THW: np.zeros((1, t, h, w), dtype=np.int64),
            }
            for i, (t, h, w) in enumerate(grids)
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Placeholders per image: t * h * w / merge^2 (``Glm4vProcessor.replace_image_token``)."""
        merge = self.family.vision(self.model).merge
        return [t * h * w // (merge * merge) for t, h, w in self._grids(processed)]

    def prompt_positions(self, processed: Mapping[str, Any]) -> np.ndarray:
        """Row 0: the text position (the KV slot); rows 1-3: M-RoPE t/h/w (ref: Glm4vModel.get_rope_index).

        Text advances all three rows together; an image of merged grid (h, w) starting at s takes
        t = s, h = s + row, w = s + column, and the text after it resumes at s + max(h, w).
        """
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(-1)
        merge = self.family.vision(self.model).merge
        placeholder = np.isin(input_ids, list(self.placeholder_ids()))
        grids = iter(self._grids(processed) if placeholder.any() else [])
        length = input_ids.shape[0]
        rope = np.zeros((3, length), dtype=np.int64)
        index, position = 0, 0
        while index < length:
            if not placeholder[index]:
                rope[:, index] = position
                position, index = position + 1, index + 1
                continue
            _, grid_h, grid_w = next(grids)
            merged_h, merged_w = grid_h // merge, grid_w // merge
            h, w = np.meshgrid(np.arange(merged_h), np.arange(merged_w), indexing="ij")
            count = merged_h * merged_w
            rope[0, index : index + count] = position
            rope[1, index : index + count] = position + h.ravel()
            rope[2, index : index + count] = position + w.ravel()
            position, index = position + max(merged_h, merged_w), index + count
        text = np.arange(length, dtype=np.int64).reshape(1, length)
        return np.concatenate([text, rope], axis=0).reshape(4, 1, length)
