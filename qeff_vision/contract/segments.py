"""A prompt's multimodal segments: each image's or clip's placeholder tokens and embedding rows.

Pure and torch-free. :class:`Segment` describes one item; :func:`find_segments` reads the items
off a tokenized prompt. The chunk planner (:mod:`qeff_vision.runtime.planner`) takes them to
decide which rows each prefill call sends (see docs/design.md, "Segments").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qeff_vision.errors import UserError


class PlanError(UserError, ValueError):
    """The prompt, its image segments and the compiled buckets admit no valid chunk plan.

    Defined here, below the planner, because :func:`find_segments` raises it too (placeholder runs
    that cannot be cut into the given items).
    """


IMAGE = "image"
VIDEO = "video"


@dataclass(frozen=True)
class Segment:
    """One multimodal item of a prompt (an image, a clip): its placeholder tokens and embedding rows.

    A segment consumes ``rows`` rows of G (the per-item embeddings concatenated in prompt order)
    at its placeholder tokens. In a token-merge decoder each placeholder token takes one row, so
    tokens and rows are equal and a chunk may take any part of the segment. A segment whose
    tokens differ from its rows has no row per token: it is indivisible (the planner keeps it
    whole in one chunk) and its rows count as consumed once the whole segment is.

    Attributes:
        start: The first placeholder token.
        rows: Embedding rows it consumes.
        runs: ``(start, length)`` of each run of placeholders when they are not one contiguous run
            ``[start, start + rows)`` (Mistral 3 ends every row of image tokens with
            ``[IMG_BREAK]``, an ordinary token; a Qwen3-VL clip has timestamps between frames).
        modality: ``image`` or ``video``.
        placeholder_id: The placeholder token id of its runs (None when not known).
        joined: It shares a chunk with the previous segment, with every token between them (Molmo2:
            every image token of a prompt attends to every other one both ways, across images).
    """

    start: int
    rows: int
    runs: tuple[tuple[int, int], ...] = ()
    modality: str = IMAGE
    placeholder_id: int | None = None
    joined: bool = False

    @property
    def token_runs(self) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of every run of the segment's placeholders, in prompt order."""
        return self.runs or ((self.start, self.rows),)

    @property
    def tokens(self) -> int:
        """Placeholder tokens of the segment (break tokens between runs excluded)."""
        return sum(length for _, length in self.token_runs)

    @property
    def divisible(self) -> bool:
        """One row per placeholder token: a chunk boundary may fall inside the segment."""
        return self.tokens == self.rows

    @property
    def stop(self) -> int:
        """One past the segment's last placeholder token."""
        start, length = self.token_runs[-1]
        return start + length

    def rows_before(self, position: int) -> int:
        """Rows of the segment consumed by the tokens in [0, position)."""
        if not self.divisible:
            return self.rows if position >= self.stop else 0
        return sum(min(max(position - start, 0), length) for start, length in self.token_runs)

    def token_of_row(self, row: int) -> int:
        """The token that carries row ``row`` (0-based, < rows); an indivisible segment's start."""
        if not self.divisible:
            return self.start
        for start, length in self.token_runs:
            if row < length:
                return start + row
            row -= length
        raise IndexError(f"row {row} beyond the segment's {self.rows} rows")


def _placeholder_runs(ids: np.ndarray, placeholder: int) -> list[tuple[int, int]]:
    marked = np.concatenate(([False], ids == placeholder, [False]))
    edges = np.flatnonzero(np.diff(marked.astype(np.int8)))
    return [(int(start), int(stop)) for start, stop in zip(edges[0::2], edges[1::2])]


def find_segments(
    token_ids: Sequence[int] | np.ndarray,
    placeholders: int | Mapping[int, str],
    rows_per_item: Sequence[int] | None = None,
    *,
    multi_run: bool = False,
) -> list[Segment]:
    """The segments of a tokenized prompt: its images and clips, in prompt order.

    Two items' placeholder runs can be adjacent (nothing between them), so one run of a
    placeholder id may hold several items. With ``rows_per_item`` (per item in prompt order,
    e.g. from the family's token math) each run is cut into consecutive items of those sizes;
    without it every maximal run is taken as one item. With ``multi_run`` an item may also go on
    over the following runs of its id (its placeholders interleaved with other tokens, as Mistral
    3's rows are with ``[IMG_BREAK]``); the segment then lists its runs. Several placeholder ids
    may coexist (image and video): a segment's runs are all of one id, and the items of
    ``rows_per_item`` are taken in the order their first placeholders appear.

    Args:
        token_ids: The prompt's token ids, 1-D.
        placeholders: The placeholder id, or placeholder id -> modality (``image``, ``video``).
        rows_per_item: Embedding rows of each item, in prompt order, when known.
        multi_run: One item may cover several runs (needs ``rows_per_item``).

    Returns:
        One :class:`Segment` per item, in prompt order.

    Raises:
        PlanError: The runs cannot be cut into items of the given sizes.
    """
    ids = np.asarray(token_ids).reshape(-1)
    kinds = {placeholders: IMAGE} if isinstance(placeholders, (int, np.integer)) else dict(placeholders)
    runs = sorted((run, int(token)) for token in kinds for run in _placeholder_runs(ids, token))
    if rows_per_item is None:
        return [Segment(start, stop - start, (), kinds[token], token) for (start, stop), token in runs]
    segments: list[Segment] = []
    items = iter(enumerate(rows_per_item))
    pending: dict[int, tuple[list[tuple[int, int]], int, int]] = {}  # id -> (runs, rows, still needed)
    for (run_start, run_stop), token in runs:
        position = run_start
        while position < run_stop:
            if token not in pending:
                number, rows = next(items, (len(segments) + len(pending), None))
                if rows is None or rows < 1 or (not multi_run and position + rows > run_stop):
                    raise PlanError(
                        f"placeholder runs {[run for run, _ in runs]} cannot be cut into items of "
                        f"{list(rows_per_item)} rows (item {number} does not fit the run at {run_start})"
                    )
                pending[token] = ([], rows, rows)
            taken, total, needed = pending[token]
            take = min(needed, run_stop - position)
            taken.append((position, take))
            position, needed = position + take, needed - take
            pending[token] = (taken, total, needed)
            if not needed:
                del pending[token]
                one_run = len(taken) == 1
                segments.append(
                    Segment(taken[0][0], total, () if one_run else tuple(taken), kinds[token], token)
                )
    if pending or len(segments) != len(rows_per_item):
        raise PlanError(
            f"the prompt has {sum(stop - start for (start, stop), _ in runs)} placeholder tokens of "
            f"id(s) {sorted(kinds)} but {len(rows_per_item)} items of {list(rows_per_item)} rows were given"
        )
    segments.sort(key=lambda segment: segment.start)
    return segments
