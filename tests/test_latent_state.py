"""The multi-head latent attention state kind: latent cache rows, bytes, pairing and update rules."""

import numpy as np
import pytest
import torch

from qeff_vision import symbols
from qeff_vision.compile.onnxruntime_backend import untouched_slot_problems
from qeff_vision.contract.language_io import SLOT_ROLES, DType, language_io
from qeff_vision.contract.slot_names import is_kv_name, is_slot_name, with_kv_prefix
from qeff_vision.contract.states import KINDS, FullAttention, KeptPrefix
from qeff_vision.contract.states.latent import (
    KV_LORA_RANK,
    QK_ROPE_HEAD_DIM,
    Absorption,
    LatentAttention,
    LatentRole,
)
from qeff_vision.export.decoder import RetainedKVCache
from qeff_vision.export.kv_writes import write_plan
from qeff_vision.export.latent_cache import LatentKV
from qeff_vision.export.state_caches import ChunkWrites, layer_objects
from qeff_vision.runtime.retained_prefix import unpositioned_caches

LATENT = LatentAttention()
# DeepSeek-V3 / Kimi-K2.5 text config: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64, 128 heads of
# qk_nope_head_dim 128 and v_head_dim 128.
REAL = {KV_LORA_RANK: 512, QK_ROPE_HEAD_DIM: 64}
VALUES = {
    symbols.BATCH_SIZE: 1,
    symbols.FULL_BATCH_SIZE: 4,
    symbols.CTX_LEN: 16,
    KV_LORA_RANK: 8,
    QK_ROPE_HEAD_DIM: 4,
}


def test_rows_are_qefficients_latent_cache_names_and_shapes():
    io = language_io(2, cache_symbols=[LATENT, LATENT], merges_vision_rows=False)
    rows = io.rows(*SLOT_ROLES)
    assert [row.name for row in rows] == ["compressed_kv.0", "k_pe.0", "compressed_kv.1", "k_pe.1"]
    assert [row.role for row in rows[:2]] == [LatentRole.COMPRESSED_KV, LatentRole.ROPE_KEY]
    assert rows[0].concrete_shape(VALUES) == (1, 1, 16, 8)
    assert rows[1].concrete_shape(VALUES) == (1, 1, 16, 4)
    # QEfficient's dynamic axes: 0 the batch, 2 ctx_len; the widths are static model dimensions.
    assert rows[0].axes == {0: symbols.BATCH_SIZE, 2: symbols.CTX_LEN} == rows[1].axes
    assert all(row.dtype is DType.KV for row in rows)
    # Retained pairs in input order, and the KV precision in custom IO.
    assert io.retained_outputs() == {row.name: f"{row.name}_RetainedState" for row in rows}
    assert io.output_names[1:] == [f"{row.name}_RetainedState" for row in rows]
    assert dict(io.custom_io({DType.KV: "mxint8"}))["k_pe.1_RetainedState"] == "mxint8"
    assert not io.rows(*FullAttention.roles)  # no per-head K/V


def test_continuous_batching_slots_and_registered_names():
    io = language_io(1, cache_symbols=[LATENT], continuous_batching=True)
    assert [row.axes[0] for row in io.rows(*SLOT_ROLES)] == [symbols.FULL_BATCH_SIZE] * 2
    assert io.inputs[-1].name == symbols.BATCH_INDEX
    assert LatentAttention in KINDS and set(LatentAttention.roles) <= set(SLOT_ROLES)
    # Per-slot names of a registered kind: prefix renaming and the untouched-slot check see them.
    assert is_slot_name("compressed_kv.3_RetainedState") and is_slot_name("k_pe.0_vllmKvCache")
    assert not is_kv_name("compressed_kv.3")
    renamed = with_kv_prefix(io, "vllmKvCache")
    assert [row.name for row in renamed.rows(*SLOT_ROLES)] == [
        "compressed_kv.0_vllmKvCache",
        "k_pe.0_vllmKvCache",
    ]
    assert renamed.retained_outputs()["k_pe.0_vllmKvCache"] == "k_pe.0_vllmKvCache_RetainedState"
    feeds = {symbols.BATCH_INDEX: np.array([[2]]), "compressed_kv.0": np.zeros((4, 1, 16, 8))}
    moved = feeds["compressed_kv.0"].copy()
    moved[0, 0, 0, 0] = 1.0
    assert untouched_slot_problems(feeds, {"compressed_kv.0_RetainedState": moved})
    assert not untouched_slot_problems(feeds, {"compressed_kv.0_RetainedState": feeds["compressed_kv.0"]})


def test_bytes_per_position_against_per_head_kv():
    fp16 = {DType.KV: 2, DType.STATE: 4}
    assert LATENT.bytes_per_position(REAL, fp16) == (512 + 64) * 2 == 1152
    # Per-head K/V of the same layer: 128 heads x (192 key + 128 value) x 2 bytes = 81,920.
    per_head = FullAttention(kv_heads=128, head_dim=160).bytes_per_position({}, fp16)
    assert per_head == 81920 and per_head / LATENT.bytes_per_position(REAL, fp16) > 71
    # The rows' bytes at a context are that many positions.
    values = {**REAL, symbols.BATCH_SIZE: 1, symbols.CTX_LEN: 131072}
    assert LATENT.state_bytes(0, values, fp16, symbols.BATCH_SIZE) == 1152 * 131072


def test_a_kept_prefix_may_end_anywhere_and_zero_init():
    io = language_io(2, cache_symbols=[LATENT, symbols.SLIDING_WINDOW])
    assert LATENT.kept_prefix is KeptPrefix.ANY
    assert unpositioned_caches(io) == ["past_key.1", "past_value.1"]  # the ring only
    row = io.rows(LatentRole.ROPE_KEY)[0]
    assert not LATENT.initial(row, VALUES).any() and LATENT.initial(row, VALUES).shape == (1, 1, 16, 4)


def test_absorption_options_are_qefficients():
    assert Absorption.from_qaic_config({"cache_compressed": True}) is Absorption.NONE
    assert Absorption.from_qaic_config({"cache_compressed": True, "absorption": True}) is Absorption.OFFLINE
    online = {"cache_compressed": True, "absorption": True, "online": True}
    assert Absorption.from_qaic_config(online) is Absorption.ONLINE
    for bad in ({"cache_compressed": False}, {"cache_compressed": True, "online": True}, {"blocking": True}):
        with pytest.raises(ValueError, match="mla_absorption"):
            Absorption.from_qaic_config(bad)


def _objects(io, named, positions, batch_index=None, read_len=16):
    inputs = {
        layer: {row.role: named[row.name] for row in io.layer_rows(layer)} for layer in range(len(io.layers))
    }
    slots = next(iter(named.values())).shape[0]
    writes = write_plan(positions, batch_index, slots)
    read = torch.arange(read_len).view(1, -1).expand(positions.shape[0], -1)
    chunk = ChunkWrites(writes.full_slots(positions, 16), read, positions, writes.batch_index, writes.fresh)
    return layer_objects(dict(enumerate(io.layers)), inputs, chunk)


def test_update_writes_positions_padding_changes_nothing_and_reads_the_latent_only():
    io = language_io(1, cache_symbols=[LATENT])
    named = {"compressed_kv.0": torch.full((1, 1, 16, 8), 7.0), "k_pe.0": torch.full((1, 1, 16, 4), 7.0)}
    objects = _objects(io, named, torch.tensor([[3, 4, 5, -1]]))
    latent = RetainedKVCache(objects).layer_state(0)
    assert isinstance(latent, LatentKV)
    compressed = torch.arange(32, dtype=torch.float32).view(1, 1, 4, 8)
    rope = -torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4)
    read_compressed, read_rope = latent.update(compressed, rope)
    assert read_compressed.shape == (1, 1, 16, 8) and read_rope.shape == (1, 1, 16, 4)
    assert torch.equal(read_compressed[0, 0, 3:6], compressed[0, 0, :3])
    assert torch.equal(read_rope[0, 0, 3:6], rope[0, 0, :3])
    # Every other slot, the padding token's included, holds what it held.
    kept = [j for j in range(16) if j not in (3, 4, 5)]
    assert torch.equal(read_compressed[0, 0, kept], torch.full((13, 8), 7.0))
    rows = {row.name: objects[0].retained(row) for row in io.rows(*SLOT_ROLES)}
    assert torch.equal(rows["compressed_kv.0"], read_compressed) and torch.equal(rows["k_pe.0"], read_rope)

    # Attention over the latent equals attention over per-head K/V up-projected from it (the
    # absorbed form reads only the cache): q_nope . (W_uk c) == (W_uk^T q_nope) . c.
    generator = torch.Generator().manual_seed(0)
    heads, nope = 2, 3
    w_uk = torch.randn(heads, nope, 8, generator=generator)
    q_nope = torch.randn(heads, nope, generator=generator)
    q_rope = torch.randn(heads, 4, generator=generator)
    latent_keys, rope_keys = read_compressed[0, 0], read_rope[0, 0]  # [16, 8], [16, 4]
    per_head_keys = torch.einsum("hnr,jr->hjn", w_uk, latent_keys)
    full = torch.einsum("hn,hjn->hj", q_nope, per_head_keys) + q_rope @ rope_keys.T
    absorbed = torch.einsum("hn,hnr->hr", q_nope, w_uk) @ latent_keys.T + q_rope @ rope_keys.T
    torch.testing.assert_close(absorbed, full)


def test_continuous_batching_writes_only_the_named_slot():
    io = language_io(1, cache_symbols=[LATENT], continuous_batching=True)
    named = {"compressed_kv.0": torch.zeros(4, 1, 16, 8), "k_pe.0": torch.zeros(4, 1, 16, 4)}
    # Two rows: row 0 (slot 2) decodes position 6; row 1 is idle (position -1, slot 0).
    objects = _objects(io, named, torch.tensor([[6], [-1]]), torch.tensor([[2], [0]]))
    read_compressed, _ = objects[0].update(torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 4))
    after = objects[0].compressed
    assert after[2, 0, 6].eq(1).all() and after.sum() == 8  # only slot 2, position 6
    assert read_compressed[0, 0, 6].eq(1).all() and not read_compressed[1].any()


def test_kv_memory_benchmark_mla_rows_at_128k():
    """benchmarks/kv_memory.py's MLA table: Kimi-K2.5 at 128k, ours = QEfficient compressed < per-head."""
    from tests import helpers

    kv_memory = helpers.load_benchmark("kv_memory")
    sizes = kv_memory.mla_bytes(kv_memory.MLA_CONFIGS["Kimi-K2.5"], 131072, kv_bytes=2, batch=1)
    assert sizes["ours"] == sizes["QEfficient compressed"] == 61 * 1152 * 131072
    assert sizes["per-head K/V"] == 61 * 131072 * 64 * (192 + 128) * 2
