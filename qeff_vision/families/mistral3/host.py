"""Mistral 3 host protocol: each image's own pixels cut out of the batch padding; rows x columns tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost

IMAGE_SIZES = "image_sizes"


class Host(BaseHost):
    """Images by their resized ``image_sizes``."""

    @staticmethod
    def sizes(processed: Mapping[str, Any]) -> list[tuple[int, int]]:
        """(height, width) of each image after the processor's resize."""
        if IMAGE_SIZES not in processed:
            raise UserError("Mistral 3 prompts need the processor's image_sizes (do not drop them)")
        return [(int(h), int(w)) for h, w in np.asarray(processed[IMAGE_SIZES]).reshape(-1, 2)]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its own pixels, cut out of the batch's padding by ``image_sizes``."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        return [
            {symbols.PIXEL_VALUES: np.ascontiguousarray(pixels[i : i + 1, :, :height, :width])}
            for i, (height, width) in enumerate(self.sizes(processed))
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Rows x columns of 28-px tokens per image (``image_sizes`` are the resized sizes)."""
        side = self.family.vision(self.model).token_side
        return [(height // side) * (width // side) for height, width in self.sizes(processed)]
