"""Gemma 4 host protocol: each image's patch list as the processor pads it; audio refused.

The processor pads every image's patch list to the ``max_soft_tokens`` budget with (-1, -1)
positions (ref: transformers v5.23 models/gemma4/image_processing_gemma4.py,
``pad_along_first_dim``), and vLLM sends that padded list to the vision program as is. The vision
program is specialized on the budget (one specialization for every resolution) and masks the
padding, so the host sends the processor's list unchanged too; the program's output holds the
budget's rows, the image's own first (:meth:`Host.own_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.families.gemma4 import IMAGE_POSITION_IDS
from qeff_vision.families.host import Host as BaseHost

# Processor outputs of the modalities the exported programs do not take.
REFUSED = {"input_features": "audio", "pixel_values_videos": "video"}


class Host(BaseHost):
    """Padded patch lists; ``real patches / pooling_kernel_size**2`` placeholders (and own rows) each."""

    refused_inputs = REFUSED

    def _real_patches(self, processed: Mapping[str, Any]) -> list[int]:
        positions = np.asarray(processed[IMAGE_POSITION_IDS])
        return [int((positions[i] >= 0).all(axis=-1).sum()) for i in range(positions.shape[0])]

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per image: ``pixel_values`` [1, budget, 3 * patch**2], ``image_position_ids`` [1, budget, 2]."""
        self.refuse_other_modalities(processed)
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        positions = np.asarray(processed[IMAGE_POSITION_IDS], dtype=np.int64)
        return [
            {
                symbols.PIXEL_VALUES: np.ascontiguousarray(pixels[i : i + 1]),
                IMAGE_POSITION_IDS: np.ascontiguousarray(positions[i : i + 1]),
            }
            for i in range(positions.shape[0])
        ]

    def own_rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The image's soft tokens: the leading rows of its output (the rest pool padding)."""
        kernel = self.family.config(self.model).pooling_kernel_size
        real = int((np.asarray(inputs[IMAGE_POSITION_IDS])[0] >= 0).all(axis=-1).sum())
        return real // (kernel * kernel)

    def placeholder_counts(self, processed: Mapping[str, Any]) -> Sequence[int]:
        """Soft tokens per image: its real patches over the pooling kernel's area."""
        self.refuse_other_modalities(processed)
        kernel = self.family.config(self.model).pooling_kernel_size
        return [count // (kernel * kernel) for count in self._real_patches(processed)]
