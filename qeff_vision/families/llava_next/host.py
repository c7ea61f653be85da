"""LLaVA-NeXT host protocol: each image's own tiles and original size; token math on that size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.families.base import ImageSize
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.llava_next import IMAGE_SIZES, NUM_PATCHES


class Host(BaseHost):
    """Images by their original ``image_sizes``."""

    def _symbols(self, image_size) -> dict[str, int]:
        height, width = (int(v) for v in image_size)
        return self.family.vision_symbols(self.model, ImageSize(height, width))

    def _tokens(self, image_size) -> int:
        height, width = (int(v) for v in image_size)
        return self.family.image_tokens(self.model, ImageSize(height, width))

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its own tiles (the processor pads the tile axis across a batch) and its size."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        sizes = np.asarray(processed[IMAGE_SIZES], dtype=np.int64)
        return [
            {
                symbols.PIXEL_VALUES: pixels[index : index + 1, : self._symbols(size)[NUM_PATCHES]],
                IMAGE_SIZES: sizes[index : index + 1],
            }
            for index, size in enumerate(sizes.tolist())
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """The family's token math on each image's original size (``image_sizes``)."""
        return [self._tokens(size) for size in np.asarray(processed[IMAGE_SIZES]).tolist()]

    def own_rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The processor's count for the image's size: the output's rows after it are zeros."""
        return self._tokens(np.asarray(inputs[IMAGE_SIZES]).reshape(-1, 2)[0])
