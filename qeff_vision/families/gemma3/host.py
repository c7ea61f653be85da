"""Gemma 3 host protocol: one ``pixel_values`` row per image, ``mm_tokens_per_image`` placeholders each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision.errors import UserError
from qeff_vision.families.host import Host as BaseHost

TOKEN_TYPE_IDS = "token_type_ids"


class Host(BaseHost):
    """Placeholders per image from the processor's ``token_type_ids`` (1 on image tokens)."""

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Every image is ``mm_tokens_per_image`` placeholders: the processor's image tokens / images."""
        if TOKEN_TYPE_IDS not in processed:
            raise UserError("Gemma 3 prompts need the processor's token_type_ids (do not drop them)")
        images = np.asarray(processed["pixel_values"]).shape[0]
        placeholders = int(np.asarray(processed[TOKEN_TYPE_IDS]).sum())
        if images == 0 or placeholders % images:
            raise UserError(f"{placeholders} image tokens cannot be shared equally by {images} image(s)")
        return [placeholders // images] * images
