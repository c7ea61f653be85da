"""Chunk planner: which tokens, vision rows and ``image_idx`` each prefill call of a prompt carries.

Pure and torch-free. Inputs are a prompt length L, the prompt's segments (each image's or clip's
placeholders; :mod:`qeff_vision.contract.segments`) in prompt order, and the compiled prefill
buckets (``seq_len`` S, ``vision_size`` V). ``P[x]`` is the number of placeholder tokens before
token x; a chunk [a, b) uses rows ``P[a]..P[b]`` of G, the per-image embeddings concatenated in
prompt order (see docs/design.md, "Host protocol per prefill chunk").

Protocols (:class:`VisionProtocol`):
    ``chunk`` (chunk-local, the default): a chunk sends exactly rows ``P[a]..P[b]``, zero-padded
    to its bucket's V, with ``image_idx`` 0. Every row crosses to the device once.
    ``full`` (legacy, kept for comparison): every chunk sends all of G padded to V and
    ``image_idx = P[a]``, the running count the previous chunk's ``image_idx_output`` returns.
    Only buckets with V >= len(G) can carry it.

Bucket choice. Chunk boundaries are chosen greedily: each chunk ends as far as any bucket can
reach, and then takes the smallest bucket (by S, then V) that holds it. A bucket reaches from a
to the first of: a + S, the end of the prompt, and (``chunk`` protocol) the token whose row would
exceed V. When images must not be split, an end inside an image moves back to that image's
start. Hence every chunk but the last fills the largest bucket (unless shrunk, below), and the
final remainder gets the smallest bucket that holds it (least padding). Why: a prefill call
costs a fixed overhead (one pass over the weights, a host round trip) plus work proportional to
its padded S, so the fewest calls come first and then the least padding. The greedy reach is
optimal for the call count because whether [a, b) fits a bucket only gets easier as a grows or
b shrinks. A chunk ends short of its bucket's S only at the end of the prompt, or when it was
shrunk because the next placeholder would exceed every bucket's V (an integer ``vision_size``
policy) or an image that must not be split would not fit (:class:`ChunkEnd` says which).

Past the last prefill compute-context length (``prefill_stop``). QEfficient's CCL lists keep every
prefill CCL below ``ctx_len`` (:mod:`qeff_vision.spec.ccl_lists`), so a prompt may reach positions
no prefill specialization attends to. Prefill chunks then end at ``prefill_stop`` and each later
token goes alone in a decode-shaped call (seq_len 1, the decode ``vision_size``), which the decode
CCL covering its position serves: one token at a time, as decode feeds it. QEfficient's own
generation and the vLLM plugin keep the last (or first) prefill CCL for such a chunk instead, so its
attention misses the slots past that CCL. A decode-shaped call merges no image row, so an image
placeholder past ``prefill_stop`` cannot be fed: that prompt is refused (:class:`PlanError`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from qeff_vision.contract.segments import PlanError, Segment


class VisionProtocol(str, Enum):
    """How vision rows travel with prefill chunks."""

    CHUNK = "chunk"
    FULL = "full"


class ChunkEnd(str, Enum):
    """Why a chunk ends where it does."""

    PROMPT_END = "prompt_end"
    SEQ_LEN = "seq_len"
    VISION_SIZE = "vision_size"
    IMAGE_BOUNDARY = "image_boundary"
    #: The prefill part ends at the last prefill CCL; the tokens after it are decode-shaped chunks.
    PREFILL_CCL = "prefill_ccl"
    #: A decode-shaped chunk of one token past the last prefill CCL.
    DECODE_SHAPED = "decode_shaped"


@dataclass(frozen=True)
class PrefillBucket:
    """A compiled prefill specialization: ``seq_len`` tokens and ``vision_size`` rows per call."""

    seq_len: int
    vision_size: int


@dataclass(frozen=True)
class ImagePiece:
    """Rows [start, stop) of image ``image``'s own embedding, sent by one chunk."""

    image: int
    start: int
    stop: int


@dataclass(frozen=True)
class Chunk:
    """One prefill call.

    Attributes:
        index: Position of the chunk in the plan.
        start: First prompt token of the chunk (positions are sliced the same way).
        stop: One past the last prompt token.
        seq_len: The bucket's S; the token tail is padded up to it.
        vision_size: The bucket's V; the sent rows are zero-padded up to it.
        row_start: First row of G sent (0 for the ``full`` protocol).
        row_stop: One past the last row of G sent (len(G) for the ``full`` protocol).
        placeholders: Placeholder tokens inside the chunk (``P[stop] - P[start]``).
        image_idx: Value of the ``image_idx`` input.
        images: Images with placeholder tokens inside the chunk, in prompt order.
        pieces: The rows sent, image by image, in the order they are concatenated.
        first_use: Images whose rows are sent for the first time here: encode before this call.
        last_use: Images whose rows are sent for the last time here: release after this call.
        end: Why the chunk ends at ``stop``.
    """

    index: int
    start: int
    stop: int
    seq_len: int
    vision_size: int
    row_start: int
    row_stop: int
    placeholders: int
    image_idx: int
    images: tuple[int, ...]
    pieces: tuple[ImagePiece, ...]
    end: ChunkEnd
    first_use: tuple[int, ...] = ()
    last_use: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens in the chunk."""
        return self.stop - self.start

    @property
    def padding(self) -> int:
        """Padding tokens appended to fill the bucket (position id -1)."""
        return self.seq_len - self.tokens

    @property
    def rows(self) -> int:
        """Real rows of G sent (before zero padding to ``vision_size``)."""
        return self.row_stop - self.row_start

    @property
    def row_padding(self) -> int:
        """Zero rows appended to fill ``vision_size``."""
        return self.vision_size - self.rows

    @property
    def token_slice(self) -> slice:
        """The chunk's tokens (and position ids) in the prompt."""
        return slice(self.start, self.stop)

    @property
    def image_idx_output(self) -> int:
        """What the device returns as ``image_idx_output``: ``image_idx`` plus the placeholders."""
        return self.image_idx + self.placeholders


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one prompt and what they send.

    Attributes:
        prompt_len: L, the prompt's token count.
        protocol: The vision protocol the chunks follow.
        segments: The prompt's multimodal segments, in prompt order.
        chunks: The prefill calls, in order; they cover [0, L) contiguously.
        first_chunk_of_image: Per image, the first chunk that sends its rows.
        last_chunk_of_image: Per image, the last chunk that sends its rows (free it after that).
    """

    prompt_len: int
    protocol: VisionProtocol
    segments: tuple[Segment, ...]
    chunks: tuple[Chunk, ...]
    first_chunk_of_image: tuple[int, ...]
    last_chunk_of_image: tuple[int, ...]

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def total_rows(self) -> int:
        """len(G): every image's embedding rows."""
        return sum(segment.rows for segment in self.segments)

    @property
    def rows_sent(self) -> int:
        """Rows transferred over all chunks, zero padding included (what crosses to the device)."""
        return sum(chunk.vision_size for chunk in self.chunks)

    @property
    def real_rows_sent(self) -> int:
        """Rows of G transferred over all chunks, zero padding excluded."""
        return sum(chunk.rows for chunk in self.chunks)

    @property
    def padding_tokens(self) -> int:
        """Padding tokens over all chunks."""
        return sum(chunk.padding for chunk in self.chunks)

    def vision_bytes(self, hidden_size: int, dtype_size: int) -> int:
        """Bytes of ``vision_embeds`` sent over all chunks for a given hidden size and element size."""
        return self.rows_sent * hidden_size * dtype_size


def _validate(prompt_len: int, segments: Sequence[Segment], buckets: Sequence[PrefillBucket]) -> None:
    if prompt_len < 1:
        raise PlanError(f"prompt length must be at least 1 token, got {prompt_len}")
    if not buckets:
        raise PlanError("no prefill buckets: compile at least one prefill specialization")
    seen: dict[int, int] = {}
    for bucket in buckets:
        # vision_size 0 is a bucket without image rows (a cross-attention program): fine while
        # the prompt has no placeholder segments to carry.
        if bucket.seq_len < 1 or bucket.vision_size < (1 if segments else 0):
            raise PlanError(f"bucket {bucket}: seq_len and vision_size must be positive")
        if seen.setdefault(bucket.seq_len, bucket.vision_size) != bucket.vision_size:
            raise PlanError(f"two prefill buckets with seq_len {bucket.seq_len} and different vision_size")
    previous_stop = 0
    for number, segment in enumerate(segments):
        if segment.start < 0 or segment.rows < 1:
            raise PlanError(f"image {number}: segment {segment} needs start >= 0 and at least one row")
        runs = segment.token_runs
        ordered = all(a + la <= b for (a, la), (b, _) in zip(runs, runs[1:]))
        if runs[0][0] != segment.start or any(n < 1 for _, n in runs) or not ordered:
            raise PlanError(f"image {number}: runs {list(runs)} are not non-empty runs in prompt order")
        if segment.stop > prompt_len:
            raise PlanError(
                f"image {number}: segment [{segment.start}, {segment.stop}) ends beyond the prompt "
                f"({prompt_len})"
            )
        if segment.start < previous_stop:
            raise PlanError(
                f"image {number}: segment [{segment.start}, {segment.stop}) overlaps or precedes the "
                f"previous image (ends at {previous_stop}); segments must be disjoint and in prompt order"
            )
        previous_stop = segment.stop


class _Placeholders:
    """P[x] and its inverse over the image segments."""

    def __init__(self, segments: Sequence[Segment], prompt_len: int):
        self.segments = segments
        self.prompt_len = prompt_len
        self.starts = [segment.start for segment in segments]
        self.stops = [segment.stop for segment in segments]
        self.offsets = [0]
        for segment in segments:
            self.offsets.append(self.offsets[-1] + segment.rows)
        # [start, stop) and rows of each run of two or more segments joined to their predecessor.
        runs: list[list[Segment]] = []
        for segment in segments:
            if segment.joined and runs:
                runs[-1].append(segment)
            else:
                runs.append([segment])
        self.groups = [
            (run[0].start, run[-1].stop, sum(segment.rows for segment in run)) for run in runs if len(run) > 1
        ]

    def group_containing(self, position: int) -> tuple[int, int] | None:
        """[start, stop) of the joined segments a cut at ``position`` would separate, if any."""
        return next(((a, b) for a, b, _ in self.groups if a < position < b), None)

    def before(self, position: int) -> int:
        """P[position]: placeholder tokens in [0, position)."""
        count = bisect.bisect_left(self.starts, position)
        if count == 0:
            return 0
        return self.offsets[count - 1] + self.segments[count - 1].rows_before(position)

    def position_of_row(self, row: int) -> int:
        """Token of row ``row`` of G: the largest x with P[x] <= row (L past the last row)."""
        if row >= self.offsets[-1]:
            return self.prompt_len
        image = bisect.bisect_right(self.offsets, row) - 1
        return self.segments[image].token_of_row(row - self.offsets[image])

    def image_containing(self, position: int) -> Segment | None:
        """The segment with start < position < stop (a cut there would split the image), if any."""
        image = bisect.bisect_left(self.starts, position) - 1
        if image >= 0 and self.segments[image].stop > position:
            return self.segments[image]
        return None

    def overlapping(self, start: int, stop: int) -> range:
        """Indices of the images with a placeholder in [start, stop)."""
        first = bisect.bisect_right(self.stops, start)
        return range(first, bisect.bisect_left(self.starts, stop))


def _reach(
    start: int, bucket: PrefillBucket, placeholders: _Placeholders, per_chunk_rows: bool, allow_split: bool
) -> tuple[int, ChunkEnd]:
    """How far one chunk from ``start`` can go in ``bucket``, and what stops it."""
    by_tokens = min(start + bucket.seq_len, placeholders.prompt_len)
    stop, end = by_tokens, ChunkEnd.SEQ_LEN
    if per_chunk_rows:
        by_rows = placeholders.position_of_row(placeholders.before(start) + bucket.vision_size)
        if by_rows < stop:
            stop, end = by_rows, ChunkEnd.VISION_SIZE
    image = placeholders.image_containing(stop)
    if image is not None and not (allow_split and image.divisible):
        stop, end = image.start, ChunkEnd.IMAGE_BOUNDARY
    group = placeholders.group_containing(stop)
    if group is not None:
        stop, end = group[0], ChunkEnd.IMAGE_BOUNDARY
    if stop == placeholders.prompt_len:
        end = ChunkEnd.PROMPT_END
    return stop, end


def _check_images_fit(
    segments: Sequence[Segment], buckets: Sequence[PrefillBucket], per_chunk_rows: bool, allow_split: bool
) -> None:
    """Each segment kept whole (splitting off, or indivisible) needs one bucket for its tokens (and rows).

    An image of several runs spans its break tokens too: its tokens are ``stop - start``.
    """
    for number, segment in enumerate(segments):
        if allow_split and segment.divisible:
            continue
        tokens = segment.stop - segment.start
        need = _missing_bucket(buckets, tokens, segment.rows, per_chunk_rows)
        if need:
            why = (
                "its tokens and rows differ, so it is never split"
                if allow_split
                else ("this family cannot split an image across chunks")
            )
            raise PlanError(
                f"{segment.modality} {number} has {tokens} tokens ({segment.rows} rows), more than any "
                f"prefill bucket holds {need[0]}; {why}: compile a bucket with {need[1]}"
            )


def _check_groups_fit(
    placeholders: _Placeholders, buckets: Sequence[PrefillBucket], per_chunk_rows: bool
) -> None:
    """Joined segments (one chunk for several images) need one bucket for all their tokens (and rows)."""
    for start, stop, rows in placeholders.groups:
        need = _missing_bucket(buckets, stop - start, rows, per_chunk_rows)
        if need:
            raise PlanError(
                f"the images at tokens [{start}, {stop}) attend to each other and share one chunk, "
                f"more than any prefill bucket holds {need[0]}: compile a bucket with {need[1]}"
            )


def _missing_bucket(
    buckets: Sequence[PrefillBucket], tokens: int, rows: int, per_chunk_rows: bool
) -> tuple[str, str] | None:
    """None when a bucket holds ``tokens`` (and ``rows``); else (the compiled buckets, what is needed)."""
    if any(b.seq_len >= tokens and (not per_chunk_rows or b.vision_size >= rows) for b in buckets):
        return None
    compiled = ", ".join(f"{b.seq_len}/{b.vision_size}" for b in buckets)
    return f"(seq_len/vision_size: {compiled})", f"seq_len >= {tokens}" + (
        f" and vision_size >= {rows}" if per_chunk_rows else ""
    )


def plan_chunks(
    prompt_len: int,
    segments: Sequence[Segment | tuple[int, int]],
    buckets: Sequence[PrefillBucket | tuple[int, int]],
    *,
    allow_image_split: bool = True,
    protocol: VisionProtocol | str = VisionProtocol.CHUNK,
    prefill_stop: int | None = None,
    decode_vision_size: int = 0,
) -> ChunkPlan:
    """Split a prompt into prefill chunks, choosing a bucket for each (rule in the module docstring).

    Args:
        prompt_len: L, tokens in the prompt.
        segments: Per image in prompt order, an :class:`Segment` or ``(start, rows)``.
        buckets: The compiled prefill buckets, as :class:`PrefillBucket` or ``(seq_len, vision_size)``.
        allow_image_split: The family's ``chunk_split`` feature; False keeps each image in one chunk.
        protocol: ``chunk`` (chunk-local rows, ``image_idx`` 0) or ``full`` (all rows every chunk).
        prefill_stop: The first token past the last prefill CCL (None: every token prefills): it
            and every later token go one per decode-shaped chunk (module docstring).
        decode_vision_size: The decode specializations' ``vision_size`` (rows of such a chunk).

    Returns:
        The plan; its chunks cover [0, L) contiguously.

    Raises:
        PlanError: Invalid inputs, an image that no bucket can carry whole when splitting is off,
            or an image placeholder at or past ``prefill_stop``.
    """
    try:
        protocol = VisionProtocol(protocol)
    except ValueError as exc:
        choices = ", ".join(p.value for p in VisionProtocol)
        raise PlanError(f"unknown vision protocol {protocol!r}; expected one of {choices}") from exc
    segments = tuple(Segment(*segment) if isinstance(segment, tuple) else segment for segment in segments)
    unique = {PrefillBucket(*b) if isinstance(b, tuple) else b for b in buckets}
    all_buckets = sorted(unique, key=lambda b: (b.seq_len, b.vision_size))
    _validate(prompt_len, segments, all_buckets)
    if prefill_stop is not None and max(prefill_stop, 0) < prompt_len:
        return _with_decode_tail(
            prompt_len,
            segments,
            all_buckets,
            allow_image_split,
            protocol,
            max(prefill_stop, 0),
            decode_vision_size,
        )
    placeholders = _Placeholders(segments, prompt_len)
    total_rows = placeholders.offsets[-1]
    per_chunk_rows = protocol is VisionProtocol.CHUNK
    usable = all_buckets if per_chunk_rows else [b for b in all_buckets if b.vision_size >= total_rows]
    if not usable:
        largest = max(b.vision_size for b in all_buckets)
        raise PlanError(
            f"the full protocol sends all {total_rows} image rows with every chunk, but the largest "
            f"compiled vision_size is {largest}; use the chunk protocol or compile vision_size 'max'"
        )
    _check_images_fit(segments, usable, per_chunk_rows, allow_image_split)
    _check_groups_fit(placeholders, usable, per_chunk_rows)

    chunks: list[Chunk] = []
    start = 0
    while start < prompt_len:
        reaches = [
            _reach(start, bucket, placeholders, per_chunk_rows, allow_image_split) for bucket in usable
        ]
        stop = max(reach for reach, _ in reaches)
        end = _why_chunk_ends({end for reach, end in reaches if reach == stop})
        placeholder_count = placeholders.before(stop) - placeholders.before(start)
        bucket = next(
            b
            for b in usable
            if b.seq_len >= stop - start and (not per_chunk_rows or b.vision_size >= placeholder_count)
        )
        # The images with a placeholder in the chunk (a chunk inside an image's token range may hold
        # only break tokens of it, e.g. Mistral 3's [IMG_BREAK]).
        held = [_piece(i, segments[i], start, stop) for i in placeholders.overlapping(start, stop)]
        held = [piece for piece in held if piece.stop > piece.start]
        images = tuple(piece.image for piece in held)
        if per_chunk_rows:
            row_start, row_stop, image_idx = placeholders.before(start), placeholders.before(stop), 0
            pieces = tuple(held)
        else:
            row_start, row_stop, image_idx = 0, total_rows, placeholders.before(start)
            pieces = tuple(ImagePiece(i, 0, segment.rows) for i, segment in enumerate(segments))
        chunks.append(
            Chunk(
                index=len(chunks),
                start=start,
                stop=stop,
                seq_len=bucket.seq_len,
                vision_size=bucket.vision_size,
                row_start=row_start,
                row_stop=row_stop,
                placeholders=placeholder_count,
                image_idx=image_idx,
                images=images,
                pieces=pieces,
                end=end,
            )
        )
        start = stop
    return _with_lifetimes(prompt_len, protocol, segments, chunks)


def _with_decode_tail(
    prompt_len: int,
    segments: tuple[Segment, ...],
    buckets: Sequence[PrefillBucket],
    allow_image_split: bool,
    protocol: VisionProtocol,
    prefill_stop: int,
    decode_vision_size: int,
) -> ChunkPlan:
    """The plan of [0, ``prefill_stop``), then one decode-shaped chunk per later token (no rows)."""
    late = [number for number, segment in enumerate(segments) if segment.stop > prefill_stop]
    if late:
        segment = segments[late[0]]
        raise PlanError(
            f"{segment.modality} {late[0]} has placeholders at tokens [{max(segment.start, prefill_stop)}, "
            f"{segment.stop}), past the last prefill comp_ctx_length (token {prefill_stop}): a decode-shaped "
            "call merges no image row; compile a larger prefill comp_ctx_length or put images earlier"
        )
    chunks: list[Chunk] = []
    if prefill_stop:
        head = plan_chunks(
            prefill_stop, segments, buckets, allow_image_split=allow_image_split, protocol=protocol
        )
        chunks = [*head.chunks[:-1], replace(head.chunks[-1], end=ChunkEnd.PREFILL_CCL)]
    rows = sum(segment.rows for segment in segments)
    # Nothing merges in a seq_len-1 call: no rows sent, image_idx past the rows (kept as returned).
    image_idx = 0 if protocol is VisionProtocol.CHUNK else rows
    for start in range(prefill_stop, prompt_len):
        chunks.append(
            Chunk(
                index=len(chunks),
                start=start,
                stop=start + 1,
                seq_len=1,
                vision_size=decode_vision_size,
                row_start=rows,
                row_stop=rows,
                placeholders=0,
                image_idx=image_idx,
                images=(),
                pieces=(),
                end=ChunkEnd.DECODE_SHAPED,
            )
        )
    return _with_lifetimes(prompt_len, protocol, segments, chunks)


def _why_chunk_ends(ends: set[ChunkEnd]) -> ChunkEnd:
    """One reason among the buckets that reach furthest; a full bucket outranks a shrink."""
    for end in (ChunkEnd.PROMPT_END, ChunkEnd.SEQ_LEN, ChunkEnd.IMAGE_BOUNDARY):
        if end in ends:
            return end
    return ChunkEnd.VISION_SIZE


def _piece(image: int, segment: Segment, start: int, stop: int) -> ImagePiece:
    """The rows of ``image`` whose placeholder tokens lie in [start, stop)."""
    return ImagePiece(image, segment.rows_before(start), segment.rows_before(stop))


def _with_lifetimes(
    prompt_len: int, protocol: VisionProtocol, segments: tuple[Segment, ...], chunks: list[Chunk]
) -> ChunkPlan:
    """Fill each chunk's ``first_use``/``last_use`` and the plan's per-image first and last chunk."""
    first_chunk = [-1] * len(segments)
    last_chunk = [-1] * len(segments)
    for chunk in chunks:
        for piece in chunk.pieces:
            if first_chunk[piece.image] < 0:
                first_chunk[piece.image] = chunk.index
            last_chunk[piece.image] = chunk.index
    final = tuple(
        replace(
            chunk,
            first_use=tuple(p.image for p in chunk.pieces if first_chunk[p.image] == chunk.index),
            last_use=tuple(p.image for p in chunk.pieces if last_chunk[p.image] == chunk.index),
        )
        for chunk in chunks
    )
    return ChunkPlan(prompt_len, protocol, segments, final, tuple(first_chunk), tuple(last_chunk))


def assemble_vision_embeds(
    chunk: Chunk, image_rows: Sequence[np.ndarray | None], hidden_size: int, dtype: np.dtype | str
) -> np.ndarray:
    """The ``vision_embeds`` input of one chunk: its pieces concatenated, zero-padded to V.

    Args:
        chunk: A chunk of a plan.
        image_rows: Per image of the plan, its embedding [rows, hidden]; images the chunk does not
            send may be None (already released).
        hidden_size: The decoder's hidden size (needed when the chunk sends no rows).
        dtype: Element type of ``vision_embeds``.

    Returns:
        Array of shape [1, vision_size, hidden_size] (``vision_batch_size`` 1).
    """
    embeds = np.zeros((1, chunk.vision_size, hidden_size), dtype=dtype)
    row = 0
    for piece in chunk.pieces:
        rows = image_rows[piece.image]
        if rows is None:
            raise ValueError(f"chunk {chunk.index} sends rows of image {piece.image}, but none were given")
        embeds[0, row : row + piece.stop - piece.start] = rows[piece.start : piece.stop]
        row += piece.stop - piece.start
    return embeds
