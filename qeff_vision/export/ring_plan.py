"""Ring buffers of window and chunked-attention layers: the slots a chunk reads and rewrites, the mask.

A ring layer (``sliding_attention`` with a window, ``chunked_attention`` with a block) keeps ``R``
KV slots instead of the whole context; every ring layer of a call shares one :class:`RingPlan`,
and :func:`ring_mask` gives its attention mask over (ring, chunk) keys. Used by
:mod:`qeff_vision.export.decoder`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from qeff_vision.contract.states import ChunkedRing, LayerState, SlidingRing, kind_for_layer_type

#: A ring kind's visibility overlay: (key positions, query positions, span) -> bool mask.
Overlay = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
_OVERLAYS: dict[type[LayerState], Overlay] = {}


def overlays(kind: type[LayerState]) -> Callable[[Overlay], Overlay]:
    """Register the mask overlay of a ring ``kind``: the export side of its class.

    As :func:`qeff_vision.export.state_caches.builds` registers a kind's cache object.
    """

    def register(overlay: Overlay) -> Overlay:
        _OVERLAYS[kind] = overlay
        return overlay

    return register


@overlays(SlidingRing)
def _window(keys: torch.Tensor, query: torch.Tensor, span: int) -> torch.Tensor:
    """A key is seen iff it is newer than ``query - window``."""
    return keys > query - span


@overlays(ChunkedRing)
def _block(keys: torch.Tensor, query: torch.Tensor, span: int) -> torch.Tensor:
    """A key is seen iff it is in the query's block of ``span`` positions.

    ref: transformers v5 masking_utils.py, ``chunked_overlay``: ``kv_idx // chunk_size ==
    q_idx // chunk_size``; both are >= 0 where allowed, so floor division names the block.
    """
    return torch.div(keys, span, rounding_mode="floor") == torch.div(query, span, rounding_mode="floor")


def span_overlay(layer_type: str, keys: torch.Tensor, query: torch.Tensor, span: int | None):
    """The overlay of ``layer_type``'s kind over (keys, query) with its ``span``; None without one.

    A layer type whose kind keeps the whole context (or a ring kind without a span) adds nothing.
    """
    overlay = _OVERLAYS.get(kind_for_layer_type(layer_type))
    return None if overlay is None or not span else overlay(keys, query, span)


def overlay_span(layer_type: str, spans: Mapping[str, int | None] | object) -> int | None:
    """The span of ``layer_type``'s ring kind read from ``spans`` by the kind's ``span_attribute``.

    ``spans`` has attributes (or keys) named as the kinds' text-geometry fields
    (``sliding_window``, ``attention_chunk_size``): the decoder's ``DecoderParts``, say.
    """
    attribute = getattr(kind_for_layer_type(layer_type), "span_attribute", "")
    if not attribute:
        return None
    return spans.get(attribute) if isinstance(spans, Mapping) else getattr(spans, attribute, None)


@dataclass
class RingPlan:
    """How a chunk reads and rewrites the ring buffers of window layers (all share one plan).

    A window layer keeps ``R`` slots; slot ``j`` holds the latest position ``q`` with
    ``q mod R == j``. The host protocol sends a sequence's tokens in order with padding (position
    -1) after them, and every earlier position was sent before, so the positions a ring holds
    follow from the chunk's first position alone: no stored-position tensor is needed.

    Attributes:
        key_positions: [batch, R + seq] positions of the keys attention sees: the ring before
            the chunk (negative where a slot was never written), then the chunk's own tokens.
        take_new: [batch, 1, R, 1] slots the chunk overwrites (the last R of its valid tokens).
        source: [batch, 1, R, 1] index in the chunk of the token each overwritten slot takes.
        write_slots: [batch, K] ring slots each row writes back (continuous batching: only these,
            :mod:`qeff_vision.export.kv_writes`), or None (the whole ring is rewritten).
        write_index: [batch, 1, K, 1] where each written slot's value is in (ring, chunk).
    """

    key_positions: torch.Tensor
    take_new: torch.Tensor
    source: torch.Tensor
    write_slots: torch.Tensor | None = None
    write_index: torch.Tensor | None = None

    @classmethod
    def for_chunk(
        cls, positions: torch.Tensor, ring_len, write_slots: torch.Tensor | None = None
    ) -> RingPlan:
        """The plan for a chunk with token ``positions`` [batch, seq] and ``ring_len`` slots.

        ``write_slots`` [batch, K] (:meth:`WritePlan.ring_slots`) names the slots to write back;
        they must hold every slot the chunk changes.
        """
        valid = positions >= 0
        count = valid.to(torch.int64).sum(dim=1, keepdim=True)
        first = torch.clamp(positions[:, :1], min=0)  # padding only follows the valid tokens
        end = first + count
        slots = torch.arange(ring_len).view(1, -1)
        held_before = first - 1 - torch.remainder(first - 1 - slots, ring_len)
        held_after = end - 1 - torch.remainder(end - 1 - slots, ring_len)
        take_new = held_after >= first
        source = torch.clamp(held_after - first, min=0, max=positions.shape[1] - 1)
        write_index = None
        if write_slots is not None:  # the same rule at the written slots, as an index into (ring, chunk)
            held = end - 1 - torch.remainder(end - 1 - write_slots, ring_len)
            chunk_index = ring_len + torch.clamp(held - first, min=0, max=positions.shape[1] - 1)
            write_index = torch.where(held >= first, chunk_index, write_slots).unsqueeze(1).unsqueeze(-1)
        return cls(
            key_positions=torch.cat([held_before, positions], dim=1),
            take_new=take_new.view(take_new.shape[0], 1, -1, 1),
            source=source.view(source.shape[0], 1, -1, 1),
            write_slots=write_slots,
            write_index=write_index,
        )

    def update(self, ring: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys for attention: ring then chunk, the rewritten ring) for one layer's K or V."""
        attend = torch.cat([ring, new.to(ring.dtype)], dim=2)
        index = self.source.expand(-1, ring.shape[1], -1, ring.shape[3])
        rewritten = torch.where(self.take_new, torch.gather(new.to(ring.dtype), 2, index), ring)
        return attend, rewritten


def ring_mask(
    positions: torch.Tensor,
    key_positions: torch.Tensor,
    sliding_window: int,
    same_image: torch.Tensor | None,
    dtype: torch.dtype,
    chunked: bool = False,
    kind: type[LayerState] | None = None,
) -> torch.Tensor:
    """Additive [batch, 1, seq, R + seq] mask of a ring layer over (ring, chunk) keys.

    transformers composes it as AND(window, OR(causal, same image)) (ref: transformers v5
    models/gemma3/modeling_gemma3.py, ``create_causal_mask_mapping``): keys newer than the query
    are seen only inside the query's image, keys older than the window never. ``chunked``: the
    window is a block of positions instead (ref: transformers v5 masking_utils.py,
    ``chunked_overlay``: ``kv_idx // chunk_size == q_idx // chunk_size``; the ring ``kind``'s
    registered overlay, :class:`SlidingRing` by default); a ring of
    ``min(ctx_len, chunk)`` slots holds every earlier key of the query's block, since the block
    starts after ``first - chunk`` for every query of a chunk starting at ``first``.
    """
    query = positions.unsqueeze(-1)
    keys = key_positions.unsqueeze(1)
    allowed = (keys <= query) & (query >= 0) & (keys >= 0)
    if same_image is not None:
        ring_part = torch.zeros_like(same_image[:, :, :1]).expand(
            -1, -1, key_positions.shape[1] - positions.shape[1]
        )
        allowed = allowed | torch.cat([ring_part, same_image], dim=-1)
    kind = ChunkedRing if chunked else (kind or SlidingRing)
    allowed = allowed & _OVERLAYS[kind](keys, query, sliding_window)
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(1)
