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
    from qeff_vision.families import describe_checkpoint, family_for
    from tests import helpers

    kv_memory = helpers.load_benchmark("kv_memory")
    config = kv_memory.PINNED / "Kimi-K2.5" / "config.json"
    assert config in kv_memory.latent_configs([])  # the table finds it without --config
    description = describe_checkpoint(config.parent, config)
    per_position = kv_memory.latent_layouts(family_for(description), description, kv_bytes=2)
    sizes = {layout: count * 131072 for layout, count in per_position.items()}
    assert sizes["ours"] == sizes["QEfficient cache_compressed"] == 61 * 1152 * 131072
    assert sizes["per-head K/V"] == 61 * 131072 * 64 * (192 + 128) * 2


class _ToyLatentModel(torch.nn.Module):
    """A text model whose attention reads only the latent cache, through ``layer_state(i).update``.

    Per layer: compressed KV and a key part from the hidden state, per-head keys and values
    up-projected from the cached latent (no absorption), one output projection. No RoPE: the
    positions enter through the decoder's mask only, which is all the cache object's rules need.
    """

    def __init__(self, layers=2, hidden=16, rank=8, rope=4, heads=2, nope=4):
        super().__init__()
        self.rank, self.rope, self.heads, self.nope = rank, rope, heads, nope
        self.kv_a = torch.nn.ModuleList(torch.nn.Linear(hidden, rank + rope) for _ in range(layers))
        self.q = torch.nn.ModuleList(torch.nn.Linear(hidden, heads * (nope + rope)) for _ in range(layers))
        self.up_k = torch.nn.ModuleList(torch.nn.Linear(rank, heads * nope) for _ in range(layers))
        self.up_v = torch.nn.ModuleList(torch.nn.Linear(rank, heads * nope) for _ in range(layers))
        self.o = torch.nn.ModuleList(torch.nn.Linear(heads * nope, hidden) for _ in range(layers))

    def forward(self, inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, **_):
        from types import SimpleNamespace

        hidden, mask = inputs_embeds, attention_mask["full_attention"]  # mask [b, 1, seq, read]
        batch, seq, _ = hidden.shape
        for i in range(len(self.kv_a)):
            latent, rope = self.kv_a[i](hidden).unsqueeze(1).split([self.rank, self.rope], dim=-1)
            compressed, rope_keys = past_key_values.layer_state(i).update(latent, rope)
            read = compressed.shape[2]
            keys = self.up_k[i](compressed[:, 0]).view(batch, read, self.heads, self.nope).transpose(1, 2)
            keys = torch.cat([keys, rope_keys.expand(-1, self.heads, -1, -1)], dim=-1)
            values = self.up_v[i](compressed[:, 0]).view(batch, read, self.heads, self.nope).transpose(1, 2)
            query = self.q[i](hidden).view(batch, seq, self.heads, -1).transpose(1, 2)
            weights = torch.softmax(query @ keys.transpose(-1, -2) + mask, dim=-1)
            hidden = hidden + self.o[i]((weights @ values).transpose(1, 2).reshape(batch, seq, -1))
        return SimpleNamespace(last_hidden_state=hidden)


def _toy_decoder():
    from qeff_vision.export.decoder import DecoderParts, LanguageDecoder

    torch.manual_seed(0)
    parts = DecoderParts(
        embed_tokens=torch.nn.Embedding(32, 16),
        text_model=_ToyLatentModel(),
        lm_head=torch.nn.Linear(16, 32),
        image_token_id=31,
        layer_types=["full_attention", "full_attention"],
    )
    io = language_io(2, cache_symbols=[LATENT, LATENT])
    return LanguageDecoder(parts, io).eval(), io


def _call(io, ids, states, start, stop, bucket):
    """One call's inputs by name: tokens ``start..stop`` padded to ``bucket`` (position -1)."""
    size = stop - start
    positions = torch.cat([torch.arange(start, stop), torch.full((bucket - size,), -1)]).view(1, -1)
    tokens = torch.cat([ids[:, start:stop], torch.zeros(1, bucket - size, dtype=torch.long)], dim=1)
    named = {
        symbols.INPUT_IDS: tokens,
        symbols.POSITION_IDS: positions,
        symbols.VISION_EMBEDS: torch.zeros(1, 1, 16),
        symbols.IMAGE_IDX: torch.zeros(1, 1, dtype=torch.long),
        **states,
    }
    return [named[name] for name in io.input_names]


def test_the_generic_decoder_runs_an_mla_model_chunked_as_in_one_pass():
    decoder, io = _toy_decoder()
    ids = torch.randint(0, 30, (1, 10))

    def run(chunks):
        states = {row.name: torch.zeros(row.concrete_shape(VALUES)) for row in io.rows(*SLOT_ROLES)}
        for start, stop, bucket in chunks:
            with torch.no_grad():
                outputs = dict(zip(io.output_names, decoder(*_call(io, ids, states, start, stop, bucket))))
            states = {name: outputs[io.retained_outputs()[name]] for name in states}
        return outputs[symbols.LOGITS], states

    whole, whole_states = run([(0, 9, 9), (9, 10, 1)])  # prefill 9, decode 1
    chunked, chunked_states = run([(0, 4, 4), (4, 8, 4), (8, 9, 4), (9, 10, 1)])  # a padded tail
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    for name, state in whole_states.items():
        torch.testing.assert_close(chunked_states[name], state, rtol=1e-5, atol=1e-5)
        assert not state[:, :, 10:].any()  # nothing written past the last position, padding included


def test_the_mla_decoder_exports_and_runs_on_onnxruntime(tmp_path):
    """The traced graph (CtxScatter / CtxGather on the latent rows) equals eager at another ctx_len."""
    import onnx
    import onnxruntime as ort

    from qeff_vision.export.kv_ops import DOMAIN, DOMAIN_VERSION, attach_functions
    from qeff_vision.exporter import OPSET

    decoder, io = _toy_decoder()
    ids = torch.randint(0, 30, (1, 24))
    zeros = {row.name: torch.zeros(row.concrete_shape(VALUES)) for row in io.rows(*SLOT_ROLES)}
    path = tmp_path / "lang.onnx"
    with torch.no_grad():
        torch.onnx.export(
            decoder,
            tuple(_call(io, ids, zeros, 0, 4, 4)),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=io.input_names,
            output_names=io.output_names,
            dynamic_axes={
                name: axes for name, axes in {**io.input_axes(), **io.output_axes()}.items() if axes
            },
            custom_opsets={DOMAIN: DOMAIN_VERSION},
        )
    model = onnx.load(str(path))
    attach_functions(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # ctx_len 32 (traced at 16): chunks of 16 (traced at 4), positions past 16, a decode step.
    states = {
        row.name: torch.zeros(row.concrete_shape({**VALUES, symbols.CTX_LEN: 32}))
        for row in io.rows(*SLOT_ROLES)
    }
    for start, stop, bucket in ((0, 16, 16), (16, 22, 16), (22, 23, 1)):
        inputs = _call(io, ids, states, start, stop, bucket)
        with torch.no_grad():
            eager = dict(zip(io.output_names, decoder(*inputs)))
        graph = dict(
            zip(io.output_names, session.run(None, dict(zip(io.input_names, (t.numpy() for t in inputs)))))
        )
        for name, value in eager.items():
            np.testing.assert_allclose(graph[name], value.numpy(), rtol=1e-5, atol=1e-5)
        states = {name: eager[io.retained_outputs()[name]] for name in states}
