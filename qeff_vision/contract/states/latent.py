"""The multi-head latent attention kind (DeepSeek-V3 and Kimi-K2.5 decoders): a latent KV cache.

An MLA layer projects each token to a compressed KV vector (``kv_lora_rank`` wide, after
``kv_a_layernorm``) and a rotary key part (``qk_rope_head_dim`` wide, shared by every head, after
RoPE); per-head keys and values are up-projections of the compressed vector (``kv_b_proj``). The
cache keeps those two and not per-head K/V: (kv_lora_rank + qk_rope_head_dim) elements per position
instead of num_heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim). With absorption the
up-projections are folded into the query and the output, so decode reads the latent cache only.

Names and shapes are QEfficient's (pinned quic/efficient-transformers ebf55e8,
``transformers/models/deepseek_v3/modeling_deepseek.py`` ``get_dummy_pkv_cache`` and
``kimi_k25/modeling_kimi_k25.py`` ``get_onnx_dynamic_axes``): ``compressed_kv.{i}`` [batch,
latent_heads, ctx_len, kv_lora_rank] and ``k_pe.{i}`` [batch, latent_heads, ctx_len,
qk_rope_head_dim], dynamic axes 0 (``batch_size``, ``full_batch_size`` under continuous batching)
and 2 (``ctx_len``), retained as ``<name>_RetainedState``. ``latent_heads`` is 1 (the rows of
``kv_a_proj_with_mqa`` over kv_lora_rank + qk_rope_head_dim), more only with QEfficient's
``replicate_kv_heads``. Its ``qaic_config["mla_absorption"]`` options (``cache_compressed``,
``absorption``, ``online``) are :class:`Absorption`; every one with ``cache_compressed`` keeps
this same cache, only the attention's order of products differs.

The export-time object is :class:`~qeff_vision.export.latent_cache.LatentKV`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from qeff_vision import symbols
from qeff_vision.contract.io_rows import DType, Fixed, IORow
from qeff_vision.contract.states.base import KeptPrefix, LayerState, retained_row

#: Model dimensions of the latent rows; a family binds them in ``language_symbols``.
KV_LORA_RANK = Fixed("kv_lora_rank")
QK_ROPE_HEAD_DIM = Fixed("qk_rope_head_dim")


class LatentRole(Enum):
    """Roles of the latent cache's rows (this kind's own: they are neither keys nor values)."""

    COMPRESSED_KV = "compressed_kv"
    ROPE_KEY = "rope_key"


class Absorption(Enum):
    """How attention reads the latent cache: QEfficient's ``mla_absorption`` with ``cache_compressed``.

    ``NONE`` (``absorption`` False): per-head keys and values are up-projected from the cached
    latent on every call. ``OFFLINE`` (``absorption`` True, ``online`` False): the query and key
    up-projections are fused into one weight at export, so scores are taken against the latent
    itself. ``ONLINE`` (both True): the same product computed on the device per call.
    """

    NONE = "none"
    OFFLINE = "offline"
    ONLINE = "online"

    @classmethod
    def from_qaic_config(cls, options: Mapping[str, bool]) -> Absorption:
        """The mode of a ``qaic_config["mla_absorption"]`` mapping.

        Raises:
            ValueError: ``cache_compressed`` is not true (that is per-head K/V, not this kind), or
                ``online`` without ``absorption``, or an unknown key.
        """
        unknown = set(options) - {"cache_compressed", "absorption", "online"}
        if unknown:
            raise ValueError(f"mla_absorption: unknown key(s) {', '.join(sorted(unknown))}")
        if not options.get("cache_compressed", False):
            raise ValueError("mla_absorption: cache_compressed must be true for a latent cache")
        absorption, online = bool(options.get("absorption", False)), bool(options.get("online", False))
        if online and not absorption:
            raise ValueError("mla_absorption: online needs absorption")
        return cls.ONLINE if online else cls.OFFLINE if absorption else cls.NONE


@dataclass(frozen=True)
class LatentAttention(LayerState):
    """A multi-head latent attention layer's cache: ``compressed_kv.{i}`` and ``k_pe.{i}``.

    Full-context and positional like a full KV cache: slot p holds position p, padding and idle
    rows write back what their slot holds, row r of a continuous-batching call reads and writes
    slot ``batch_index[r]`` only, and a kept prefix may end anywhere.

    Attributes:
        kv_lora_rank: Width of the compressed KV (a ``Fixed`` model dimension or an int).
        rope_dim: Width of the rotary key part, ``qk_rope_head_dim``.
        latent_heads: The head axis of both rows (1; QEfficient's ``replicate_kv_heads`` makes more).
        absorption: How the layer's attention reads the cache (:class:`Absorption`).
    """

    kv_lora_rank: str | int = KV_LORA_RANK
    rope_dim: str | int = QK_ROPE_HEAD_DIM
    latent_heads: int = 1
    absorption: Absorption = Absorption.NONE

    kind: ClassVar[str] = "latent"
    stems: ClassVar[tuple[str, ...]] = ("compressed_kv", "k_pe")
    roles: ClassVar[tuple] = (LatentRole.COMPRESSED_KV, LatentRole.ROPE_KEY)
    kept_prefix: ClassVar[KeptPrefix] = KeptPrefix.ANY
    slot_axis: ClassVar[int | None] = 2

    def rows(self, layer: int, slots: str) -> tuple[IORow, ...]:
        """``compressed_kv.{i}`` [slots, latent_heads, ctx_len, kv_lora_rank], then ``k_pe.{i}``."""
        compressed, rope = self.stems
        return (
            retained_row(
                f"{compressed}.{layer}",
                LatentRole.COMPRESSED_KV,
                DType.KV,
                (slots, self.latent_heads, symbols.CTX_LEN, self.kv_lora_rank),
                layer,
            ),
            retained_row(
                f"{rope}.{layer}",
                LatentRole.ROPE_KEY,
                DType.KV,
                (slots, self.latent_heads, symbols.CTX_LEN, self.rope_dim),
                layer,
            ),
        )

    def symbol_values(self, ctx_len: int) -> dict[str, int]:
        """``ctx_len``: the cache holds every position."""
        return {symbols.CTX_LEN: ctx_len}

    def bytes_per_position(self, values: Mapping[str, int], element_bytes: Mapping[DType, int]) -> int:
        """(kv_lora_rank + qk_rope_head_dim) x latent_heads x the KV dtype's bytes."""
        rank, rope = (d if isinstance(d, int) else int(values[d]) for d in (self.kv_lora_rank, self.rope_dim))
        return (rank + rope) * self.latent_heads * element_bytes[DType.KV]
