"""Images whose placeholders are several runs (Mistral 3: ``[IMG_BREAK]`` after each row of ``[IMG]``).

The chunk-local rule is unchanged: chunk [a, b) sends rows P[a]..P[b], where P counts placeholder
tokens only; break tokens take no row. Checked against a brute-force count over random prompts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision.contract.segments import PlanError, Segment, find_segments
from qeff_vision.runtime.planner import PrefillBucket, plan_chunks

IMG, BREAK, END, TEXT = 7, 8, 9, 1


def image_tokens(rows: int, cols: int) -> list[int]:
    """Mistral 3's layout: each row of [IMG] ends with [IMG_BREAK], the last with [IMG_END]."""
    tokens = ([IMG] * cols + [BREAK]) * rows
    tokens[-1] = END
    return tokens


@st.composite
def prompts_with_rows(draw):
    """(token ids, rows x cols of each image) with text before, between and after images."""
    ids, grids = [TEXT] * draw(st.integers(0, 12)), []
    for _ in range(draw(st.integers(0, 3))):
        rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 6))
        ids += image_tokens(rows, cols) + [TEXT] * draw(st.integers(0, 10))
        grids.append((rows, cols))
    return ids or [TEXT], grids


def test_an_image_of_rows_is_one_span_with_a_run_per_row():
    ids = [TEXT, *image_tokens(3, 2), TEXT]
    (span,) = find_segments(ids, IMG, [6], multi_run=True)
    assert span == Segment(1, 6, ((1, 2), (4, 2), (7, 2)), placeholder_id=IMG)
    assert span.stop == 9 and [span.rows_before(x) for x in (1, 3, 4, 6, 9)] == [0, 2, 2, 4, 6]
    with pytest.raises(PlanError):
        find_segments(ids, IMG, [6])  # without multi_run, an image must be one run


def test_counts_that_leave_a_run_unfinished_are_refused():
    with pytest.raises(PlanError):
        find_segments([TEXT, *image_tokens(2, 2)], IMG, [3], multi_run=True)


@settings(max_examples=200, deadline=None)
@given(prompts_with_rows(), st.lists(st.integers(2, 24), min_size=1, max_size=3, unique=True))
def test_each_chunk_sends_exactly_the_rows_of_its_placeholders(prompt, seq_lens):
    ids, grids = prompt
    spans = find_segments(ids, IMG, [r * c for r, c in grids], multi_run=True)
    plan = plan_chunks(len(ids), spans, [PrefillBucket(s, s) for s in seq_lens])
    is_image = np.asarray(ids) == IMG
    assert plan.chunks[0].start == 0 and plan.chunks[-1].stop == len(ids)
    for chunk in plan:
        before, inside = int(is_image[: chunk.start].sum()), int(is_image[chunk.start : chunk.stop].sum())
        assert (chunk.row_start, chunk.row_stop) == (before, before + inside)
        assert sum(piece.stop - piece.start for piece in chunk.pieces) == inside
        assert all(piece.stop > piece.start for piece in chunk.pieces)


def test_an_image_kept_whole_needs_a_bucket_for_its_breaks_too():
    ids = [TEXT, *image_tokens(2, 3), TEXT]  # 6 placeholders over 7 tokens (one break between rows)
    spans = find_segments(ids, IMG, [6], multi_run=True)
    with pytest.raises(PlanError, match="7 tokens"):
        plan_chunks(len(ids), spans, [PrefillBucket(6, 6)], allow_image_split=False)
    plan = plan_chunks(len(ids), spans, [PrefillBucket(7, 6)], allow_image_split=False)
    assert [(chunk.start, chunk.stop, chunk.placeholders) for chunk in plan] == [
        (0, 1, 0),
        (1, 8, 6),
        (8, 10, 0),
    ]


# ---- segments: several placeholder ids, tokens that are not rows ----

VIDEO_ID = 5


def test_image_and_video_placeholders_are_segments_of_their_own_modality():
    # An image, a clip whose frames are two runs (timestamp text between them), then an image
    # right after the clip: rows are given in the order the items' first placeholders appear.
    ids = [TEXT, IMG, IMG, TEXT, VIDEO_ID, VIDEO_ID, TEXT, VIDEO_ID, VIDEO_ID, IMG, IMG, IMG, TEXT]
    segments = find_segments(ids, {IMG: "image", VIDEO_ID: "video"}, [2, 4, 3], multi_run=True)
    assert [(s.modality, s.placeholder_id, s.start, s.stop, s.rows) for s in segments] == [
        ("image", IMG, 1, 3, 2),
        ("video", VIDEO_ID, 4, 9, 4),
        ("image", IMG, 9, 12, 3),
    ]
    assert segments[1].token_runs == ((4, 2), (7, 2))
    # The chunk-local rule holds over both modalities: rows follow the placeholders in order.
    plan = plan_chunks(len(ids), segments, [(5, 5)])
    assert [(c.start, c.stop, c.row_start, c.row_stop) for c in plan] == [
        (0, 5, 0, 3),
        (5, 10, 3, 7),
        (10, 13, 7, 9),
    ]


def test_a_segment_whose_tokens_are_not_its_rows_is_never_split():
    # 4 placeholder tokens that consume 6 rows (no row per token): the segment goes whole into
    # one chunk even though the family allows splits, and its rows count once it is complete.
    segment = Segment(3, 6, ((3, 4),))
    assert not segment.divisible and segment.tokens == 4
    assert [segment.rows_before(x) for x in (3, 5, 7)] == [0, 0, 6]
    plan = plan_chunks(12, [segment], [(5, 8)], allow_image_split=True)
    assert [(c.start, c.stop, c.row_start, c.row_stop) for c in plan] == [
        (0, 3, 0, 0),
        (3, 8, 0, 6),
        (8, 12, 6, 6),
    ]
    with pytest.raises(PlanError, match="tokens and rows differ"):
        plan_chunks(12, [segment], [(3, 8)], allow_image_split=True)
