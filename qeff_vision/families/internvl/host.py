"""InternVL host protocol: an image is its tiles; placeholders are the context runs of the prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost

NUM_PATCHES = "num_patches"


class Host(BaseHost):
    """Tiles per image from ``num_patches`` or from the prompt's context runs."""

    def tiles_per_image(self, processed: Mapping[str, Any]) -> list[int]:
        """Tiles of each image: the image processor's ``num_patches``, or the prompt's context runs.

        ``InternVLProcessor`` drops ``num_patches`` from its outputs, but each image's context
        tokens are one run between ``<img>`` and ``</img>`` of tokens_per_tile per tile.
        """
        if NUM_PATCHES in processed:
            return [int(n) for n in np.asarray(processed[NUM_PATCHES]).reshape(-1)]
        per_tile = self.family.tokens_per_tile(self.model)
        counts = self.placeholder_counts(processed)
        if any(count % per_tile for count in counts):
            raise UserError(f"image token runs {counts} are not whole tiles of {per_tile} tokens")
        return [count // per_tile for count in counts]

    @staticmethod
    def split_tiles(values, tiles: Sequence[int]) -> list:
        """``values`` (one entry per tile) cut into each image's tiles."""
        if sum(tiles) != len(values):
            raise UserError(f"{len(values)} tiles in pixel_values, but the images need {sum(tiles)}")
        offsets = np.cumsum([0, *tiles])
        return [values[offsets[i] : offsets[i + 1]] for i in range(len(tiles))]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: its tiles as [tiles, 3, S, S] (the vision program's layout)."""
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        tiles = self.tiles_per_image(processed)
        return [{symbols.PIXEL_VALUES: part} for part in self.split_tiles(pixels, tiles)]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """The length of each run of context tokens: ``<img>``/``</img>`` fence every image."""
        ids = np.asarray(processed["input_ids"]).reshape(-1)
        marked = np.concatenate(([0], (ids == self.family.image_token_id(self.model)).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(marked))
        return [int(stop - start) for start, stop in zip(edges[0::2], edges[1::2])]
