"""Qwen3-VL host protocol: Qwen2.5-VL's, but a clip's temporal patches are positioned like images."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision.families.qwen2_5_vl.host import Host as Qwen2_5_VLHost


class Host(Qwen2_5_VLHost):
    """Frames as timestamped runs (ref: Qwen3VLModel.get_rope_index)."""

    def position_items(self, processed: Mapping[str, Any]):
        """Like Qwen2.5-VL's, but a clip is one (1, h, w) item per temporal patch.

        Each frame is its own placeholder run after its timestamp text, positioned like an image.
        """
        items = []
        for (grid_t, grid_h, grid_w), offsets in super().position_items(processed):
            items += [((1, grid_h, grid_w), offsets[:1] * 0)] * grid_t
        return items

    def pruned_positions(self, processed: Mapping[str, Any], keep: np.ndarray, masks) -> np.ndarray:
        """The unpruned prompt's positions at the kept tokens; row 0 (the KV slot) counts them.

        vLLM's 5-channel recomputation (ref: vLLM v0.33.0 ``recompute_mrope_positions`` with
        ``Qwen3VLForConditionalGeneration._get_expanded_positions``) places a clip's kept rows and
        its timestamp/marker tokens at their unpruned positions relative to the clip's first
        timestamp, and resumes after the clip at its largest position + 1, the last frame's
        vision end, as unpruned; an image is placed as unpruned too. So nothing moves but the
        dropped rows.
        """
        positions = self.prompt_positions(processed)[..., keep]
        positions[0] = np.arange(positions.shape[-1], dtype=np.int64)
        return np.ascontiguousarray(positions)
