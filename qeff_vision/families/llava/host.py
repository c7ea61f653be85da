"""LLaVA-1.5 host protocol: one ``pixel_values`` row and the same placeholder count per image."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qeff_vision.families.host import Host as BaseHost


class Host(BaseHost):
    """Every image becomes ``tokens_per_image`` placeholders, whatever its resolution."""

    def placeholder_counts(self, processed: Mapping[str, Any]) -> list[int]:
        """Every image becomes the same number of placeholders: the family's token math."""
        images = np.asarray(processed["pixel_values"]).shape[0]
        return [self.family.tokens_per_image(self.model)] * images
