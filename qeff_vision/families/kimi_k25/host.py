"""Kimi-K2.5 host protocol: each image's raster patches and its grid as two lengths (numpy only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.kimi_k25 import H_SHAPE, W_SHAPE


class Host(BaseHost):
    """Images by their grids (1, h, w) from ``image_grid_thw``, in prompt order."""

    @staticmethod
    def _grids(processed: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        grids = np.asarray(processed["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        return [tuple(int(x) for x in grid) for grid in grids.tolist()]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its patches [h * w, 3, P, P] and ``h_shape`` / ``w_shape`` of lengths h and w."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        inputs, start = [], 0
        for frames, rows, columns in self._grids(processed):
            count = frames * rows * columns
            inputs.append(
                {
                    symbols.PIXEL_VALUES: pixels[start : start + count],
                    H_SHAPE: np.ones(rows, dtype=np.int64),
                    W_SHAPE: np.ones(columns, dtype=np.int64),
                }
            )
            start += count
        return inputs

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Frames x rows x columns / merge area per image (ref: Kimi_K25Processor.replace_image_token)."""
        rows, columns = self.family.vision(self.model).merge
        return [int(np.prod(grid)) // (rows * columns) for grid in self._grids(processed)]
