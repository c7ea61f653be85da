"""The registry of per-layer state kinds (torch-free): one class per kind, registered here.

A family returns one :class:`~qeff_vision.contract.states.base.LayerState` per decoder layer
(``Family.layer_caches``); the language IO table, the export, the specializations, the runtime and
the memory reports ask those instances. Adding a kind is a class in a module of this package,
registered in :data:`KINDS`, and its export-time cache object registered in
:mod:`qeff_vision.export.state_caches`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from qeff_vision import symbols
from qeff_vision.contract.io_rows import HEAD_DIM, NUM_KV_HEADS
from qeff_vision.contract.states.attention import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ChunkedRing,
    CrossAttention,
    FullAttention,
    RingState,
    SharedKV,
    SlidingRing,
)
from qeff_vision.contract.states.base import KeptPrefix, LayerState
from qeff_vision.contract.states.latent import LatentAttention
from qeff_vision.contract.states.recurrent import LINEAR_ATTENTION, RECURRENT, RecurrentState

#: Every registered kind. A new kind is added here (and its export-time object in
#: :mod:`qeff_vision.export.state_caches`); nothing else in generic code names it.
KINDS: tuple[type[LayerState], ...] = (
    FullAttention,
    SlidingRing,
    ChunkedRing,
    SharedKV,
    RecurrentState,
    CrossAttention,
    LatentAttention,
)

__all__ = [
    "check_states",
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "KINDS",
    "LINEAR_ATTENTION",
    "RECURRENT",
    "SLIDING_ATTENTION",
    "ChunkedRing",
    "CrossAttention",
    "FullAttention",
    "KeptPrefix",
    "LatentAttention",
    "LayerState",
    "RecurrentState",
    "RingState",
    "SharedKV",
    "SlidingRing",
    "declared_state",
    "kind_for_layer_type",
    "kind_of_stem",
    "slot_roles",
    "slot_stems",
    "state_for_layer_type",
]


def slot_roles() -> tuple[Enum, ...]:
    """Roles of every per-slot retained row, over all kinds (what continuous batching indexes)."""
    return tuple(dict.fromkeys(role for kind in KINDS for role in kind.roles))


def slot_stems() -> tuple[str, ...]:
    """Stems of every per-layer state name (``past_key``, ``conv_state``, ...), over all kinds."""
    return tuple(dict.fromkeys(stem for kind in KINDS for stem in kind.stems))


def kind_of_stem(stem: str) -> type[LayerState] | None:
    """The kind whose rows carry names of ``stem`` (``past_key`` -> the first KV kind), else None."""
    return next((kind for kind in KINDS if stem in kind.stems), None)


def kind_for_layer_type(layer_type: str) -> type[LayerState] | None:
    """The kind whose default layer type is ``layer_type`` (``sliding_attention`` -> :class:`SlidingRing`).

    The one place a ``layer_types`` string is matched to a kind; generic code asks the kind
    (its ``span_attribute``, its mask overlay in :mod:`qeff_vision.export.ring_plan`) and never
    compares the string itself.
    """
    return next((kind for kind in KINDS if kind.layer_type == layer_type), None)


def state_for_layer_type(layer_type: str, text) -> LayerState:
    """The default state of a layer whose ``layer_types`` entry is ``layer_type``.

    The kind that declares that layer type decides (a ring needs its span in ``text``, the
    family's text geometry); any other type keeps a full-context cache.
    """
    kind = kind_for_layer_type(layer_type)
    return FullAttention() if kind is None else kind.for_layer_type(text)


def declared_state(
    length: str = symbols.CTX_LEN,
    kv_heads: str | int = NUM_KV_HEADS,
    head_dim: str | int = HEAD_DIM,
    reads: int | None = None,
    recurrent: bool = False,
) -> LayerState:
    """A state from the symbol-and-flags spelling (a bare slot symbol in a list of symbols).

    ``recurrent``: :class:`RecurrentState`; ``reads``: :class:`SharedKV`; a ring's symbol
    (``sliding_window``, ``chunk_ctx_len``): that ring; any other symbol: a full-context cache on
    that axis. Families return the classes themselves.

    Raises:
        ValueError: Both ``recurrent`` and ``reads``.
    """
    if recurrent and reads is not None:
        raise ValueError("a recurrent layer keeps its own state; it cannot read another layer's cache")
    if recurrent:
        return RECURRENT
    if reads is not None:
        return SharedKV(reads)
    for kind in KINDS:
        state = kind.for_slot_symbol(length, kv_heads, head_dim)
        if state is not None:
            return state
    return FullAttention(length, kv_heads, head_dim)


def check_states(states: Sequence[LayerState]) -> None:
    """Raise ValueError with the first problem any layer's declaration has among ``states``."""
    for layer, state in enumerate(states):
        problems = state.problems(layer, states)
        if problems:
            raise ValueError(problems[0])
