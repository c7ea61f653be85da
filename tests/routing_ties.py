"""Expert-routing near-ties of a transformers MoE model, and its reference with one tie taken the other way.

A mixture-of-experts layer picks its experts with ``topk`` of the router's scores (``torch.topk`` or
``Tensor.topk`` in every MoE family transformers ships: Llama 4's ``Llama4Router``, Qwen3-VL-MoE's
and Qwen3.5-MoE's routers, Gemma 4's, DeepSeek-V3's as Kimi-K2.5 uses it). Where the last chosen
expert and the first unchosen one score closer in fp32 than transformers' own bf16 run moves
their difference, the choice is decided by rounding: a bf16 run may take either expert, and the
step's logits jump (a discrete flip, not a drift). This is the expert-level form of the token
rule of the parity tests (a token may differ where the top-1/top-2 margin is within twice the
deviation).

:func:`routing_ties` finds such ties in a teacher-forced run (fp32 and bf16 record every ``topk``
call in the same order); :func:`swapped_references` reruns transformers with one tie taken the
other way (the chosen expert replaced by the runner-up, at that call and token), in fp32 and bf16.
A device run that took the other branch then agrees with these references to within the usual bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qeff_vision.reference import reference_teacher_forced


@dataclass(frozen=True)
class RoutingTie:
    """One ``topk`` choice decided by rounding.

    Attributes:
        call: Index of the ``topk`` call in the run (the same in fp32 and bf16).
        step: The teacher-forced step (forward pass) the call belongs to; 0 is the prompt.
        row: The token row of the call's input.
        chosen: The expert chosen in fp32 (the k-th best).
        runner_up: The best expert not chosen in fp32 (the (k+1)-th).
        gap: fp32 score of ``chosen`` minus that of ``runner_up``.
        shift: How much transformers' bf16 run moves that difference (|bf16 gap - fp32 gap|).
    """

    call: int
    step: int
    row: int
    chosen: int
    runner_up: int
    gap: float
    shift: float


@contextmanager
def _topk_through(hook: Callable):
    """``torch.topk`` and ``Tensor.topk`` call ``hook(call, x, k, dim, largest, result)`` for their result."""
    original = torch.topk
    method = torch.Tensor.topk
    calls = [0]

    def patched(x, k, dim=-1, largest=True, sorted=True, **kwargs):
        result = original(x, k, dim=dim, largest=largest, sorted=sorted, **kwargs)
        index = calls[0]
        calls[0] += 1
        return hook(index, x, k, dim, largest, result)

    torch.topk = patched
    torch.Tensor.topk = lambda self, k, *args, **kwargs: patched(self, k, *args, **kwargs)
    try:
        yield calls
    finally:
        torch.topk = original
        torch.Tensor.topk = method


def _recorded_run(model, inputs, tokens, dtype) -> tuple[list[np.ndarray], list[tuple]]:
    """Teacher-forced logits and every ``topk`` call's (scores [rows, n] float64, k) or None."""
    recorded: list[tuple | None] = []

    def record(index, x, k, dim, largest, result):
        last = dim in (-1, x.dim() - 1)
        scores = x.detach().reshape(-1, x.shape[-1]).double().numpy().copy() if last and largest else None
        recorded.append(None if scores is None else (scores, int(k)))
        return result

    with _topk_through(record):
        rows = reference_teacher_forced(model, inputs, tokens, dtype)
    return rows, recorded


def routing_ties(model, inputs: Mapping[str, Any], tokens: Sequence[int]) -> list[RoutingTie]:
    """Every ``topk`` choice of the teacher-forced run whose fp32 margin is within bf16's own shift.

    Sorted by ``gap / shift`` (the closest tie first). Empty for a model that calls no ``topk``.
    """
    _, fp32 = _recorded_run(model, inputs, tokens, None)
    _, bf16 = _recorded_run(model, inputs, tokens, "bfloat16")
    if not fp32 or len(fp32) != len(bf16) or len(fp32) % len(tokens):
        return []
    per_step = len(fp32) // len(tokens)
    ties = []
    for call, (exact, rounded) in enumerate(zip(fp32, bf16)):
        if exact is None or rounded is None or exact[0].shape != rounded[0].shape:
            continue
        (scores, k), (scores_bf16, _) = exact, rounded
        if k >= scores.shape[-1]:
            continue
        for row in range(scores.shape[0]):
            order = np.argsort(-scores[row], kind="stable")
            chosen, runner_up = int(order[k - 1]), int(order[k])
            gap = scores[row, chosen] - scores[row, runner_up]
            shift = abs(scores_bf16[row, chosen] - scores_bf16[row, runner_up] - gap)
            if gap < shift:
                step = call // per_step
                ties.append(RoutingTie(call, step, row, chosen, runner_up, float(gap), float(shift)))
    return sorted(ties, key=lambda tie: tie.gap / tie.shift)


def swapped_references(
    model, inputs: Mapping[str, Any], tokens: Sequence[int], tie: RoutingTie
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Teacher-forced (fp32, bf16) logits with ``tie``'s expert replaced by its runner-up."""

    def swap(index, x, k, dim, largest, result):
        if index != tie.call:
            return result
        values, indices = result
        flat_values = values.reshape(-1, values.shape[-1]).clone()
        flat_indices = indices.reshape(-1, indices.shape[-1]).clone()
        flat_scores = x.reshape(-1, x.shape[-1])
        where = flat_indices[tie.row] == tie.chosen
        flat_indices[tie.row][where] = tie.runner_up
        flat_values[tie.row][where] = flat_scores[tie.row, tie.runner_up]
        return torch.return_types.topk((flat_values.view_as(values), flat_indices.view_as(indices)))

    runs = []
    for dtype in (None, "bfloat16"):
        with _topk_through(swap):
            runs.append(reference_teacher_forced(model, inputs, tokens, dtype))
    return runs[0], runs[1]
