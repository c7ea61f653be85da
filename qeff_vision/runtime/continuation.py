"""Where a finished generation left the language program, so a later turn can continue it.

A chat turn generates tokens; the last one is never fed back (generation stops after choosing
it). A later turn continues from the same KV cache, as a transformers user continues ``generate``
from ``past_key_values``: the tokens generated but never fed go first, one decode-shaped step each
(``image_idx`` at the end of the rows, so a generated placeholder id takes no image row), then the
new turn's own tokens in prefill chunks, whose placeholders are only the new turn's images.

Positions continue where the history stopped: the new turn's positions are computed for its own
tokens (starting at 0 with text, as every chat turn does) and shifted so its first token gets the
position the next decode step would have had (every M-RoPE row included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qeff_vision.contract.language_io import Role


@dataclass
class Continuation:
    """The state a :meth:`Generator.generate` call left behind (pass it as ``history=`` to continue).

    Attributes:
        past: Host-held KV cache after the call (empty when the device retains it).
        positions: Positions of the call's prompt (already shifted for a continued turn).
        fed_steps: Decode steps fed after that prompt.
        unfed: Generated tokens not fed yet (the last one), fed first by the next turn.
        decode_feeds: Extra inputs every decode step of this history takes, by language IO role
            (a cross-attention family's last ``cross_attention_mask`` row under
            ``Role.CROSS_MASK``); empty for token-merge families.
    """

    past: dict[str, np.ndarray]
    positions: np.ndarray
    fed_steps: int
    unfed: tuple[int, ...] = field(default_factory=tuple)
    decode_feeds: dict[Role, np.ndarray] = field(default_factory=dict)


def continued_positions(local: np.ndarray, first: np.ndarray) -> np.ndarray:
    """``local`` prompt positions shifted so their first token sits at ``first``.

    Args:
        local: The new turn's positions as if it were a whole prompt: [1, L] or [R, 1, L], with
            every row 0 at the first token (a turn starts with text).
        first: The position of the next token after the history ([1, 1] or [R, 1, 1]), what the
            family's ``decode_positions`` gives.

    Returns:
        Positions with the shape of ``local``.
    """
    return (local + (np.asarray(first) - local[..., :1])).astype(np.int64)
