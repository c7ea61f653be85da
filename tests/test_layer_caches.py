"""Per-layer cache declarations of the language IO table: own heads and head dim, or no rows at all."""

import pytest
import torch

from qeff_vision import symbols
from qeff_vision.contract.full_kv import full_length_caches, has_rings
from qeff_vision.contract.language_io import (
    CACHE_KINDS,
    FULL_CACHE,
    KV_ROLES,
    RECURRENT,
    RECURRENT_CACHE,
    RING_CACHE,
    SHARED_CACHE,
    STATE_ROLES,
    DType,
    Fixed,
    LayerCache,
    language_io,
)
from qeff_vision.export.decoder import RetainedKVCache
from qeff_vision.export.state_caches import ChunkWrites, FullKV

GLOBAL_HEADS, GLOBAL_DIM = Fixed("num_global_kv_heads"), Fixed("global_head_dim")
# Gemma 4's shape in miniature: sliding, full (wider, fewer heads), then one shared layer of each type.
LAYERS = [
    LayerCache(symbols.SLIDING_WINDOW),
    LayerCache(symbols.CTX_LEN, GLOBAL_HEADS, GLOBAL_DIM),
    LayerCache(symbols.SLIDING_WINDOW, reads=0),
    LayerCache(symbols.CTX_LEN, GLOBAL_HEADS, GLOBAL_DIM, reads=1),
]
VALUES = {
    symbols.BATCH_SIZE: 1,
    symbols.FULL_BATCH_SIZE: 4,
    symbols.CTX_LEN: 64,
    symbols.SLIDING_WINDOW: 8,
    "num_kv_heads": 2,
    "head_dim": 16,
    GLOBAL_HEADS: 1,
    GLOBAL_DIM: 32,
}


def test_each_layer_has_its_own_heads_and_head_dim():
    io = language_io(4, cache_symbols=LAYERS)
    shapes = {row.name: row.concrete_shape(VALUES) for row in io.rows(*KV_ROLES)}
    assert shapes == {
        "past_key.0": (1, 2, 8, 16),
        "past_value.0": (1, 2, 8, 16),
        "past_key.1": (1, 1, 64, 32),
        "past_value.1": (1, 1, 64, 32),
    }
    # The retained outputs carry the same per-layer axes.
    outputs = {row.name: row for row in io.outputs}
    assert outputs["past_key.1_RetainedState"].shape == io.rows(*KV_ROLES)[2].shape


def test_shared_layers_have_no_rows_and_name_their_producer():
    io = language_io(4, cache_symbols=LAYERS, continuous_batching=True)
    names = [row.name for row in (*io.inputs, *io.outputs)]
    shared = ("past_key.2", "past_value.2", "past_key.3", "past_value.3")
    assert not any(name.startswith(shared) for name in names)
    assert io.shared_layers() == {2: 0, 3: 1}
    assert [row.layer for row in io.rows(*KV_ROLES)] == [0, 0, 1, 1]
    # Custom IO and the continuous-batching slot axis follow the rows.
    assert [name for name, _ in io.custom_io({DType.KV: "float16"})] == [
        "past_key.0",
        "past_value.0",
        "past_key.1",
        "past_value.1",
        "past_key.0_RetainedState",
        "past_value.0_RetainedState",
        "past_key.1_RetainedState",
        "past_value.1_RetainedState",
    ]
    assert io.rows(*KV_ROLES)[0].concrete_shape(VALUES)[0] == 4


@pytest.mark.parametrize("reads", [2, 3, 5, -1])
def test_a_shared_layer_must_read_an_earlier_layer_with_rows(reads):
    layers = [*LAYERS[:3], LayerCache(symbols.CTX_LEN, reads=reads)]
    with pytest.raises(ValueError, match="reads layer"):
        language_io(4, cache_symbols=layers)


def test_the_four_layer_kinds_coexist_in_one_table():
    # full / sliding ring / shared / recurrent in one declaration; recurrent layers get state rows.
    layers = [*LAYERS, RECURRENT]
    io = language_io(5, cache_symbols=layers, continuous_batching=True)
    assert [cache.kind for cache in io.layers] == ["ring", "full", "shared", "shared", "recurrent"]
    assert [cache.kind for cache in io.layers] == [
        RING_CACHE,
        FULL_CACHE,
        SHARED_CACHE,
        SHARED_CACHE,
        RECURRENT_CACHE,
    ]
    assert [row.name for row in io.rows(*STATE_ROLES)] == ["conv_state.4", "recurrent_state.4"]
    assert [row.layer for row in io.rows(*KV_ROLES)] == [0, 0, 1, 1]
    # Declaring the layer recurrent by index is the same table.
    assert (
        language_io(
            5, cache_symbols=[*LAYERS, symbols.CTX_LEN], recurrent_layers=(4,), continuous_batching=True
        )
        == io
    )


def test_a_shared_layer_cannot_read_a_recurrent_layer():
    with pytest.raises(ValueError, match="reads layer"):
        language_io(2, cache_symbols=[RECURRENT, LayerCache(reads=0)])


def test_plain_symbols_still_declare_one_cache_per_layer():
    assert language_io(2, cache_symbols=[symbols.SLIDING_WINDOW, symbols.CTX_LEN]).layers == (
        LayerCache(symbols.SLIDING_WINDOW),
        LayerCache(symbols.CTX_LEN),
    )


def test_retained_cache_skips_layers_without_rows():
    keys = {layer: torch.zeros(1, 1, 4, 2) for layer in (0, 2)}
    chunk = ChunkWrites(write_slots=torch.tensor([[1]]), read_slots=torch.arange(4).view(1, -1))
    cache = RetainedKVCache({layer: FullKV(k, k.clone(), chunk) for layer, k in keys.items()})
    new = torch.ones(1, 1, 1, 2)
    read_keys, _ = cache.update(new, new * 2, 2)
    assert read_keys[0, 0, 1].tolist() == [1.0, 1.0]
    retained = cache.retained()
    assert len(retained) == 4 and retained[0].abs().sum() == 0 and retained[3][0, 0, 1].tolist() == [2.0, 2.0]


def test_cache_kinds_are_named_once_with_their_values_unchanged():
    # The names the code compares against keep the strings LayerCache.kind always returned.
    assert CACHE_KINDS == ("full", "ring", "shared", "recurrent")
    assert {LayerCache(symbols.CHUNK_CTX_LEN).kind, LayerCache(symbols.SLIDING_WINDOW).kind} == {RING_CACHE}
    assert LayerCache("max_num_images").kind == FULL_CACHE  # a family's own symbol is not a ring
    # retain_full_kv rewrites exactly the ring kinds: shared, recurrent and full layers are kept.
    full = full_length_caches([*LAYERS, RECURRENT])
    assert [cache.kind for cache in full] == [
        FULL_CACHE,
        FULL_CACHE,
        SHARED_CACHE,
        SHARED_CACHE,
        RECURRENT_CACHE,
    ]
    assert full[2] == LAYERS[2] and full[1] == LAYERS[1]
    assert has_rings(LAYERS) and not has_rings(full)
