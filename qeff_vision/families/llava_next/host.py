"""LLaVA-NeXT host protocol: each image's own tiles and grid carriers; token math on its original size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.families.base import ImageSize
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.llava_next import (
    FEATURE_GRID,
    FEATURE_HEIGHT,
    FEATURE_WIDTH,
    NUM_PATCHES,
    TILE_COLS,
    TILE_GRID,
    TILE_ROWS,
)


class Host(BaseHost):
    """Images by their original ``image_sizes``."""

    def _symbols(self, image_size) -> dict[str, int]:
        height, width = (int(v) for v in image_size)
        return self.family.vision_symbols(self.model, ImageSize(height, width))

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its own tiles (the processor pads the tile axis across a batch) and grid carriers."""
        pixels = np.asarray(processed["pixel_values"], dtype=np.float32)
        inputs = []
        for index, image_size in enumerate(np.asarray(processed["image_sizes"]).tolist()):
            values = self._symbols(image_size)
            inputs.append(
                {
                    symbols.PIXEL_VALUES: pixels[index : index + 1, : values[NUM_PATCHES]],
                    TILE_GRID: np.zeros((1, values[TILE_ROWS], values[TILE_COLS]), dtype=np.int64),
                    FEATURE_GRID: np.zeros(
                        (1, values[FEATURE_HEIGHT], values[FEATURE_WIDTH]), dtype=np.int64
                    ),
                }
            )
        return inputs

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """The family's token math on each image's original size (``image_sizes``)."""
        sizes = np.asarray(processed["image_sizes"]).tolist()
        return [self._symbols(size)[symbols.VISION_SIZE] for size in sizes]
