"""Export-time cache objects of the per-layer state kinds, registered by kind (torch).

Each kind of :mod:`qeff_vision.contract.states` has an object here that the traced attention (or
recurrent) module of a layer talks to during one call of the language program: it writes the
call's new entries into the retained input tensors and returns what the layer reads. A builder
registered for the kind (:func:`builds`) makes the objects of every layer of that kind from their
input tensors and the call's :class:`ChunkWrites`; :class:`RetainedKVCache` hands transformers'
``update(key, value, layer_idx)`` to the layer's object. An object answers ``retained(row)``: the
tensor to return as ``row``'s ``_RetainedState`` output.

The rules every object keeps (docs/design.md, "State kinds"): a padding token (position -1) and
an idle row change nothing; under continuous batching row r reads and writes slot
``batch_index[r]`` only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qeff_vision.contract.io_rows import IORow, Role
from qeff_vision.contract.states import CrossAttention, FullAttention, LayerState, RecurrentState, RingState

# Kinds whose export-time objects live in their own modules register their builders on import.
from qeff_vision.export import latent_cache  # noqa: F401, I001 - registers LatentKV
from qeff_vision.export.chunk_writes import Builder, ChunkWrites, builder_of, builds  # noqa: F401 - re-exported
from qeff_vision.export.recurrent_state import RecurrentStates


class FullKV:
    """A full-context layer's K/V (``FullAttention``): written at the tokens' positions, read whole.

    Attributes:
        keys: The key cache [slots, kv_heads, ctx, head_dim] (updated by :meth:`update`).
        values: The value cache, alike.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, chunk: ChunkWrites):
        self.keys, self.values, self.chunk = keys, values, chunk

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the call's keys and values; return the read slots of both caches."""
        chunk = self.chunk
        self.keys = chunk.write_positions(self.keys, key_states)
        self.values = chunk.write_positions(self.values, value_states)
        return chunk.read(self.keys, chunk.read_slots), chunk.read(self.values, chunk.read_slots)

    def retained(self, row: IORow) -> torch.Tensor:
        """The updated key or value cache."""
        return self.keys if row.role is Role.KV_KEY else self.values


class RingKV(FullKV):
    """A ring layer's K/V (``SlidingRing``, ``ChunkedRing``): read with the chunk, rewritten by the plan."""

    def _ring_update(self, ring: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.chunk
        if chunk.batch_index is None:
            return chunk.ring.update(ring, new)
        # The call's rows of the slot-indexed ring are read whole; without a plan's write slots
        # every ring slot of a row is written back (unchanged ones with their old value).
        slots = torch.arange(ring.shape[2]).view(1, -1).expand(new.shape[0], -1)
        if chunk.ring.write_slots is None:
            attend, rewritten = chunk.ring.update(chunk.read(ring, slots), new)
            return attend, chunk.write(ring, slots, rewritten)
        # Only the plan's slots are written back (the changed ones among them), so a padding row
        # sharing this slot writes other ring slots, with their own values (kv_writes).
        rows = chunk.read(ring, slots)
        attend = torch.cat([rows, new.to(rows.dtype)], dim=2)
        index = chunk.ring.write_index.expand(-1, rows.shape[1], -1, rows.shape[3])
        return attend, chunk.write(ring, chunk.ring.write_slots, torch.gather(attend, 2, index))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring and chunk keys/values attention reads (the plan's key positions); the ring rewritten."""
        keys, self.keys = self._ring_update(self.keys, key_states)
        values, self.values = self._ring_update(self.values, value_states)
        return keys, values


class CrossKV:
    """Cross-attention K/V (``CrossAttention``): read from the row's own slot, returned unchanged.

    transformers' cross-attention reads ``past_key_values.layers[i].keys`` / ``.values``; these are
    the row's slot of the inputs (all of them without continuous batching), optionally scaled per
    row (``row_scale`` [batch]: a family zeroes rows that see no image).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunk: ChunkWrites,
        row_scale: torch.Tensor | None = None,
    ):
        self.inputs = {Role.KV_KEY: keys, Role.KV_VALUE: values}
        self.keys = self._slot(keys, chunk)
        self.values = self._slot(values, chunk, row_scale)

    @staticmethod
    def _slot(states: torch.Tensor, chunk: ChunkWrites, scale: torch.Tensor | None = None) -> torch.Tensor:
        if chunk.batch_index is not None:  # [full_batch_size, ...] -> each row's own slot
            states = states[chunk.batch_index.view(-1)]
        return states if scale is None else states * scale.to(states.dtype).view(-1, 1, 1, 1)

    def retained(self, row: IORow) -> torch.Tensor:
        """The input, unchanged (the device keeps it resident; the host writes a slot's images)."""
        return self.inputs[row.role]


class RecurrentLayer:
    """A recurrent layer's view of the call's :class:`RecurrentStates` (one shared by every such layer)."""

    def __init__(self, states: RecurrentStates, layer: int):
        self.states, self.layer = states, layer

    def retained(self, row: IORow) -> torch.Tensor:
        """The layer's new conv or recurrent state."""
        return self.states.retained(self.layer, conv=row.role is Role.CONV_STATE)


def _kv_pairs(cls: type) -> Builder:
    def build(layers, chunk: ChunkWrites) -> dict[int, object]:
        return {
            layer: cls(tensors[Role.KV_KEY], tensors[Role.KV_VALUE], chunk)
            for layer, (_, tensors) in layers.items()
        }

    return build


builds(FullAttention)(_kv_pairs(FullKV))
builds(RingState)(_kv_pairs(RingKV))
builds(CrossAttention)(_kv_pairs(CrossKV))


@builds(RecurrentState)
def _recurrent(layers, chunk: ChunkWrites) -> dict[int, object]:
    """One :class:`RecurrentStates` for every recurrent layer of the call, a view per layer."""
    conv = {layer: tensors[Role.CONV_STATE] for layer, (_, tensors) in layers.items()}
    state = {layer: tensors[Role.RECURRENT_STATE] for layer, (_, tensors) in layers.items()}
    shared = RecurrentStates(conv, state, chunk.positions, chunk.batch_index)
    return {layer: RecurrentLayer(shared, layer) for layer in layers}


def layer_objects(
    states: Mapping[int, LayerState], tensors: Mapping[int, Mapping], chunk: ChunkWrites
) -> dict[int, object]:
    """Every layer's export-time object, built by its kind's builder (a layer without rows has none).

    Args:
        states: Layer -> its state, for the layers with rows.
        tensors: Layer -> {role: input tensor} of its rows.
        chunk: The call's writes.
    """
    groups: dict[Builder, dict[int, tuple[LayerState, Mapping]]] = {}
    for layer, state in states.items():
        builder = builder_of(state)
        if builder is None:
            raise ValueError(f"layer {layer}: no export-time cache object for state kind {state.kind!r}")
        groups.setdefault(builder, {})[layer] = (state, tensors[layer])
    objects: dict[int, object] = {}
    for builder, layers in groups.items():
        objects.update(builder(layers, chunk))
    return dict(sorted(objects.items()))


class RetainedKVCache:
    """Duck-typed transformers cache over the layers' export-time objects, keyed by decoder layer.

    transformers' attention calls ``update(key, value, layer_idx)``; it goes to that layer's
    object. A layer without rows (a shared layer, which transformers hands its producer's K/V)
    has no object and never calls ``update``. A module that talks to its own kind's object (a
    linear-attention layer, an MLA attention) asks :meth:`layer_state` for it.
    """

    def __init__(self, layers: Mapping[int, object]):
        self.by_layer = dict(layers)

    @property
    def keys(self) -> dict[int, torch.Tensor]:
        """Layer -> key cache of every layer whose object has one."""
        return {layer: obj.keys for layer, obj in self.by_layer.items() if hasattr(obj, "keys")}

    @property
    def values(self) -> dict[int, torch.Tensor]:
        """Layer -> value cache of every layer whose object has one."""
        return {layer: obj.values for layer, obj in self.by_layer.items() if hasattr(obj, "values")}

    def layer_state(self, layer_idx: int) -> object | None:
        """The export-time object of ``layer_idx`` (None for a layer without rows)."""
        return self.by_layer.get(layer_idx)

    def update(self, key_states, value_states, layer_idx, *_, **__):
        """Write this chunk's keys/values and return what attention reads for this layer.

        What else the attention layer passes (``cache_kwargs`` up to transformers 5.23, ``kwargs``
        from 5.24) only serves HF's own cache layers; positions here come from the write slots.
        """
        return self.by_layer[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Unused by our calls (positions are always given); present for HF's interface."""
        return 0

    def retained(self) -> list[torch.Tensor]:
        """Updated K/V caches in IO order: key, value of each layer with a KV pair, by layer."""
        return [t for layer in sorted(self.keys) for t in (self.keys[layer], self.values[layer])]
