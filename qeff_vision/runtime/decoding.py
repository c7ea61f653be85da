"""The decode half of a :class:`~qeff_vision.runtime.generator.Generator`: the inputs of a one-token call.

After the prompt's prefill chunks, each call feeds one token at its position and takes no image
row (a seq_len-1 call merges none), so a placeholder id the model generates keeps its token
embedding, as in transformers. The engine (:mod:`qeff_vision.runtime.engine`) makes the calls:
one row per slot, also for a history's unfed tokens before a continued turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision.contract.language_io import Role

if TYPE_CHECKING:
    from qeff_vision.runtime.device_sampler import RequestDraws


class TokenDecoding:
    """Methods of :class:`~qeff_vision.runtime.generator.Generator` on the decode side (a mixin).

    They read the generator's ``host`` (decode positions), ``shape`` (``decode_vision_size``),
    ``language`` (whether it keeps vision rows resident), ``io`` (the language IO table),
    ``logits_name`` and ``eos_token_ids``, and call its ``step``, ``with_sampler_inputs`` and
    ``decode_vision_feeds``; the generator sets and defines them all.
    """

    def feed_token(
        self,
        token: int,
        position: np.ndarray,
        past: dict[str, np.ndarray],
        extra: Mapping[Role, np.ndarray] | None = None,
        draws: RequestDraws | None = None,
    ) -> dict:
        """One decode-shaped :meth:`step` of one sequence: ``token`` at ``position``, taking no image row.

        A seq_len-1 step merges no row (:func:`qeff_vision.export.decoder.vision_row_index`), so a
        placeholder id the model generated keeps its token embedding, as in transformers.

        Args:
            token: The token fed (the last one generated).
            position: Its position ids
                (:meth:`~qeff_vision.families.host.Host.decode_positions`).
            past: The sequence's batch-1 KV cache, updated by the call.
            extra: Further inputs of every decode step by role (:meth:`decode_extra`).
            draws: The sequence's request draws, for a program with the on-device sampler.

        Returns:
            The program's outputs by name; the next token's logits are ``[0, -1]`` of the logits.
        """
        feeds = self.decode_step_feeds(np.array([[token]], dtype=np.int64), position, extra)
        return self.step(self.with_sampler_inputs(feeds, [draws]), past)

    def decode_step_feeds(
        self, token_ids: np.ndarray, positions: np.ndarray, extra: Mapping[Role, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """Inputs of a decode-shaped call (seq_len 1, one row per sequence), the KV cache excluded.

        ``image_idx`` points past the decode rows (the call merges none); the decode rows are
        zeros sent on onnxruntime only (a device keeps the last chunk's vision_embeds resident).
        ``extra`` adds inputs by role (a cross-attention family's mask row).
        """
        by_role = {
            Role.TOKEN_IDS: token_ids,
            Role.POSITIONS: positions,
            Role.VISION_CURSOR: np.array([[self.shape.decode_vision_size]], dtype=np.int64),
        }
        if not self.language.retains_state:
            by_role[Role.VISION_ROWS] = self.decode_vision_feeds()
        by_role.update(extra or {})
        return self.io.feeds(by_role)

    def decode_extra(self, processed: Mapping[str, Any]) -> dict[Role, np.ndarray]:
        """Inputs by role every decode step of this request adds, one row (none for this kind)."""
        return {}
