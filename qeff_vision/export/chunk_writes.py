"""Where one call of the language program writes and reads, and the registry of state builders.

Shared by :mod:`qeff_vision.export.state_caches` and the kinds whose export-time objects live in
modules of their own (:mod:`qeff_vision.export.latent_cache`): they import this module, and
``state_caches`` imports them to register their builders, so no two files import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from qeff_vision.contract.states import LayerState
from qeff_vision.export.kv_ops import (
    CtxGatherCBFunction,
    CtxGatherFunction,
    CtxScatterCBFunction,
    CtxScatterFunction,
)
from qeff_vision.export.ring_plan import RingPlan

#: ``builder(layers, chunk) -> {layer: object}``; ``layers``: layer -> (state, {role: input tensor}).
Builder = Callable[[Mapping[int, tuple[LayerState, Mapping]], "ChunkWrites"], dict[int, object]]
_BUILDERS: dict[type[LayerState], Builder] = {}


def builds(kind: type[LayerState]) -> Callable[[Builder], Builder]:
    """Register the builder of ``kind``'s export-time objects (a subclass inherits it unless it has one)."""

    def register(builder: Builder) -> Builder:
        _BUILDERS[kind] = builder
        return builder

    return register


def builder_of(state: LayerState) -> Builder | None:
    """The builder registered for ``state``'s kind or its nearest registered base; None if none."""
    return next((_BUILDERS[kind] for kind in type(state).__mro__ if kind in _BUILDERS), None)


@dataclass
class ChunkWrites:
    """Where one call writes and reads: what every layer's object of the call shares.

    Attributes:
        write_slots: [batch, seq] full-context slot of each token (padding: a slot nobody reads).
        read_slots: [batch, read_len] slots attention reads (the first ``comp_ctx_lengths``).
        positions: [batch, seq] text positions (-1: padding or an idle row).
        batch_index: [batch, 1] slot of each row (continuous batching), else None.
        fresh: [batch, seq] tokens that write their own value (the others write back what their
            slot holds, :mod:`qeff_vision.export.kv_writes`), or None (every token writes).
        ring: The call's ring plan, shared by every ring layer, or None without rings.
    """

    write_slots: torch.Tensor
    read_slots: torch.Tensor
    positions: torch.Tensor | None = None
    batch_index: torch.Tensor | None = None
    fresh: torch.Tensor | None = None
    ring: RingPlan | None = None

    def write(self, cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``CtxScatter`` (``CtxScatterCB`` under continuous batching) of ``states`` at ``slots``."""
        if self.batch_index is None:
            return CtxScatterFunction.apply(cache, slots, states)
        return CtxScatterCBFunction.apply(cache, self.batch_index, slots, states)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``CtxGather`` (``CtxGatherCB``) of ``slots``."""
        if self.batch_index is None:
            return CtxGatherFunction.apply(cache, slots)
        return CtxGatherCBFunction.apply(cache, self.batch_index, slots)

    def write_positions(self, cache: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``states`` [batch, heads, seq, dim] written at the tokens' slots (padding: what it finds)."""
        if self.fresh is not None:
            kept = self.read(cache, self.write_slots).to(states.dtype)
            states = torch.where(self.fresh.unsqueeze(1).unsqueeze(-1), states, kept)
        return self.write(cache, self.write_slots, states)
