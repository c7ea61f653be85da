"""Attention K/V state kinds: full context, sliding and chunked rings, shared, cross-attention.

Each keeps ``past_key.{i}`` / ``past_value.{i}`` [slots, kv_heads, length, head_dim] (QEfficient's
names, so vLLM's qaic backend loads our programs), except a shared layer, which reads an earlier
layer's pair and has no rows. The export-time cache objects are in
:mod:`qeff_vision.export.state_caches` (``FullKV``, ``RingKV``, ``CrossKV``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from qeff_vision import symbols
from qeff_vision.contract.io_rows import HEAD_DIM, KV_ROLES, NUM_KV_HEADS, DType, IORow
from qeff_vision.contract.states.base import KeptPrefix, LayerState, retained_row

# Attention types of decoder layers, as transformers' text configs spell them (``layer_types``).
FULL_ATTENTION = "full_attention"
# A ``sliding_attention`` layer keeps a ring of ``sliding_window`` KV slots.
SLIDING_ATTENTION = "sliding_attention"
# Llama 4's RoPE layers: causal attention inside fixed ``attention_chunk_size`` blocks of positions
# (ref: transformers v5 masking_utils.py, ``chunked_overlay``): a key is seen iff it is in the
# query's block and not later. They keep a ring of ``min(ctx_len, attention_chunk_size)`` slots.
CHUNKED_ATTENTION = "chunked_attention"


@dataclass(frozen=True)
class FullAttention(LayerState):
    """A full-context KV cache: slot p holds position p (``length`` ``ctx_len``).

    Padding (position -1) and idle rows write back the value their slot already holds (export:
    ``FullKV``), so they change nothing; a kept prefix may end anywhere.

    Attributes:
        length: Symbol of the slot axis: ``ctx_len``, or a family's own symbol.
        kv_heads: KV heads: a :class:`~qeff_vision.contract.io_rows.Fixed` model dimension or an int.
        head_dim: Head dim: a ``Fixed`` model dimension or an int.
    """

    length: str = symbols.CTX_LEN
    kv_heads: str | int = NUM_KV_HEADS
    head_dim: str | int = HEAD_DIM

    kind: ClassVar[str] = "full"
    stems: ClassVar[tuple[str, ...]] = ("past_key", "past_value")
    roles: ClassVar[tuple] = KV_ROLES
    layer_type: ClassVar[str | None] = FULL_ATTENTION
    slot_axis: ClassVar[int | None] = 2

    @property
    def holds_kv(self) -> bool:
        """Its K/V pair may be read by a shared layer."""
        return True

    @property
    def kept_prefix(self) -> KeptPrefix:  # type: ignore[override]
        """Any prefix on a ``ctx_len`` axis; a family's own slot symbol is not indexed by position."""
        return KeptPrefix.ANY if self.length == symbols.CTX_LEN else KeptPrefix.AT_END

    def rows(self, layer: int, slots: str) -> tuple[IORow, ...]:
        """``past_key.{i}`` and ``past_value.{i}`` [slots, kv_heads, length, head_dim], dtype class KV."""
        shape = (slots, self.kv_heads, self.length, self.head_dim)
        return tuple(
            retained_row(name, role, DType.KV, shape, layer)
            for name, role in zip((symbols.past_key(layer), symbols.past_value(layer)), KV_ROLES)
        )

    def symbol_values(self, ctx_len: int) -> dict[str, int]:
        """``ctx_len`` for a full-context cache (a family binds its own symbol)."""
        return {symbols.CTX_LEN: ctx_len} if self.length == symbols.CTX_LEN else {}

    def bytes_per_position(self, values: Mapping[str, int], element_bytes: Mapping[DType, int]) -> int:
        """Key and value of one position: 2 x kv_heads x head_dim x the KV dtype's bytes."""
        heads, dim = (d if isinstance(d, int) else int(values[d]) for d in (self.kv_heads, self.head_dim))
        return 2 * heads * dim * element_bytes[DType.KV]


@dataclass(frozen=True)
class RingState(FullAttention):
    """A ring of KV slots (slot = position mod ring length) on a window or block layer.

    Every ring layer of a call shares one ring plan (export: ``RingKV``): the chunk's keys and the
    ring are read together and the last slots the chunk's valid tokens reach are rewritten, so
    padding changes nothing; under continuous batching a row writes back only the ring slots of
    its own slot. A ring cannot be rolled back: a kept prefix resumes where it stopped.

    Attributes:
        span: The window (or block) in positions, from the text config; None when declared
            without a config (the symbol is then bound by the family).
    """

    length: str = ""
    span: int | None = None

    kind: ClassVar[str] = "ring"
    #: The symbol of this ring's slot axis (a subclass sets it).
    symbol: ClassVar[str] = ""
    #: The text geometry's attribute holding the span (a subclass sets it).
    span_attribute: ClassVar[str] = ""
    ring: ClassVar[bool] = True

    def __post_init__(self):
        if not self.length:
            object.__setattr__(self, "length", self.symbol)

    @classmethod
    def for_layer_type(cls, text) -> LayerState:
        """A ring of the config's span; a full-context cache when the config sets none."""
        span = getattr(text, cls.span_attribute)
        return cls(span=int(span)) if span else FullAttention()

    @classmethod
    def for_slot_symbol(cls, symbol: str, kv_heads, head_dim) -> LayerState | None:
        """This ring, for its own symbol."""
        return cls(symbol, kv_heads, head_dim) if cls.symbol and symbol == cls.symbol else None

    @property
    def kept_prefix(self) -> KeptPrefix:  # type: ignore[override]
        """A ring is not indexed by position."""
        return KeptPrefix.AT_END

    def full_length(self) -> LayerState:
        """A ``ctx_len`` cache of the same heads and head dim, read under the layer type's mask."""
        return FullAttention(symbols.CTX_LEN, self.kv_heads, self.head_dim)

    def symbol_values(self, ctx_len: int) -> dict[str, int]:
        """The ring's length: its span, never longer than the context."""
        return {} if self.span is None else {self.length: min(self.span, ctx_len)}


@dataclass(frozen=True)
class SlidingRing(RingState):
    """A ``sliding_attention`` layer's ring of ``sliding_window`` slots (Gemma 3/4)."""

    symbol: ClassVar[str] = symbols.SLIDING_WINDOW
    span_attribute: ClassVar[str] = "sliding_window"
    layer_type: ClassVar[str | None] = SLIDING_ATTENTION


@dataclass(frozen=True)
class ChunkedRing(RingState):
    """A ``chunked_attention`` layer's ring of ``min(ctx_len, attention_chunk_size)`` slots (Llama 4)."""

    symbol: ClassVar[str] = symbols.CHUNK_CTX_LEN
    span_attribute: ClassVar[str] = "attention_chunk_size"
    layer_type: ClassVar[str | None] = CHUNKED_ATTENTION


@dataclass(frozen=True)
class SharedKV(LayerState):
    """A layer that computes no K/V and reads an earlier layer's cache (Gemma 4's shared KV layers).

    No rows, no export-time cache object (transformers hands it its producer's keys and values);
    it keeps nothing a prefix or an idle slot could change.

    Attributes:
        source: The earlier layer whose cache it reads.
    """

    source: int = 0

    kind: ClassVar[str] = "shared"

    @property
    def reads(self) -> int | None:
        """The producer layer."""
        return self.source

    def problems(self, layer: int, states: Sequence[LayerState]) -> list[str]:
        """It must read an earlier layer that holds K/V (not a shared or recurrent one)."""
        if 0 <= self.source < layer and states[self.source].holds_kv:
            return []
        return [f"layer {layer} reads layer {self.source}'s cache: not an earlier one with rows"]


@dataclass(frozen=True)
class CrossAttention(FullAttention):
    """Cross-attention K/V of the request's images (mllama): rows of the vision program's output.

    ``past_key.{i}`` / ``past_value.{i}`` [slots, kv_heads, length, head_dim] with ``length`` the
    family's image-states symbol. The graph returns them unchanged (export: ``CrossKV`` reads a
    row's own slot); the host writes a request's states into its slot and a kept prefix keeps
    them with the images.
    """

    kind: ClassVar[str] = "cross"
    layer_type: ClassVar[str | None] = None
    kept_prefix: ClassVar[KeptPrefix] = KeptPrefix.IMAGES

    @property
    def holds_kv(self) -> bool:
        """Not a producer for a shared self-attention layer."""
        return False

    def symbol_values(self, ctx_len: int) -> dict[str, int]:
        """None: the family binds the image-states symbol per request."""
        return {}

    def bytes_per_position(self, values: Mapping[str, int], element_bytes: Mapping[DType, int]) -> int:
        """0: its size follows the images, not the sequence (see :meth:`state_bytes`)."""
        return 0
