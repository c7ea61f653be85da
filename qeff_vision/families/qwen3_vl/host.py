"""Qwen3-VL host protocol: Qwen2.5-VL's, but a clip's temporal patches are positioned like images."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
