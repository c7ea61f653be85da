"""Full-length caches on ring layers (spec key ``retain_full_kv``; pure data, torch-free).

A ring layer (a ``sliding_attention`` window, a ``chunked_attention`` block) normally keeps a ring
of ``sliding_window`` / ``chunk_ctx_len`` KV slots, slot = position mod ring length. With
``retain_full_kv`` it keeps ``ctx_len`` slots instead, slot = position, and its attention masks
what is outside the window (or the block) over the whole cache, as a full-context layer with the
layer type's mask. The KV a disaggregated prefill program hands to its decode program then holds
every position of the sequence, addressable by position: a serving stack can transfer or reuse
any prefix of it (vLLM's KV hand-off and prefix caching work on position blocks), which a ring,
where a slot's position depends on how far the sequence got, does not allow.

ref: QEfficient ``retain_full_kv`` (pinned quic/efficient-transformers ebf55e8,
``transformers/models/modeling_auto.py`` and ``gpt_oss/modeling_gpt_oss.py``
``get_pkv_dynamic_axes``: the sliding layers' cache axis becomes ``ctx_len``; its
``examples/disagg_serving/README.md``: "retaining ctx_len KV even for sliding window layers but
... reading only sliding window len kv in attention", for multi-turn chat on a decode program).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from qeff_vision import symbols
from qeff_vision.contract.language_io import LanguageIO
from qeff_vision.contract.states import LayerState


def full_length_caches(caches: Sequence[LayerState]) -> tuple[LayerState, ...]:
    """``caches`` with every ring made a ``ctx_len`` cache (heads and head dim kept; each state decides)."""
    return tuple(cache.full_length() for cache in caches)


def has_rings(caches: Iterable[LayerState]) -> bool:
    """Whether any layer keeps a ring (what ``retain_full_kv`` changes)."""
    return any(cache.ring for cache in caches)


def keeps_full_kv(ring_table: LanguageIO, input_dims: Mapping[str, Sequence]) -> bool:
    """Whether a graph (``input_dims``: name -> dims) was exported with ``retain_full_kv``.

    Args:
        ring_table: The graph's IO table with ring layers as rings (the default declaration).
        input_dims: The loaded graph's input dims, a dim being an int or a symbol.

    Returns:
        True when a ring layer's KV input has ``ctx_len`` on its slot axis instead of the ring's
        symbol.
    """
    for layer, state in enumerate(ring_table.layers):
        for row in ring_table.layer_rows(layer) if state.ring else ():
            if row.name in input_dims:
                dims = list(input_dims[row.name])
                return len(dims) > state.slot_axis and dims[state.slot_axis] == symbols.CTX_LEN
    return False
