"""QEfficient's sampler math on the host: what the tests hold the compiled sampler to.

:func:`gumbel_max_tokens` is the graph's computation in numpy (float32, the same order and
tie-breaking), and :class:`GumbelMaxSampler` a request's host sampler that consumes the same
random numbers: given equal logits and ``random_numbers`` it picks the token the compiled sampler
picks (docs/design.md, "On-device sampler").
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qeff_vision.contract.sampler_io import (
    MIN_PS,
    PRESENCE_PENALTIES,
    RANDOM_NUMBERS,
    REPETITION_PENALTIES,
    TEMPERATURES,
    TOP_KS,
    TOP_PS,
)
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.device_sampler import parameter_row

# QEfficient's mask value (float16's minimum).
MASKED = np.float32(np.finfo(np.float16).min)


def gumbel_max_tokens(
    logits: np.ndarray,
    repetition_seen: np.ndarray,
    presence_seen: np.ndarray,
    feeds: Mapping[str, np.ndarray],
    max_top_k_ids: int,
    token_bitmasks: np.ndarray | None = None,
) -> np.ndarray:
    """QEfficient's sampler on the host: [rows] tokens from logits [rows, vocab] (float32 throughout).

    Args:
        logits: [rows, vocab] the last position's logits of each row.
        repetition_seen: [rows, vocab] the row's slot's repetition buffer (prompt and output).
        presence_seen: [rows, vocab] the row's slot's presence buffer (output).
        feeds: The sampler inputs by name (``tests/sampler_harness.py`` ``DeviceSampler.feeds``).
        max_top_k_ids: The sampler's top-k width.
        token_bitmasks: [rows, vocab] allowed tokens (guided decoding), or None.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if token_bitmasks is not None:
        logits = np.where(token_bitmasks, logits, MASKED)
    penalty = np.where(repetition_seen, feeds[REPETITION_PENALTIES], np.float32(1.0)).astype(np.float32)
    logits = logits * np.power(penalty, -np.sign(logits)).astype(np.float32)
    logits = logits - feeds[PRESENCE_PENALTIES] * presence_seen.astype(np.float32)
    greedy = np.argmax(logits, axis=1)
    temperatures = feeds[TEMPERATURES].astype(np.float32)
    safe = np.where(temperatures != 0, temperatures, np.float32(1.0))
    logits = np.where(temperatures != 0, logits / safe, logits).astype(np.float32)
    k = max_top_k_ids
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # descending, ties to the lower id
    indices = order[:, ::-1]  # ascending
    values = np.take_along_axis(logits, indices, axis=1)
    top_ks = np.minimum(feeds[TOP_KS].astype(np.int64), k)
    columns = np.arange(k).reshape(1, -1)
    values = np.where(columns < k - top_ks, MASKED, values)
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    probs = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    top_p_mask = (np.cumsum(probs, axis=1, dtype=np.float32) <= 1 - feeds[TOP_PS]) & (columns < k - 1)
    values = np.where(top_p_mask, MASKED, values)
    values = np.where(probs < feeds[MIN_PS] * probs[:, k - 1 :], MASKED, values)
    gumbel = -np.log(-np.log(np.asarray(feeds[RANDOM_NUMBERS], dtype=np.float32)))
    drawn = np.take_along_axis(indices, np.argmax(values + gumbel, axis=1).reshape(-1, 1), axis=1)[:, 0]
    return np.where(temperatures[:, 0] == 0, greedy, drawn).astype(np.int64)


class GumbelMaxSampler:
    """One request's host sampler in the compiled sampler's form: same inputs, same token.

    It keeps the request's prompt and output tokens as the device keeps its penalty buffers, and
    takes the ``random_numbers`` row the device is fed.

    Args:
        params: The request's parameters.
        prompt_ids: The prompt's token ids (the repetition buffer's start).
        vocab_size: The vocabulary.
        max_top_k_ids: The sampler's top-k width.
    """

    def __init__(self, params: SamplingParams, prompt_ids, vocab_size: int, max_top_k_ids: int):
        self.params, self.max_top_k_ids = params, max_top_k_ids
        self.repetition = np.zeros(vocab_size, dtype=bool)
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self.repetition[ids[ids < vocab_size]] = True  # an input-only placeholder id is no logit
        self.presence = np.zeros(vocab_size, dtype=bool)

    def next_token(self, logits: np.ndarray, random_numbers: np.ndarray) -> int:
        """The token for one logits row and its random numbers [max_top_k_ids]; recorded as output."""
        row = parameter_row(self.params, self.max_top_k_ids)
        feeds = {
            name: np.array([[value]], dtype=np.int32 if name == TOP_KS else np.float32)
            for name, value in row.items()
        }
        feeds[RANDOM_NUMBERS] = np.asarray(random_numbers, dtype=np.float32).reshape(1, -1)
        logits = np.asarray(logits).reshape(1, -1)
        return int(
            gumbel_max_tokens(logits, self.repetition[None], self.presence[None], feeds, self.max_top_k_ids)[
                0
            ]
        )

    def accept(self, token: int) -> None:
        """``token`` was generated: the next step penalizes it (QEfficient marks the fed token)."""
        self.repetition[token] = True
        self.presence[token] = True
