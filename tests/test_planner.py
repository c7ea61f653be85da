"""Chunk planner: hypothesis properties over random prompts and buckets, then the named edge cases."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision.contract.segments import PlanError, Segment, find_segments
from qeff_vision.errors import UserError
from qeff_vision.runtime.planner import (
    ChunkEnd,
    PrefillBucket,
    VisionProtocol,
    assemble_vision_embeds,
    plan_chunks,
)

PLACEHOLDER = 7


# ---- strategies and a reference model of the protocol ----


@st.composite
def prompts(draw, max_len: int = 400, max_images: int = 5):
    """(L, spans): disjoint spans in prompt order, adjacent ones included."""
    length = draw(st.integers(1, max_len))
    count = draw(st.integers(0, max_images))
    points = sorted(draw(st.lists(st.integers(0, length), min_size=2 * count, max_size=2 * count)))
    spans = [Segment(a, b - a) for a, b in zip(points[0::2], points[1::2]) if b > a]
    return length, spans


@st.composite
def bucket_sets(draw, max_seq_len: int = 160):
    """1-4 buckets with distinct seq_len; vision_size may be below S (integer policy) or above it."""
    seq_lens = draw(st.lists(st.integers(1, max_seq_len), min_size=1, max_size=4, unique=True))
    return [PrefillBucket(s, draw(st.integers(1, 2 * s))) for s in seq_lens]


def placeholders_before(spans, position):
    return sum(min(span.rows, max(0, position - span.start)) for span in spans)


def row_of_token(spans):
    """Global row of G for each placeholder token position."""
    rows, row = {}, 0
    for span in spans:
        for position in range(span.start, span.stop):
            rows[position] = row
            row += 1
    return rows


def image_embeddings(spans, hidden=2):
    """Per image [rows, hidden], row r of G holding the value r + 1 (0 is padding)."""
    out, row = [], 0
    for span in spans:
        values = np.arange(row + 1, row + span.rows + 1, dtype=np.int64)
        out.append(np.repeat(values[:, None], hidden, axis=1))
        row += span.rows
    return out


def image_fits(span, buckets, protocol):
    return any(b.seq_len >= span.rows and (protocol == "full" or b.vision_size >= span.rows) for b in buckets)


def feasible(spans, buckets, protocol, allow_split, a, b):
    if not allow_split and any(s.start < b < s.stop for s in spans):
        return False
    rows = placeholders_before(spans, b) - placeholders_before(spans, a)
    return any(bk.seq_len >= b - a and (protocol == "full" or bk.vision_size >= rows) for bk in buckets)


def fewest_chunks(length, spans, buckets, protocol, allow_split):
    """Brute-force minimum number of chunks (dynamic programming over every cut)."""

    @functools.cache
    def best(a):
        if a == length:
            return 0
        options = [
            1 + best(b)
            for b in range(a + 1, length + 1)
            if feasible(spans, buckets, protocol, allow_split, a, b)
        ]
        return min(options, default=10**9)

    return best(0)


def check_plan(plan, length, spans, buckets, protocol, allow_split):
    """Every invariant of a plan; returns nothing, asserts everything."""
    chunks = plan.chunks
    total = sum(span.rows for span in spans)
    by_key = sorted(buckets, key=lambda b: (b.seq_len, b.vision_size))
    usable = [b for b in by_key if protocol == "chunk" or b.vision_size >= total]

    # Chunks cover [0, L) contiguously, each non-empty and within its bucket.
    assert chunks[0].start == 0 and chunks[-1].stop == length
    for index, chunk in enumerate(chunks):
        assert chunk.index == index
        assert 0 < chunk.tokens <= chunk.seq_len
        assert chunk.rows <= chunk.vision_size
        assert PrefillBucket(chunk.seq_len, chunk.vision_size) in usable
        if index:
            assert chunk.start == chunks[index - 1].stop
        # The bucket is the smallest usable one that holds the chunk.
        holds = [
            b
            for b in usable
            if b.seq_len >= chunk.tokens and (protocol == "full" or b.vision_size >= chunk.placeholders)
        ]
        assert PrefillBucket(chunk.seq_len, chunk.vision_size) == holds[0]
        assert chunk.placeholders == placeholders_before(spans, chunk.stop) - placeholders_before(
            spans, chunk.start
        )
        # Padding only at the end of the prompt, or where the chunk had to be shrunk.
        if chunk.padding and index < len(chunks) - 1:
            assert chunk.end in (ChunkEnd.VISION_SIZE, ChunkEnd.IMAGE_BOUNDARY)
        if chunk.end is ChunkEnd.SEQ_LEN:
            assert chunk.padding == 0

    # The device's merge rule reads, for each placeholder, exactly its own row of G.
    embeddings = image_embeddings(spans)
    rows_of = row_of_token(spans)
    sent = np.zeros(total, dtype=np.int64)
    image_idx = 0
    for chunk in chunks:
        if protocol == "full":
            assert chunk.image_idx == image_idx and chunk.rows == total
        else:
            assert chunk.image_idx == 0
        buffer = assemble_vision_embeds(chunk, embeddings, hidden_size=2, dtype=np.int64)
        assert buffer.shape == (1, chunk.vision_size, 2)
        placeholder_tokens = [x for x in range(chunk.start, chunk.stop) if x in rows_of]
        for t, position in enumerate(placeholder_tokens):
            assert buffer[0, chunk.image_idx + t, 0] == rows_of[position] + 1
        assert not buffer[0, chunk.rows :].any()  # zero padding after the real rows
        sent[chunk.row_start : chunk.row_stop] += 1
        image_idx = chunk.image_idx_output if protocol == "full" else image_idx + chunk.placeholders
    assert image_idx == total

    if protocol == "chunk":
        # Concatenated per-chunk rows are G in prompt order, each row exactly once.
        concatenated = [buffer_rows for c in chunks for buffer_rows in range(c.row_start, c.row_stop)]
        assert concatenated == list(range(total))
        assert (sent == 1).all()
        assert plan.real_rows_sent == total
        if allow_split and all(b.vision_size >= b.seq_len for b in buckets):
            assert all(c.padding == 0 for c in chunks[:-1])
    else:
        assert (sent == len(chunks)).all()

    if not allow_split:
        for span in spans:
            assert any(c.start <= span.start and span.stop <= c.stop for c in chunks)

    # Image lifetimes agree with the pieces each chunk sends.
    for image in range(len(spans)):
        users = [c.index for c in chunks if any(p.image == image for p in c.pieces)]
        assert plan.first_chunk_of_image[image] == users[0]
        assert plan.last_chunk_of_image[image] == users[-1]
        assert image in chunks[users[0]].first_use and image in chunks[users[-1]].last_use
        if protocol == "chunk":
            assert [c.index for c in chunks if image in c.images] == users
    assert plan.rows_sent == sum(c.vision_size for c in chunks)
    assert plan.padding_tokens == sum(c.seq_len for c in chunks) - length


# ---- properties ----


@settings(max_examples=150, deadline=None)
@given(prompts(), bucket_sets(), st.booleans())
def test_chunk_protocol_properties(prompt, buckets, allow_split):
    length, spans = prompt
    if not allow_split and not all(image_fits(s, buckets, "chunk") for s in spans):
        with pytest.raises(PlanError, match="cannot split an image"):
            plan_chunks(length, spans, buckets, allow_image_split=False)
        return
    plan = plan_chunks(length, spans, buckets, allow_image_split=allow_split)
    check_plan(plan, length, spans, buckets, "chunk", allow_split)


@settings(max_examples=100, deadline=None)
@given(
    prompts(), st.lists(st.integers(1, 160), min_size=1, max_size=4, unique=True), st.booleans(), st.data()
)
def test_full_protocol_properties(prompt, seq_lens, allow_split, data):
    length, spans = prompt
    total = sum(span.rows for span in spans)
    buckets = [PrefillBucket(s, total + data.draw(st.integers(1, 64))) for s in seq_lens]
    if not allow_split and not all(image_fits(s, buckets, "full") for s in spans):
        with pytest.raises(PlanError):
            plan_chunks(length, spans, buckets, allow_image_split=False, protocol="full")
        return
    plan = plan_chunks(length, spans, buckets, allow_image_split=allow_split, protocol="full")
    check_plan(plan, length, spans, buckets, "full", allow_split)


@settings(max_examples=150, deadline=None)
@given(prompts(max_len=60, max_images=4), bucket_sets(max_seq_len=24), st.booleans())
def test_greedy_plan_uses_the_fewest_chunks(prompt, buckets, allow_split):
    length, spans = prompt
    if not allow_split and not all(image_fits(s, buckets, "chunk") for s in spans):
        return
    plan = plan_chunks(length, spans, buckets, allow_image_split=allow_split)
    assert len(plan) == fewest_chunks(length, tuple(spans), tuple(buckets), "chunk", allow_split)


@settings(max_examples=100, deadline=None)
@given(prompts(), st.data())
def test_find_segments_recovers_spans(prompt, data):
    length, spans = prompt
    ids = np.array(data.draw(st.lists(st.integers(0, 6), min_size=length, max_size=length)))
    for span in spans:
        ids[span.start : span.stop] = PLACEHOLDER
    found = find_segments(ids, PLACEHOLDER, [s.rows for s in spans])
    assert found == [replace(span, placeholder_id=PLACEHOLDER) for span in spans]
    runs = find_segments(ids.tolist(), PLACEHOLDER)
    assert sum(r.rows for r in runs) == sum(s.rows for s in spans)
    assert all(a.stop < b.start for a, b in zip(runs, runs[1:]))  # maximal runs never touch


# ---- the named edge cases ----


def test_image_straddling_two_chunks():
    plan = plan_chunks(200, [(100, 60)], [(128, 128)])
    first, second = plan.chunks
    assert (first.start, first.stop, first.row_start, first.row_stop) == (0, 128, 0, 28)
    assert (second.start, second.stop, second.row_start, second.row_stop) == (128, 200, 28, 60)
    assert [p.__dict__ for p in second.pieces] == [{"image": 0, "start": 28, "stop": 60}]
    assert first.first_use == (0,) and first.last_use == () and second.last_use == (0,)
    assert plan.last_chunk_of_image == (1,)


def test_two_images_in_one_chunk():
    (chunk,) = plan_chunks(100, [(10, 20), (40, 30)], [(128, 128)]).chunks
    assert chunk.images == (0, 1) and (chunk.row_start, chunk.row_stop) == (0, 50)
    assert [(p.image, p.start, p.stop) for p in chunk.pieces] == [(0, 0, 20), (1, 0, 30)]
    assert chunk.padding == 28 and chunk.row_padding == 78


def test_image_then_text_only_chunk_then_second_image():
    spans = [(0, 50), (300, 50)]
    chunk_plan = plan_chunks(400, spans, [(128, 128)])
    assert [(c.row_start, c.row_stop, c.images) for c in chunk_plan] == [
        (0, 50, (0,)),
        (50, 50, ()),
        (50, 100, (1,)),
        (100, 100, ()),
    ]
    assert all(c.image_idx == 0 for c in chunk_plan)
    # Full protocol: a text-only chunk hands image_idx on unchanged, so B reads its own rows.
    full = plan_chunks(400, spans, [(128, 128)], protocol="full")
    assert [(c.image_idx, c.image_idx_output) for c in full] == [(0, 50), (50, 50), (50, 100), (100, 100)]


def test_images_at_the_very_start_and_end():
    plan = plan_chunks(100, [(0, 10), (90, 10)], [(32, 32)])
    assert plan.chunks[0].pieces[0].image == 0 and plan.chunks[0].row_stop == 10
    last = plan.chunks[-1]
    assert (last.start, last.stop, last.row_start, last.row_stop) == (96, 100, 16, 20)
    assert [(p.image, p.start, p.stop) for p in last.pieces] == [(1, 6, 10)]
    assert plan.last_chunk_of_image == (0, 3)


def test_prompt_shorter_than_one_chunk_takes_the_smallest_bucket():
    (chunk,) = plan_chunks(20, [(2, 8)], [(128, 128), (32, 32)]).chunks
    assert (chunk.seq_len, chunk.padding, chunk.end) == (32, 12, ChunkEnd.PROMPT_END)


def test_last_chunk_padding_only_on_the_remainder():
    plan = plan_chunks(300, [], [(32, 32), (128, 128), (64, 64)])
    assert [(c.tokens, c.seq_len, c.padding) for c in plan] == [(128, 128, 0), (128, 128, 0), (44, 64, 20)]
    assert plan.padding_tokens == 20


def test_two_images_of_different_sizes():
    plan = plan_chunks(500, [(5, 64), (80, 299)], [(128, 128)])
    assert plan.total_rows == 363 and plan.real_rows_sent == 363
    assert [(c.row_start, c.row_stop) for c in plan] == [(0, 112), (112, 240), (240, 363), (363, 363)]
    assert [c.images for c in plan] == [(0, 1), (1,), (1,), ()]
    assert plan.first_chunk_of_image == (0, 0) and plan.last_chunk_of_image == (0, 2)


def test_integer_vision_size_shrinks_the_chunk():
    # V = 64 < S = 128: the chunk stops where its 65th row would start.
    plan = plan_chunks(300, [(10, 100), (150, 20)], [(128, 64)])
    first, second, third = plan.chunks
    assert (first.start, first.stop, first.rows, first.padding, first.end) == (
        0,
        74,
        64,
        54,
        ChunkEnd.VISION_SIZE,
    )
    assert (second.start, second.stop, second.rows, second.end) == (74, 202, 56, ChunkEnd.SEQ_LEN)
    assert (third.rows, third.end) == (0, ChunkEnd.PROMPT_END)


def test_shrunk_chunk_takes_the_smallest_bucket_that_holds_it():
    plan = plan_chunks(200, [(0, 150)], [(128, 40), (64, 40)])
    assert [(c.tokens, c.seq_len, c.rows) for c in plan][:2] == [(40, 64, 40), (40, 64, 40)]


def test_full_protocol_chains_image_idx_and_sends_everything():
    plan = plan_chunks(300, [(10, 100), (150, 20)], [(128, 128), (32, 32)], protocol=VisionProtocol.FULL)
    assert [(c.image_idx, c.placeholders, c.rows, c.seq_len) for c in plan] == [
        (0, 100, 120, 128),
        (100, 20, 120, 128),
        (120, 0, 120, 128),
    ]
    assert plan.chunks[0].first_use == (0, 1) and plan.chunks[-1].last_use == (0, 1)
    assert plan.last_chunk_of_image == (2, 2)


def test_unsplittable_image_starts_a_new_chunk():
    plan = plan_chunks(400, [(100, 200)], [(256, 256)], allow_image_split=False)
    first, second, third = plan.chunks
    assert (first.stop, first.padding, first.end) == (100, 156, ChunkEnd.IMAGE_BOUNDARY)
    assert (second.start, second.stop, second.images, third.images) == (100, 356, (0,), ())


def test_chunk_protocol_sends_20x_fewer_bytes_than_full_for_a_1080p_image():
    # Qwen2.5-VL, 1920x1080 -> 2691 image tokens; S = 128 with V = min(S, 2691) vs V = 2691 ("max").
    length, spans = 2691 + 40, [(20, 2691)]
    chunk_plan = plan_chunks(length, spans, [(128, 128)])
    full_plan = plan_chunks(length, spans, [(128, 2691)], protocol="full")
    ratio = full_plan.vision_bytes(3584, 2) / chunk_plan.vision_bytes(3584, 2)
    assert len(chunk_plan) == len(full_plan) == 22 and ratio >= 20


# ---- bad input ----


@pytest.mark.parametrize(
    ("length", "spans", "buckets", "kwargs", "message"),
    [
        (0, [], [(8, 8)], {}, "at least 1 token"),
        (10, [], [], {}, "no prefill buckets"),
        (10, [], [(0, 8)], {}, "must be positive"),
        (10, [], [(8, 8), (8, 4)], {}, "different vision_size"),
        (10, [(5, 6)], [(8, 8)], {}, "beyond the prompt"),
        (10, [(0, 4), (3, 2)], [(8, 8)], {}, "overlaps"),
        (10, [(5, 2), (0, 2)], [(8, 8)], {}, "prompt order"),
        (10, [(5, 0)], [(8, 8)], {}, "at least one row"),
        (10, [], [(8, 8)], {"protocol": "half"}, "unknown vision protocol"),
        (10, [(0, 9)], [(8, 8)], {"protocol": "full"}, "full protocol sends all 9"),
        (
            20,
            [(0, 9)],
            [(8, 8), (16, 4)],
            {"allow_image_split": False},
            "compile a bucket with seq_len >= 9 and vision_size",
        ),
    ],
)
def test_bad_input_is_a_plan_error(length, spans, buckets, kwargs, message):
    with pytest.raises(PlanError, match=message) as caught:
        plan_chunks(length, spans, buckets, **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, UserError)


def test_find_segments_splits_adjacent_images_by_row_count():
    ids = [1, 7, 7, 7, 7, 7, 2, 7, 7]
    assert find_segments(ids, 7, [2, 3, 2]) == [
        Segment(1, 2, placeholder_id=7),
        Segment(3, 3, placeholder_id=7),
        Segment(7, 2, placeholder_id=7),
    ]
    assert find_segments(ids, 7) == [Segment(1, 5, placeholder_id=7), Segment(7, 2, placeholder_id=7)]
    assert find_segments(np.array([[1, 2]]), 7) == []


@pytest.mark.parametrize("rows", [[2, 4, 2], [5, 1], [5, 2, 1], [5], [0, 5, 2]])
def test_find_segments_rejects_counts_that_do_not_tile_the_runs(rows):
    with pytest.raises(PlanError):
        find_segments([1, 7, 7, 7, 7, 7, 2, 7, 7], 7, rows)


def test_assemble_refuses_a_released_image():
    plan = plan_chunks(10, [(0, 4)], [(8, 8)])
    with pytest.raises(ValueError, match="sends rows of image 0"):
        assemble_vision_embeds(plan.chunks[0], [None], hidden_size=2, dtype=np.float32)
