"""Choosing the next token: greedy by default, or sampled per request with vLLM's parameters.

The request's :class:`~qeff_vision.inputs.sampling_params.SamplingParams` (vLLM's names; greedy
by default, which every parity test runs) drive its own :class:`TokenSampler` (its tokens so far,
its random generator), so its tokens depend on its own logits and seed only, never on which other
requests share its engine steps, and one seed gives the same tokens run after run.

The order follows vLLM's v1 sampler (ref: vllm-project/vllm ``vllm/v1/sample/sampler.py``,
``ops/penalties.py``, ``ops/topk_topp_sampler.py``): penalties on the raw logits (repetition over
the prompt and the output, presence over the output), greedy is the argmax of those; otherwise
divide by the temperature, drop tokens under ``min_p`` x the top probability, keep the ``top_k``
most likely and the smallest set whose probability reaches ``top_p``, renormalize and draw. The
draw here uses one uniform number per token (inverse CDF over the kept tokens, most likely first,
ties by token id): the random input an on-device sampler would take per sequence and step.

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qeff_vision.inputs.sampling_params import GREEDY, SamplingParams


def greedy_token(logits: np.ndarray) -> int:
    """The most likely token of one logits row (the first on a tie, as ``torch.argmax``)."""
    return int(np.argmax(logits))


class TokenSampler:
    """One request's token choice: its parameters, the tokens so far and its random generator.

    Args:
        params: The request's sampling parameters (greedy when None).
        prompt_ids: The prompt's token ids (the repetition penalty counts them).
    """

    def __init__(self, params: SamplingParams | None = None, prompt_ids: Sequence[int] | np.ndarray = ()):
        self.params = params if params is not None else GREEDY
        self._prompt = np.unique(np.asarray(prompt_ids, dtype=np.int64).reshape(-1))
        self._output: list[int] = []
        self._rng = np.random.default_rng(self.params.seed) if not self.params.greedy else None

    def next_token(self, logits: np.ndarray) -> int:
        """The token chosen from one logits row (the last position's), recorded as generated."""
        token = self._choose(np.asarray(logits, dtype=np.float64).reshape(-1))
        self._output.append(token)
        return token

    def _choose(self, logits: np.ndarray) -> int:
        params = self.params
        logits = self._penalized(logits)
        if params.greedy:
            return greedy_token(logits)
        scaled = logits / params.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        kept = candidate_tokens(probs, params.top_k, params.top_p, params.min_p)
        weights = probs[kept] / probs[kept].sum()
        draw = self._rng.random()
        index = int(np.searchsorted(np.cumsum(weights), draw, side="right"))
        return int(kept[min(index, len(kept) - 1)])

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        params = self.params
        if params.repetition_penalty == 1.0 and params.presence_penalty == 0.0:
            return logits
        logits = logits.copy()
        output = np.unique(np.asarray(self._output, dtype=np.int64))
        if params.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt, output)
            values = logits[seen]
            logits[seen] = np.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if params.presence_penalty:
            logits[output] -= params.presence_penalty
        return logits


def candidate_tokens(probs: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The tokens a draw may pick, most likely first (ties by token id): min-p, then top-k, then top-p.

    Args:
        probs: One row of probabilities (after the temperature).
        top_k: Keep this many (0 or -1: all).
        top_p: Keep the smallest prefix whose probability reaches it.
        min_p: Drop tokens below ``min_p`` x the largest probability.
    """
    order = np.lexsort((np.arange(len(probs)), -probs))  # descending, stable by token id
    if min_p > 0:
        order = order[probs[order] >= min_p * probs[order[0]]]
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        mass = np.cumsum(probs[order]) / probs[order].sum()
        # The first token whose running mass reaches top_p closes the set (always one token at least).
        order = order[: int(np.searchsorted(mass, top_p, side="left")) + 1]
    return order
