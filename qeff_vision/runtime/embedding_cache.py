"""Per-image vision-embedding cache, and the host loop that feeds each chunk its rows.

An image is encoded only when a chunk first sends its rows, and stays cached after the request
ends, so a later turn of the same conversation that shows it again pays no encoder call (keep
one :class:`EmbeddingCache` per conversation or per server). Entries are keyed by a content hash
of the preprocessed pixels and the resolution they were prepared for: two different images (or
one image prepared for two resolutions) never share an entry.

The cache is bounded in bytes and evicts the least recently used entry first, skipping pinned
ones: an image a request is still using (up to its last overlapping chunk) is pinned, so the
rows a later chunk needs cannot disappear. Pinned entries are never evicted, so while one request
pins more than ``max_bytes`` the cache is over budget; it returns under the bound as soon as they
are unpinned.

An entry is one image's rows (token merge) or, for the cross-attention kind, its states by name
(every cross layer's K/V); both count their bytes against the same bound.

Pure: numpy and hashlib only.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from qeff_vision.runtime.planner import Chunk, ChunkPlan, assemble_vision_embeds

#: One cache entry: an image's embedding rows, or its named states (cross-attention K/V).
Entry = np.ndarray | Mapping[str, np.ndarray]


def entry_bytes(entry: Entry) -> int:
    """Bytes an entry holds."""
    if isinstance(entry, np.ndarray):
        return entry.nbytes
    return sum(array.nbytes for array in entry.values())


def _read_only(entry: Entry) -> Entry:
    if isinstance(entry, Mapping):
        return {name: _read_only(np.asarray(array)) for name, array in entry.items()}
    view = np.asarray(entry).view()
    view.flags.writeable = False
    return view


def content_key(pixels: np.ndarray, resolution: Sequence[int]) -> str:
    """Content hash of preprocessed pixels: their bytes, shape and dtype, plus the resolution.

    Args:
        pixels: The image as the vision program receives it (after the processor).
        resolution: The resolution it was prepared for, e.g. Qwen-VL's (t, h, w) patch grid.

    Returns:
        A hex digest (BLAKE2b, 160 bits).
    """
    array = np.ascontiguousarray(pixels)
    digest = hashlib.blake2b(digest_size=20)
    digest.update(repr((array.dtype.str, array.shape, tuple(int(x) for x in resolution))).encode())
    digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


@dataclass(frozen=True)
class PreparedImage:
    """One preprocessed image ready for the vision program.

    Attributes:
        pixels: The vision program's pixel input for this image.
        resolution: The resolution it was prepared for; images are batched per resolution.
        key: Its cache key (:func:`content_key` unless given).
    """

    pixels: np.ndarray
    resolution: tuple[int, ...]
    key: str = field(default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "resolution", tuple(int(x) for x in self.resolution))
        if not self.key:
            object.__setattr__(self, "key", content_key(self.pixels, self.resolution))


@dataclass(frozen=True)
class CacheStats:
    """Counters of an :class:`EmbeddingCache` (a snapshot).

    Attributes:
        encoder_calls: Vision-program calls made to fill the cache.
        images_encoded: Images those calls encoded.
        hits: Lookups answered from the cache.
        misses: Lookups that needed the encoder.
        evictions: Entries dropped to respect the byte bound.
        bytes: Bytes held now.
        peak_bytes: Most bytes held after any operation (above ``max_bytes`` only while pinned).
        entries: Entries held now.
    """

    encoder_calls: int = 0
    images_encoded: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    entries: int = 0


class EmbeddingCache:
    """Image embeddings by content key, bounded in bytes, least recently used evicted first.

    Args:
        max_bytes: Upper bound on the bytes of unpinned entries held.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._pins: dict[str, int] = {}
        self._stats = CacheStats()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._stats.bytes

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return replace(self._stats, entries=len(self._entries))

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key: str) -> Entry | None:
        """The entry under ``key`` (now most recently used), or None; counts a hit or a miss."""
        rows = self._entries.get(key)
        if rows is None:
            self._count(misses=1)
            return None
        self._entries.move_to_end(key)
        self._count(hits=1)
        return rows

    def put(self, key: str, rows: Entry, *, pin: bool = False) -> None:
        """Store ``rows`` under ``key`` as most recently used, then evict down to the bound.

        Args:
            key: The image's content key.
            rows: Its embedding [rows, hidden], or its states by name; stored as read-only views.
            pin: Pin the entry in the same step, so the eviction this put triggers cannot drop it.
        """
        if key in self._entries:
            self._count(bytes=-entry_bytes(self._entries.pop(key)))
        view = _read_only(rows)
        self._entries[key] = view
        self._count(bytes=entry_bytes(view))
        if pin:
            self.pin(key)
        self._evict()

    def pin(self, key: str) -> None:
        """Protect ``key`` from eviction; pins nest (each needs its own :meth:`unpin`)."""
        if key not in self._entries:
            raise KeyError(f"cannot pin {key!r}: not in the cache")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin`; the entry becomes evictable when no pin is left."""
        count = self._pins.get(key, 0)
        if count == 0:
            raise ValueError(f"cannot unpin {key!r}: it is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1
        self._evict()

    def is_pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned."""
        return key in self._pins

    def record_encoder_call(self, images: int) -> None:
        """Count one vision-program call that encoded ``images`` images."""
        self._count(encoder_calls=1, images_encoded=images)

    def _evict(self) -> None:
        """Drop least recently used unpinned entries until the bytes fit the bound (or all are pinned)."""
        for key in [k for k in self._entries if k not in self._pins]:
            if self._stats.bytes <= self.max_bytes:
                break
            self._count(bytes=-entry_bytes(self._entries.pop(key)), evictions=1)
        self._stats = replace(self._stats, peak_bytes=max(self._stats.peak_bytes, self._stats.bytes))

    def _count(self, **deltas: int) -> None:
        values = {name: getattr(self._stats, name) + delta for name, delta in deltas.items()}
        self._stats = replace(self._stats, **values)


Encoder = Callable[[list[PreparedImage]], Sequence[np.ndarray]]
"""Encodes images of one resolution in one vision-program call; one [rows, hidden] array each."""


def fetch_embeddings(
    cache: EmbeddingCache, images: Sequence[PreparedImage], encode: Encoder, *, pin: bool = False
) -> list[np.ndarray]:
    """The embedding of each image, encoding the misses with one encoder call per resolution.

    Args:
        cache: Where embeddings are looked up and stored.
        images: The images a chunk needs (repeats allowed: encoded once).
        encode: The vision program; called once per resolution among the misses.
        pin: Pin one reference per entry of ``images``; the caller unpins each when done.

    Returns:
        The rows of each image, in the order of ``images``.

    Raises:
        ValueError: The encoder returned a different number of arrays than it was given images.
    """
    uses = Counter(image.key for image in images) if pin else Counter()
    found: dict[str, np.ndarray] = {}
    missing: dict[tuple[int, ...], dict[str, PreparedImage]] = {}
    pinned: list[str] = []
    try:
        for image in images:
            if image.key in found or image.key in missing.get(image.resolution, {}):
                continue
            rows = cache.get(image.key)
            if rows is None:
                missing.setdefault(image.resolution, {})[image.key] = image
                continue
            found[image.key] = rows
            pinned += _pin(cache, image.key, uses[image.key])  # before the misses' puts can evict it
        for resolution, group in missing.items():
            batch = list(group.values())
            encoded = [np.asarray(rows) for rows in encode(batch)]
            cache.record_encoder_call(len(batch))
            if len(encoded) != len(batch):
                raise ValueError(
                    f"encoder returned {len(encoded)} embeddings for {len(batch)} images "
                    f"of resolution {resolution}"
                )
            for image, rows in zip(batch, encoded):
                found[image.key] = rows
                cache.put(image.key, rows, pin=uses[image.key] > 0)
                if uses[image.key]:
                    pinned.append(image.key)
                    pinned += _pin(cache, image.key, uses[image.key] - 1)
    except BaseException:
        for key in pinned:
            cache.unpin(key)
        raise
    return [found[image.key] for image in images]


def _pin(cache: EmbeddingCache, key: str, times: int) -> list[str]:
    """Pin ``key`` ``times`` times; the keys pinned, for undoing."""
    for _ in range(times):
        cache.pin(key)
    return [key] * times


def feed_chunks(
    plan: ChunkPlan,
    images: Sequence[PreparedImage],
    cache: EmbeddingCache,
    encode: Encoder,
    hidden_size: int,
    dtype: np.dtype | str,
) -> Iterator[tuple[Chunk, np.ndarray]]:
    """Each chunk of ``plan`` with its ``vision_embeds`` input, following the host protocol.

    Before a chunk, the images it is the first to send are fetched (one encoder call per
    resolution among the misses) and pinned; when the caller asks for the next chunk, the images
    the previous chunk sent for the last time are unpinned. Leaving the loop early unpins the rest.

    Args:
        plan: The chunk plan of the prompt.
        images: Per image of the plan, in prompt order, its prepared pixels.
        cache: The embedding cache (reuse it across turns).
        encode: The vision program (see :data:`Encoder`).
        hidden_size: The decoder's hidden size.
        dtype: Element type of ``vision_embeds``.

    Yields:
        (chunk, vision_embeds [1, vision_size, hidden_size]) per chunk, in order.

    Raises:
        ValueError: The images do not match the plan's spans.
    """
    if len(images) != len(plan.segments):
        raise ValueError(f"the plan has {len(plan.segments)} images but {len(images)} were given")
    rows_by_image: list[np.ndarray | None] = [None] * len(images)
    try:
        for chunk in plan:
            new = [images[i] for i in chunk.first_use]
            for number, rows in zip(chunk.first_use, fetch_embeddings(cache, new, encode, pin=True)):
                rows_by_image[number] = rows
            for number in chunk.first_use:
                _check_rows(number, rows_by_image[number], plan.segments[number].rows, hidden_size)
            yield chunk, assemble_vision_embeds(chunk, rows_by_image, hidden_size, dtype)
            for number in chunk.last_use:
                cache.unpin(images[number].key)
                rows_by_image[number] = None
    finally:
        for number, rows in enumerate(rows_by_image):
            if rows is not None:
                cache.unpin(images[number].key)


def _check_rows(number: int, rows: np.ndarray, placeholders: int, hidden_size: int) -> None:
    if rows.shape != (placeholders, hidden_size):
        raise ValueError(
            f"image {number}: embedding has shape {tuple(rows.shape)}, but the prompt has "
            f"{placeholders} placeholder tokens and the decoder hidden size is {hidden_size}"
        )
