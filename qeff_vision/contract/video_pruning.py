"""Video token pruning (EVS, Efficient Video Sampling): the rate and how many rows a clip keeps.

Pure and torch-free, so the spec layer can size ``vision_size`` for pruned clips before anything
is encoded: the number of kept rows depends only on the clip's merged grid and the rate (ref:
vLLM v0.33.0 ``vllm/multimodal/video_prune/evs.py``, ``compute_retained_tokens_count``). Which
rows are kept is decided by the host from the vision program's output
(:mod:`qeff_vision.runtime.video_pruning`).

Processor outputs of a pruned prompt carry three extra entries, named here so the family hosts,
the runtime and the reference agree on them without importing each other: :data:`KEPT_ROWS`
(rows each clip keeps, in the processor's clip order), :data:`PRUNED_POSITIONS` (the recomputed
position ids of the pruned prompt) and :data:`RETENTION` (the masks themselves).
"""

from __future__ import annotations

import math

from qeff_vision.errors import UserError

#: Spec key (under ``vision:``) and run option.
OPTION = "video_pruning_rate"
#: Processed-prompt entry: int64 [clips], the rows each clip keeps (processor clip order).
KEPT_ROWS = "video_pruning_kept_rows"
#: Processed-prompt entry: the pruned prompt's position ids, as the family's ``prompt_positions`` shapes them.
PRUNED_POSITIONS = "video_pruning_positions"
#: Processed-prompt entry: bool [rows of all clips]: which rows each clip keeps, clips concatenated.
RETENTION = "video_pruning_retention"
#: The entries above (not processor outputs: a transformers model must not be given them).
ENTRIES = (KEPT_ROWS, PRUNED_POSITIONS, RETENTION)


def rate_problem(rate: object) -> str | None:
    """Why ``rate`` is not a pruning rate (None when it is): a number in [0, 1).

    vLLM's ``MultiModalConfig.video_pruning_rate`` has the same bounds (``ge=0.0, lt=1.0``); a rate
    of 1 would keep only the first frame, which the retained count guarantees anyway.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        return f"{OPTION} must be a number in [0, 1) (got {rate!r})"
    if not math.isfinite(rate) or not 0.0 <= rate < 1.0:
        return f"{OPTION} must be in [0, 1) (0 disables pruning; got {rate!r})"
    return None


def check_rate(rate: object) -> float:
    """``rate`` as a float; :class:`UserError` (one line) when it is outside [0, 1)."""
    problem = rate_problem(rate)
    if problem:
        raise UserError(problem)
    return float(rate)


def kept_rows(frames: int, rows_per_frame: int, rate: float) -> int:
    """Rows a clip of ``frames`` merged temporal patches of ``rows_per_frame`` rows keeps at ``rate``.

    ``int(total * (1 - rate))`` in Python floats, never fewer than one whole frame (EVS keeps the
    first temporal patch whole). Rate 0 keeps every row.
    """
    total = rows_per_frame * frames
    return max(rows_per_frame, int(total * (1 - rate)))
