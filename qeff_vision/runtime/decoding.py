"""The decode half of a :class:`~qeff_vision.runtime.generator.Generator`: one token per call.

After the prompt's prefill chunks, each call feeds one token at its position and takes no image
row (a seq_len-1 call merges none), so a placeholder id the model generates keeps its token
embedding, as in transformers. The same decode-shaped calls continue a conversation after a
previous turn (the history's unfed tokens) and, one row per slot, serve the batched engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qeff_vision.contract.language_io import Role
from qeff_vision.runtime.continuation import Continuation
from qeff_vision.runtime.device_sampler import last_rows, pick
from qeff_vision.runtime.sampling import TokenSampler


class TokenDecoding:
    """Methods of :class:`~qeff_vision.runtime.generator.Generator` on the decode side (a mixin).

    They read the generator's ``host`` (decode positions), ``shape`` (``decode_vision_size``),
    ``language`` (whether it keeps vision rows resident), ``io`` (the language IO table),
    ``logits_name`` and ``eos_token_ids``, and call its ``step`` and ``decode_vision_feeds``; the
    generator sets and defines them all.
    """

    def _feed_history(self, history: Continuation, past: dict[str, np.ndarray]) -> np.ndarray:
        """Feed a history's unfed generated tokens; the position of the next token."""
        steps = history.fed_steps
        for token in history.unfed:
            position = self.host.decode_positions(history.positions, steps)
            self.feed_token(token, position, past, history.decode_feeds)
            steps += 1
        return self.host.decode_positions(history.positions, steps)

    def feed_token(
        self,
        token: int,
        position: np.ndarray,
        past: dict[str, np.ndarray],
        extra: Mapping[Role, np.ndarray] | None = None,
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

        Returns:
            The program's outputs by name; the next token's logits are ``[0, -1]`` of the logits.
        """
        feeds = self.decode_step_feeds(np.array([[token]], dtype=np.int64), position, extra)
        return self.step(feeds, past)

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

    def _decode(
        self,
        token: int,
        positions: np.ndarray,
        past: dict[str, np.ndarray],
        max_new_tokens: int,
        on_token: Callable[[int], None] | None,
        kept: list[np.ndarray] | None,
        extra: Mapping[Role, np.ndarray] | None = None,
        sampler: TokenSampler | None = None,
    ) -> list[int]:
        """Decode after the prefill's first token; appends each logits row to ``kept`` if given.

        ``extra``: further inputs of every decode step by role (:meth:`feed_token`). ``sampler``:
        the request's token choice (greedy when None).
        """
        sampler = sampler if sampler is not None else TokenSampler()
        tokens = [token]
        for step in range(max_new_tokens - 1):
            if token in self.eos_token_ids:
                break
            outputs = self.feed_token(token, self.host.decode_positions(positions, step), past, extra)
            if kept is not None:
                kept.append(outputs[self.logits_name][0, -1].copy())
            token = pick(sampler, last_rows(outputs, self.logits_name)[0])  # logits, or the device's token
            tokens.append(token)
            if on_token:
                on_token(token)
        return tokens
