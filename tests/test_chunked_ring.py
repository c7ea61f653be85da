"""The chunked-attention ring of the contract (Llama 4's RoPE layers), independent of any family.

A chunked layer sees a key iff it is in the query's block of ``attention_chunk_size`` positions and
not later (ref: transformers v5 masking_utils.py, ``chunked_overlay``). Its cache is a ring of
``min(ctx_len, attention_chunk_size)`` slots; fed chunk by chunk through the generic
:class:`RingPlan` with the block mask, attention must equal one pass over the whole sequence with
the block-causal mask, whatever the chunk sizes (a chunk straddling a block, a chunk longer than the
ring, padding tails, decode steps).
"""

import pytest
import torch

from qeff_vision import symbols
from qeff_vision.export.decoder import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DecoderParts,
    RetainedKVCache,
    ring_layers,
    ring_type,
)
from qeff_vision.export.kv_writes import write_plan
from qeff_vision.export.ring_plan import RingPlan, ring_mask
from qeff_vision.export.state_caches import ChunkWrites, RingKV
from qeff_vision.families.base import ModelDescription
from qeff_vision.families.llava import Llava

HEADS, DIM = 2, 4


def _attend(query, keys, values, mask):
    weights = torch.softmax(query @ keys.transpose(2, 3) + mask, dim=-1)
    return weights @ values


def _reference(query, keys, values, chunk):
    positions = torch.arange(keys.shape[2])
    q, k = positions.view(-1, 1), positions.view(1, -1)
    allowed = (k <= q) & (k // chunk == q // chunk)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    return _attend(query, keys, values, mask)


@pytest.mark.parametrize(
    ("chunk", "ctx_len", "windows"),
    [
        (4, 24, [5, 7, 3, 1, 1, 1, 1]),  # chunks straddle blocks; 7 > ring of 4
        (4, 24, [3, 3, 3, 3, 3, 3, 1, 1]),  # a bucket of 3 against blocks of 4
        (16, 12, [5, 4, 1, 1]),  # the context is shorter than a block: the ring is ctx_len
        (4, 24, [9, 1, 1, 1, 1, 1, 1]),  # a chunk longer than two blocks
    ],
)
@pytest.mark.parametrize("slots", [None, 2], ids=["one-sequence", "continuous-batching"])
def test_ring_chunks_equal_one_pass_with_the_block_mask(chunk, ctx_len, windows, slots):
    generator = torch.Generator().manual_seed(chunk + sum(windows))
    total = sum(windows)
    query = torch.randn(1, HEADS, total, DIM, generator=generator)
    keys = torch.randn(1, HEADS, total, DIM, generator=generator)
    values = torch.randn(1, HEADS, total, DIM, generator=generator)
    expected = _reference(query, keys, values, chunk)

    ring_len = min(ctx_len, chunk)
    # With continuous batching the ring has ``slots`` rows, the sequence lives in row 1, and only the
    # ring slots of the block's last positions are written back (export/kv_writes.py).
    rows = slots or 1
    ring = (torch.zeros(rows, HEADS, ring_len, DIM), torch.zeros(rows, HEADS, ring_len, DIM))
    batch_index = None if slots is None else torch.tensor([[1]])
    bucket = max(windows)
    start = 0
    for size in windows:
        pad = bucket - size if size > 1 else 0  # prefill chunks padded to one bucket (position -1)
        positions = torch.cat([torch.arange(start, start + size), torch.full((pad,), -1)]).view(1, -1)
        writes = write_plan(positions, batch_index, rows)
        ring_writes = None if slots is None else writes.ring_slots(ring_len)
        plan = RingPlan.for_chunk(positions, ring_len, ring_writes)
        call = ChunkWrites(positions, positions, positions, writes.batch_index, writes.fresh, plan)
        cache = RetainedKVCache({0: RingKV(*ring, call)})
        step = slice(start, start + size)
        new_k = torch.cat([keys[:, :, step], torch.zeros(1, HEADS, pad, DIM)], dim=2)
        new_v = torch.cat([values[:, :, step], torch.zeros(1, HEADS, pad, DIM)], dim=2)
        seen_k, seen_v = cache.update(new_k, new_v, 0)
        ring = (cache.keys[0], cache.values[0])
        mask = ring_mask(positions, plan.key_positions, chunk, None, torch.float32, chunked=True)
        q = torch.cat([query[:, :, step], torch.zeros(1, HEADS, pad, DIM)], dim=2)
        got = _attend(q, seen_k, seen_v, mask)[:, :, :size]
        torch.testing.assert_close(got, expected[:, :, step], rtol=1e-5, atol=1e-5)
        if slots is not None:  # the other slot's row is never written
            assert not cache.keys[0][0].any() and not cache.values[0][0].any()
        start += size


def test_the_block_mask_is_not_a_window():
    positions = torch.tensor([[4, 5, 6, 7, 8]])
    plan = RingPlan.for_chunk(positions, 4)
    mask = ring_mask(positions, plan.key_positions, 4, None, torch.float32, chunked=True)[0, 0] == 0
    keys = plan.key_positions[0].tolist()  # ring (never written: negative), then the chunk
    seen = {q: [k for k, ok in zip(keys, row) if ok] for q, row in zip(positions[0].tolist(), mask.tolist())}
    assert seen == {4: [4], 5: [4, 5], 6: [4, 5, 6], 7: [4, 5, 6, 7], 8: [8]}


def test_chunked_layers_are_rings_of_one_kind():
    parts = DecoderParts(
        embed_tokens=None,
        text_model=None,
        lm_head=None,
        image_token_id=0,
        layer_types=[CHUNKED_ATTENTION, CHUNKED_ATTENTION, CHUNKED_ATTENTION, FULL_ATTENTION],
        attention_chunk_size=16,
    )
    assert ring_layers(parts) == [True, True, True, False]
    assert ring_type(parts) == CHUNKED_ATTENTION
    parts.layer_types = [SLIDING_ATTENTION, CHUNKED_ATTENTION]
    parts.sliding_window = 8
    with pytest.raises(ValueError, match="one kind"):
        ring_type(parts)


def _described(layer_types, chunk):
    text = {"num_hidden_layers": len(layer_types), "layer_types": layer_types, "attention_chunk_size": chunk}
    return ModelDescription({"model_type": "llava", "text_config": text})


def test_declared_from_layer_types_with_min_of_context_and_chunk():
    family = Llava()
    model = _described([CHUNKED_ATTENTION, CHUNKED_ATTENTION, CHUNKED_ATTENTION, FULL_ATTENTION], 8192)
    assert family.kv_cache_symbols(model) == [symbols.CHUNK_CTX_LEN] * 3 + [symbols.CTX_LEN]
    assert family.kv_cache_lengths(model, 4096) == {symbols.CTX_LEN: 4096, symbols.CHUNK_CTX_LEN: 4096}
    assert family.kv_cache_lengths(model, 32768)[symbols.CHUNK_CTX_LEN] == 8192
    # Without a chunk size a "chunked" layer keeps the whole context (transformers would refuse it).
    assert family.kv_cache_symbols(_described([CHUNKED_ATTENTION], None)) == [symbols.CTX_LEN]
