"""Llama 3.2 Vision host protocol: per image its tiles, aspect-ratio id and tile mask; one token each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost
from qeff_vision.families.mllama import ASPECT_RATIO_IDS, ASPECT_RATIO_MASK


class Host(BaseHost):
    """Images from the processor's [1, images, tiles, 3, S, S] batch."""

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """One dict per image: [1, 1, tiles, 3, S, S] pixels, its aspect-ratio id and tile mask."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        ids = np.asarray(processed[ASPECT_RATIO_IDS], dtype=np.int64)
        mask = np.asarray(processed[ASPECT_RATIO_MASK], dtype=np.int64)
        if pixels.ndim != 6 or pixels.shape[0] != 1:
            raise UserError(f"expected pixel_values [1, images, tiles, 3, S, S], got {list(pixels.shape)}")
        return [
            {
                symbols.PIXEL_VALUES: pixels[:, i : i + 1],
                ASPECT_RATIO_IDS: ids[:, i : i + 1],
                ASPECT_RATIO_MASK: mask[:, i : i + 1],
            }
            for i in range(pixels.shape[1])
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """One ``<|image|>`` token per image."""
        ids = np.asarray(processed["input_ids"]).reshape(-1)
        return [1] * int((ids == self.family.image_token_id(self.model)).sum())
