"""Embedding cache: keys, LRU and byte bound, pinning, one encoder call per resolution, reuse across turns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision.contract.segments import find_segments
from qeff_vision.runtime.embedding_cache import (
    EmbeddingCache,
    PreparedImage,
    content_key,
    feed_chunks,
    fetch_embeddings,
)
from qeff_vision.runtime.planner import plan_chunks

HIDDEN = 4
ROW_BYTES = HIDDEN * 4  # float32


def rows(count: int, value: float = 1.0) -> np.ndarray:
    return np.full((count, HIDDEN), value, dtype=np.float32)


def image(seed: int, resolution=(1, 4, 4)) -> PreparedImage:
    pixels = np.random.default_rng(seed).random((resolution[1] * resolution[2], 6), dtype=np.float32)
    return PreparedImage(pixels, resolution)


class FakeEncoder:
    """Records its calls; an image's embedding is derived from its pixels, one row per 4 patches."""

    def __init__(self):
        self.calls: list[list[PreparedImage]] = []

    def __call__(self, batch):
        assert len({img.resolution for img in batch}) == 1, "one resolution per call"
        self.calls.append(list(batch))
        return [self.embed(img) for img in batch]

    @staticmethod
    def rows_of(img: PreparedImage) -> int:
        return img.pixels.shape[0] // 4

    @classmethod
    def embed(cls, img: PreparedImage) -> np.ndarray:
        base = float(img.pixels.sum())
        return base + np.arange(cls.rows_of(img) * HIDDEN, dtype=np.float32).reshape(-1, HIDDEN)


# ---- keys ----


def test_content_key_depends_on_bytes_shape_dtype_and_resolution():
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    key = content_key(pixels, (1, 2, 2))
    assert key == content_key(pixels.copy(), [1, 2, 2])
    assert key == content_key(np.asfortranarray(pixels), (1, 2, 2))
    assert key != content_key(pixels.reshape(4, 3), (1, 2, 2))
    assert key != content_key(pixels.astype(np.float64), (1, 2, 2))
    assert key != content_key(pixels, (1, 2, 3))
    changed = pixels.copy()
    changed[2, 3] += 1
    assert key != content_key(changed, (1, 2, 2))
    assert PreparedImage(pixels, (1, 2, 2)).key == key


# ---- LRU, bound, pinning ----


def test_lru_eviction_order_and_byte_bound():
    cache = EmbeddingCache(max_bytes=3 * 10 * ROW_BYTES)
    for key in "abc":
        cache.put(key, rows(10))
    assert cache.get("a") is not None  # a becomes most recently used
    cache.put("d", rows(10))
    assert cache.keys() == ["c", "a", "d"] and "b" not in cache
    cache.put("e", rows(20))  # needs two slots: c then a go
    assert cache.keys() == ["d", "e"]
    stats = cache.stats
    assert (stats.evictions, stats.bytes, stats.entries) == (3, 30 * ROW_BYTES, 2)
    assert stats.peak_bytes == 30 * ROW_BYTES and stats.bytes <= cache.max_bytes
    assert (stats.hits, stats.misses) == (1, 0)
    assert cache.get("b") is None and cache.stats.misses == 1


def test_replacing_an_entry_keeps_the_byte_count_right():
    cache = EmbeddingCache(max_bytes=100 * ROW_BYTES)
    cache.put("a", rows(10))
    cache.put("a", rows(30))
    assert cache.nbytes == 30 * ROW_BYTES and len(cache) == 1


def test_pinned_entries_survive_and_the_cache_recovers_after_unpin():
    cache = EmbeddingCache(max_bytes=20 * ROW_BYTES)
    cache.put("a", rows(10), pin=True)
    cache.put("b", rows(10))
    cache.put("c", rows(10))  # over by 10: b is the oldest unpinned entry
    assert cache.keys() == ["a", "c"]
    cache.put("big", rows(40), pin=True)  # pinned beyond the bound: kept, c goes
    assert cache.keys() == ["a", "big"] and cache.nbytes == 50 * ROW_BYTES
    cache.pin("a")  # nested pin
    cache.unpin("a")
    cache.unpin("big")  # big is unpinned and the cache is over budget: it goes
    assert cache.keys() == ["a"] and cache.is_pinned("a")
    cache.unpin("a")
    assert not cache.is_pinned("a") and cache.keys() == ["a"]


def test_unpinned_entry_larger_than_the_bound_is_not_kept():
    cache = EmbeddingCache(max_bytes=5 * ROW_BYTES)
    cache.put("huge", rows(10))
    assert len(cache) == 0 and cache.stats.evictions == 1


def test_pin_errors_and_read_only_rows():
    cache = EmbeddingCache(max_bytes=1000)
    with pytest.raises(KeyError):
        cache.pin("missing")
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin("missing")
    original = rows(2)
    cache.put("a", original)
    with pytest.raises(ValueError):
        cache.get("a")[0, 0] = 5.0
    original[0, 0] = 5.0  # the caller's own array stays writable
    with pytest.raises(ValueError):
        EmbeddingCache(max_bytes=-1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefg"), st.integers(1, 8), st.booleans()), max_size=40))
def test_bound_holds_for_unpinned_bytes(operations):
    cache = EmbeddingCache(max_bytes=12 * ROW_BYTES)
    pinned: list[str] = []
    for key, count, pin in operations:
        if pin and key in pinned:
            cache.unpin(key)
            pinned.remove(key)
        else:
            cache.put(key, rows(count), pin=pin)
            pinned += [key] if pin else []
        held = {k: cache.get(k) for k in cache.keys()}
        # Over the bound only when nothing evictable is left.
        assert cache.nbytes <= cache.max_bytes or all(cache.is_pinned(k) for k in held)
        assert cache.nbytes == sum(v.nbytes for v in held.values())
        assert all(k in cache for k in pinned)


# ---- encoding through the cache ----


def test_one_encoder_call_per_resolution_group():
    small = [image(1), image(2), image(3)]
    large = [image(4, (1, 8, 8)), image(5, (1, 8, 8))]
    encoder = FakeEncoder()
    cache = EmbeddingCache(max_bytes=10**6)
    wanted = [small[0], large[0], small[1], large[1], small[2], small[0]]
    result = fetch_embeddings(cache, wanted, encoder)
    assert len(encoder.calls) == 2
    assert [len(call) for call in encoder.calls] == [3, 2]
    for img, got in zip(wanted, result):
        np.testing.assert_array_equal(got, FakeEncoder.embed(img))
    assert (cache.stats.encoder_calls, cache.stats.images_encoded, cache.stats.misses) == (2, 5, 5)
    # Everything cached now: no call, hits only.
    fetch_embeddings(cache, [large[1], small[2]], encoder)
    assert len(encoder.calls) == 2 and cache.stats.hits == 2


def test_fetch_pins_each_occurrence_and_hits_survive_the_misses_puts():
    cache = EmbeddingCache(max_bytes=4 * ROW_BYTES)  # holds exactly one small image
    first, second = image(1), image(2)
    encoder = FakeEncoder()
    fetch_embeddings(cache, [first], encoder)
    fetch_embeddings(cache, [first, second, first], encoder, pin=True)
    assert first.key in cache and second.key in cache  # pinned: both kept over budget
    for key in (first.key, first.key, second.key):
        cache.unpin(key)
    assert len(cache) == 1


def test_encoder_returning_too_few_embeddings_is_an_error_and_leaks_no_pins():
    cache = EmbeddingCache(max_bytes=10**6)
    held = image(9)
    fetch_embeddings(cache, [held], FakeEncoder())
    with pytest.raises(ValueError, match="returned 0 embeddings for 1"):
        fetch_embeddings(cache, [held, image(1)], lambda batch: [], pin=True)
    assert not cache.is_pinned(held.key)


# ---- the host loop over a plan, across turns ----


def prompt_with(images: list[PreparedImage], text_between: int = 150) -> tuple[np.ndarray, list[int]]:
    """Token ids: text, then each image's placeholders separated by text."""
    ids: list[int] = [1] * 3
    for img in images:
        ids += [7] * FakeEncoder.rows_of(img) + [2] * text_between
    return np.array(ids), [FakeEncoder.rows_of(img) for img in images]


def run_turn(images, cache, encoder, buckets=((32, 32),), protocol="chunk"):
    ids, counts = prompt_with(images)
    spans = find_segments(ids, 7, counts)
    plan = plan_chunks(len(ids), spans, list(buckets), protocol=protocol)
    merged = np.zeros((len(ids), HIDDEN), dtype=np.float32)
    for chunk, embeds in feed_chunks(plan, images, cache, encoder, HIDDEN, np.float32):
        # The device's merge rule: the t-th placeholder takes row image_idx + t.
        positions = [x for x in range(chunk.start, chunk.stop) if ids[x] == 7]
        for t, position in enumerate(positions):
            merged[position] = embeds[0, chunk.image_idx + t]
        for number in chunk.pieces:
            assert cache.is_pinned(images[number.image].key)
    expected = np.zeros_like(merged)
    for span, img in zip(spans, images):
        expected[span.start : span.stop] = FakeEncoder.embed(img)
    np.testing.assert_array_equal(merged, expected)
    assert not any(cache.is_pinned(img.key) for img in images)
    return plan


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_three_turns_reuse_the_first_turns_image(protocol):
    cache, encoder = EmbeddingCache(max_bytes=10**6), FakeEncoder()
    turn_one = image(1, (1, 10, 10))  # 25 rows: straddles the 32-token chunks
    other = image(2, (1, 6, 6))
    run_turn([turn_one], cache, encoder, buckets=((32, 64),), protocol=protocol)
    run_turn([turn_one, other], cache, encoder, buckets=((32, 64),), protocol=protocol)
    run_turn([other, turn_one, turn_one], cache, encoder, buckets=((32, 64),), protocol=protocol)
    encoded = [img.key for call in encoder.calls for img in call]
    assert encoded == [turn_one.key, other.key]
    assert cache.stats.encoder_calls == 2 and cache.stats.hits >= 3


def test_images_are_encoded_when_a_chunk_first_needs_them():
    cache, encoder = EmbeddingCache(max_bytes=10**6), FakeEncoder()
    images = [image(1), image(2, (1, 8, 8)), image(3)]
    seen_before_chunk: list[int] = []
    ids, counts = prompt_with(images)
    plan = plan_chunks(len(ids), find_segments(ids, 7, counts), [(32, 32)])
    for _ in feed_chunks(plan, images, cache, encoder, HIDDEN, np.float32):
        seen_before_chunk.append(len(encoder.calls))
    first_chunks = plan.first_chunk_of_image
    assert [seen_before_chunk[c] for c in first_chunks] == [1, 2, 3]
    assert seen_before_chunk[first_chunks[1] - 1] == 1  # not encoded earlier than needed


def test_leaving_the_loop_early_unpins_everything():
    cache, encoder = EmbeddingCache(max_bytes=10**6), FakeEncoder()
    img = image(1, (1, 16, 16))  # 64 rows over several chunks
    ids, counts = prompt_with([img])
    plan = plan_chunks(len(ids), find_segments(ids, 7, counts), [(16, 16)])
    feeder = feed_chunks(plan, [img], cache, encoder, HIDDEN, np.float32)
    next(feeder)
    next(feeder)
    assert cache.is_pinned(img.key)
    feeder.close()
    assert not cache.is_pinned(img.key)


def test_feed_checks_images_against_the_plan():
    cache, encoder = EmbeddingCache(max_bytes=10**6), FakeEncoder()
    plan = plan_chunks(50, [(0, 5)], [(32, 32)])
    with pytest.raises(ValueError, match="1 images but 0"):
        next(feed_chunks(plan, [], cache, encoder, HIDDEN, np.float32))
    with pytest.raises(ValueError, match="prompt has 5 placeholder tokens"):
        next(feed_chunks(plan, [image(1)], cache, encoder, HIDDEN, np.float32))
    assert not cache.is_pinned(image(1).key)
