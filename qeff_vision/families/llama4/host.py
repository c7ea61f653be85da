"""Llama 4 host protocol: an image's tiles cut out of the prompt's tile list; its placeholder runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost

ASPECT_RATIOS = "aspect_ratios"


class Host(BaseHost):
    """Images by their tiles: the processor stacks every image's tiles (global tile last) in one tensor."""

    @property
    def view(self):
        """The family's vision geometry (:class:`~qeff_vision.families.llama4.Llama4View`)."""
        return self.family.vision(self.model)

    def tile_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Tiles of each image in prompt order, the global tile included.

        From ``aspect_ratios`` when the image processor's outputs carry them; the full processor
        drops them (``unused_input_names``), so then from the ``<|patch|>`` tokens between each
        ``<|image_start|>`` and ``<|image_end|>`` of the prompt.
        """
        if ASPECT_RATIOS in processed:
            grids = np.asarray(processed[ASPECT_RATIOS]).reshape(-1, 2)
            return [int(h * w + (1 if h * w > 1 else 0)) for h, w in grids]
        ids = np.asarray(processed["input_ids"]).reshape(-1)
        view = self.view
        start, end = view.image_start, view.image_end
        patch = self.family.image_token_id(self.model)
        counts, inside = [], None
        for token in ids.tolist():
            if token == start:
                inside = 0
            elif token == end and inside is not None:
                counts.append(inside // view.tokens_per_tile)
                inside = None
            elif token == patch and inside is not None:
                inside += 1
        return counts

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its tiles [tiles, 3, tile, tile] (float32: the processor computes in bfloat16)."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        counts = self.tile_counts(processed)
        if sum(counts) != pixels.shape[0]:
            raise UserError(
                f"Llama 4 prompt: {sum(counts)} tiles in the text, {pixels.shape[0]} in pixel_values"
            )
        offsets = np.cumsum([0, *counts])
        return [
            {symbols.PIXEL_VALUES: np.ascontiguousarray(pixels[offsets[i] : offsets[i + 1]])}
            for i in range(len(counts))
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Tiles x tokens per tile of each image."""
        per_tile = self.view.tokens_per_tile
        return [count * per_tile for count in self.tile_counts(processed)]
