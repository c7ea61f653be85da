"""Gemma 4 host protocol: each image's patch list without its padding; audio refused.

The processor pads every image's patch list to the ``max_soft_tokens`` budget with (-1, -1)
positions (ref: transformers v5.23 models/gemma4/image_processing_gemma4.py,
``pad_along_first_dim``). The vision program is specialized on an image's exact patch count, so
the host sends only the real patches: the tower then never strips rows, and a padded row can never
reach ``vision_embeds``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families.gemma4 import IMAGE_POSITION_IDS
from qeff_vision.families.host import Host as BaseHost

# Processor outputs of the modalities the exported programs do not take.
REFUSED = {"input_features": "audio", "pixel_values_videos": "video"}


class Host(BaseHost):
    """Patch lists stripped of padding; ``patches / pooling_kernel_size**2`` placeholders each."""

    def refuse_other_modalities(self, processed: Mapping[str, Any]) -> None:
        """Raise the one-line user error for audio or video inputs."""
        for key, modality in REFUSED.items():
            if key in processed:
                raise UserError(f"Gemma 4 {modality} input is not supported: only images and text export")

    def has_images(self, processed: Mapping[str, Any]) -> bool:
        """Pixels present (after refusing audio and video)."""
        self.refuse_other_modalities(processed)
        return super().has_images(processed)

    def _real_patches(self, processed: Mapping[str, Any]) -> list[int]:
        positions = np.asarray(processed[IMAGE_POSITION_IDS])
        return [int((positions[i] >= 0).all(axis=-1).sum()) for i in range(positions.shape[0])]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: ``pixel_values`` [1, patches, 3 * patch**2], ``image_position_ids`` [1, patches, 2]."""
        self.refuse_other_modalities(processed)
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        positions = np.asarray(processed[IMAGE_POSITION_IDS], dtype=np.int64)
        return [
            {
                symbols.PIXEL_VALUES: np.ascontiguousarray(pixels[i : i + 1, :count]),
                IMAGE_POSITION_IDS: np.ascontiguousarray(positions[i : i + 1, :count]),
            }
            for i, count in enumerate(self._real_patches(processed))
        ]

    def placeholder_counts(self, processed: Mapping[str, Any]) -> Sequence[int]:
        """Soft tokens per image: its real patches over the pooling kernel's area."""
        self.refuse_other_modalities(processed)
        kernel = self.family.config(self.model).pooling_kernel_size
        return [count // (kernel * kernel) for count in self._real_patches(processed)]
