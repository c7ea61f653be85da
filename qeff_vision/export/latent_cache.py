"""The export-time object of the multi-head latent attention kind (torch).

:class:`LatentKV` holds one MLA layer's ``compressed_kv.{i}`` and ``k_pe.{i}`` during a call of the
language program (:class:`~qeff_vision.contract.states.latent.LatentAttention`). An MLA attention
module gets it from the decoder's cache object, ``past_key_values.layer_state(layer_idx)``, and
calls :meth:`LatentKV.update` once per call instead of ``past_key_values.update``::

    latent = past_key_values.layer_state(self.layer_idx)
    compressed, rope_keys = latent.update(compressed_kv, k_pe)
    # compressed [batch, latent_heads, read_len, kv_lora_rank], rope_keys [..., qk_rope_head_dim]:
    # up-project (no absorption) or score the query against them directly (absorption).

Writes and reads follow the full-context rules (``FullKV``): ``CtxScatter`` at the tokens'
positions, padding writing back what its slot holds, ``CtxGather`` of the call's read slots
(``comp_ctx_lengths`` with CCL), ``CtxScatterCB`` / ``CtxGatherCB`` of the row's slot under
continuous batching.
"""

from __future__ import annotations

import torch

from qeff_vision.contract.io_rows import IORow
from qeff_vision.contract.states.latent import LatentAttention, LatentRole
from qeff_vision.export.chunk_writes import ChunkWrites, builds


class LatentKV:
    """One MLA layer's latent cache for one call.

    Attributes:
        compressed: ``compressed_kv.{i}`` [slots, latent_heads, ctx_len, kv_lora_rank], updated by
            :meth:`update`.
        rope_keys: ``k_pe.{i}`` [slots, latent_heads, ctx_len, qk_rope_head_dim], alike.
    """

    def __init__(self, compressed: torch.Tensor, rope_keys: torch.Tensor, chunk: ChunkWrites):
        self.compressed, self.rope_keys, self.chunk = compressed, rope_keys, chunk

    def update(self, compressed_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the call's latent entries; return what attention reads of both caches.

        Args:
            compressed_kv: [batch, latent_heads, seq, kv_lora_rank], the normed compressed KV
                (after ``kv_a_layernorm``) of the call's tokens.
            k_pe: [batch, latent_heads, seq, qk_rope_head_dim], their rotary key part after RoPE.

        Returns:
            (compressed [batch, latent_heads, read_len, kv_lora_rank], rope keys [batch,
            latent_heads, read_len, qk_rope_head_dim]) at the call's read slots: slot j is position
            j, masked by the decoder's causal mask like a full layer's keys.
        """
        chunk = self.chunk
        self.compressed = chunk.write_positions(self.compressed, compressed_kv)
        self.rope_keys = chunk.write_positions(self.rope_keys, k_pe)
        return chunk.read(self.compressed, chunk.read_slots), chunk.read(self.rope_keys, chunk.read_slots)

    def retained(self, row: IORow) -> torch.Tensor:
        """The updated compressed KV or rotary key cache."""
        return self.compressed if row.role is LatentRole.COMPRESSED_KV else self.rope_keys


@builds(LatentAttention)
def build_latent(layers, chunk: ChunkWrites) -> dict[int, LatentKV]:
    """A :class:`LatentKV` per MLA layer of the call (the kind's registered builder)."""
    return {
        layer: LatentKV(tensors[LatentRole.COMPRESSED_KV], tensors[LatentRole.ROPE_KEY], chunk)
        for layer, (_, tensors) in layers.items()
    }
