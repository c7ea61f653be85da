"""Packing images of any sizes into patch-bucket encoder calls (pure; the family packs the feeds).

A patch-bucket vision program takes several images per call when their patches (and, for
Qwen2.5-VL, their attention windows) fit a compiled bucket. The plan here keeps calls few:
largest images first, each call takes every pending image that still fits the largest bucket,
then runs in the smallest bucket that holds what it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qeff_vision.errors import UserError

Layout = Callable[[list[Any], Mapping[str, int]], Any]
"""Where these images sit in one call of this bucket, or None when they do not fit (cheap)."""
Pack = Callable[[list[Any], Mapping[str, int], Any], dict]
"""Feeds of one call encoding these images in this bucket, given their layout."""


@dataclass(frozen=True)
class PackedCall:
    """One encoder call: the bucket (its symbol values), the images it encodes, its feeds."""

    bucket: Mapping[str, int]
    images: tuple[int, ...]
    feeds: dict


def plan_packed_calls(
    items: Sequence[Any],
    sizes: Sequence[int],
    buckets: Sequence[Mapping[str, int]],
    layout: Layout,
    pack: Pack,
) -> list[PackedCall]:
    """Encoder calls for ``items`` (indices into it, in each call's row order).

    Combinations are tried with ``layout`` alone; each call's feeds are built once.

    Args:
        items: Per-image vision inputs.
        sizes: Each item's patch count (larger ones are placed first).
        buckets: Compiled buckets, smallest first.
        layout: Places images in a bucket (see :data:`Layout`).
        pack: Builds a call's feeds (see :data:`Pack`).

    Raises:
        UserError: An image fits no bucket.
    """
    pending = sorted(range(len(items)), key=lambda index: -sizes[index])
    calls = []
    while pending:
        taken: list[int] = []
        for index in pending:
            if layout([items[i] for i in [*taken, index]], buckets[-1]) is not None:
                taken.append(index)
        if not taken:
            raise UserError(f"an image of {sizes[pending[0]]} patches fits no compiled patch bucket")
        chosen = [items[i] for i in taken]
        bucket, placed = next((b, p) for b in buckets for p in [layout(chosen, b)] if p is not None)
        calls.append(PackedCall(bucket, tuple(taken), pack(chosen, bucket, placed)))
        pending = [index for index in pending if index not in taken]
    return calls


def packing_encoder(generator, inputs_by_key: Mapping[str, dict], timer: list[float], served: dict[str, str]):
    """A :class:`~qeff_vision.runtime.generator.Generator`'s cache encoder in patch-bucket mode.

    Calls follow :func:`plan_packed_calls`. An image's rows are the call's rows from the end of
    the previous image's (the program's packing contract); ``served`` records, per image
    key, the bucket that served it. ``timer[0]`` accumulates the seconds spent.
    """
    import numpy as np

    from qeff_vision import symbols

    host = generator.host
    buckets = generator.patch_buckets or []

    def encode(batch):
        start = time.perf_counter()
        items = [inputs_by_key[image.key] for image in batch]
        sizes = [host.item_patches(item) for item in items]
        rows: list = [None] * len(batch)
        for call in plan_packed_calls(items, sizes, buckets, host.patch_layout, host.pack_vision_inputs):
            output = generator.vision.run(call.feeds)
            offset = 0
            others = f", packed with {len(call.images) - 1} other image(s)" if len(call.images) > 1 else ""
            for index in call.images:
                count = host.item_rows(items[index])
                rows[index] = generator.wide_rows(output, 0, slice(offset, offset + count))
                offset += count
                served[batch[index].key] = (
                    f"patch bucket of {call.bucket[symbols.VISION_SIZE]} rows "
                    f"({sizes[index]} patches at its own resolution{others})"
                )
        timer[0] += time.perf_counter() - start
        return [np.asarray(r) for r in rows]

    return encode
