"""The vision-size policy: how many ``vision_embeds`` rows each language specialization takes.

Pure integer arithmetic, shared by the spec loader (validation), the specialization builder and
the table. See docs/design.md, "Specializations and the vision-size policy".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qeff_vision.families.layout import ImageMarkers

CHUNK = "chunk"
MAX = "max"
FIXED = "fixed"
POLICY_NAMES = (CHUNK, MAX)


@dataclass(frozen=True)
class VisionSizePolicy:
    """Value of ``vision.vision_size`` in a spec.

    Attributes:
        kind: ``chunk`` (V(S) = min(S, M)), ``max`` (V = M everywhere, QEfficient's behaviour) or
            ``fixed`` (an integer from the spec, QEfficient PR #996's ``user_vision_size``), where
            S is a prefill bucket and M the most image tokens one request can carry.
        size: The integer of a ``fixed`` policy; ``None`` otherwise.
    """

    kind: str = CHUNK
    size: int | None = None

    def __str__(self) -> str:
        return str(self.size) if self.kind == FIXED else self.kind

    def for_bucket(
        self, seq_len: int, request_image_tokens: int, whole_images: WholeImages | None = None
    ) -> int:
        """Rows of ``vision_embeds`` a prefill chunk of ``seq_len`` tokens is compiled for.

        A chunk of S tokens holds at most S image placeholders, so ``chunk`` never makes a chunk
        smaller than its bucket while sending no row it cannot use. For a family that keeps images
        whole (``whole_images``), a chunk carries only whole images, so ``chunk`` takes the most
        placeholders whole images can put in S tokens (at least 1: a text-only bucket).
        """
        if self.kind == FIXED:
            assert self.size is not None
            return self.size
        if self.kind == MAX:
            return request_image_tokens
        if whole_images is not None:
            return max(1, whole_images.most_rows(seq_len))
        return min(seq_len, request_image_tokens)


@dataclass(frozen=True)
class WholeImages:
    """What fits in a chunk when images must not be split across chunks.

    Attributes:
        tokens: Placeholder tokens of each compiled image resolution.
        max_images: Images one request can carry.
        gap: Fewest tokens between two images' placeholder runs (the family's marker tokens).
    """

    tokens: tuple[int, ...]
    max_images: int
    gap: int = 0

    @classmethod
    def for_family(cls, family, tokens: tuple[int, ...], max_images: int) -> WholeImages:
        """Whole images of ``family``: the gap is its listed ``ImageMarkers`` (0 without).

        This module owns :class:`~qeff_vision.families.layout.ImageMarkers`; nothing else reads it.
        """
        markers = family.capability(ImageMarkers)
        return cls(tokens, max_images, 0 if markers is None else markers.between)

    def most_rows(self, seq_len: int) -> int:
        """The most placeholders k <= max_images whole images put in ``seq_len`` tokens.

        k images of t_1..t_k tokens need t_1 + ... + t_k + gap * (k - 1) tokens. Solved by a
        bounded subset-sum over the (few) distinct image sizes; 0 when no image fits.
        """
        sizes = sorted(set(self.tokens))
        reachable = {0}  # placeholder sums of the images chosen so far (each adds gap after the first)
        best = 0
        for count in range(1, self.max_images + 1):
            budget = seq_len - self.gap * (count - 1)
            reachable = {total + size for total in reachable for size in sizes if total + size <= budget}
            if not reachable:
                break
            best = max(best, max(reachable))
        return best


def prefill_vision_sizes(
    policy: VisionSizePolicy,
    seq_lens: tuple[int, ...],
    request_image_tokens: int,
    whole_images: WholeImages | None = None,
) -> dict[int, int]:
    """Vision size of every prefill bucket (decode takes the largest: :func:`decode_vision_size`)."""
    return {seq_len: policy.for_bucket(seq_len, request_image_tokens, whole_images) for seq_len in seq_lens}


def decode_vision_size(prefill_sizes: dict[int, int]) -> int:
    """Decode carries the largest prefill vision size: one size for the retained ``vision_embeds`` buffer."""
    return max(prefill_sizes.values())


def chunk_span(tokens: int, capacity: int) -> tuple[int, int]:
    """Fewest and most prefill chunks an image's ``tokens`` placeholders can span.

    Args:
        tokens: Placeholder tokens of the image.
        capacity: Placeholders one chunk can carry: min(bucket, its vision size).

    Returns:
        ``(ceil(tokens / capacity), ceil((tokens - 1) / capacity) + 1)``: the image starting on a
        chunk boundary, and the worst unaligned start.
    """
    if tokens <= 0:
        return 0, 0
    return math.ceil(tokens / capacity), math.ceil((tokens - 1) / capacity) + 1
