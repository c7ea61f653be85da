"""Llama 4 on its tiny checkpoint: tile token math, chunked-attention rings, chunked runs, batching.

The tiny has ``attention_chunk_size`` 16 (three chunked RoPE layers, then a NoPE layer), 84 px tiles
of 9 tokens and at most 2x2 tiles. Every run is compared with transformers' own generate on the same
processor outputs (tokens identical, logits within 1e-3): prompts and decodes crossing several
blocks, prefill chunks straddling block boundaries, a 1-tile and a 2x2-tile image (+ global tile)
split across chunks, four staggered requests under continuous batching with compute-context lengths.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.contract.language_io import KV_ROLES
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.llama4 import MAX_NUM_TILES
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime, chunks_of_image

FAMILY = "llama4"
BLOCK = 16  # the tiny's attention_chunk_size
ONE_TILE, TWO_BY_TWO = (80, 80), (170, 170)


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    """The session's tiny export with transformers' model and processor."""
    return FamilyRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


@pytest.mark.parametrize("size", [ONE_TILE, (100, 150), (200, 90), TWO_BY_TWO, (60, 300), (400, 410)])
def test_token_math_matches_the_processor(size, tiny_checkpoint, hf_model):
    """Tiles, rows and the first-to-last placeholder extent of one image, as the processor lays them out."""
    _, processor = hf_model(FAMILY)
    family, model = get_family(FAMILY), describe_checkpoint(tiny_checkpoint(FAMILY))
    processed = helpers.as_numpy(
        helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(*size)])
    )
    ids = processed["input_ids"].reshape(-1)
    placeholders = np.flatnonzero(ids == family.image_token_id(model))
    expected = family.vision_symbols(model, ImageSize(*size))
    assert expected[MAX_NUM_TILES] == processed["pixel_values"].shape[0]
    assert expected[symbols.VISION_SIZE] == len(placeholders)
    assert family.image_extent(model, ImageSize(*size)) == placeholders[-1] - placeholders[0] + 1
    assert family.host(model).placeholder_counts(processed) == [len(placeholders)]


def test_chunked_layers_keep_min_of_context_and_chunk_slots(runtime):
    """RoPE layers' caches are rings of min(ctx_len, attention_chunk_size); NoPE layers keep ctx_len."""
    family, model = runtime.family, runtime.checkpoint.description
    graph = onnx.load(str(runtime.language.path), load_external_data=False).graph
    slots = {
        i.name: i.type.tensor_type.shape.dim[2].dim_param for i in graph.input if i.name.startswith("past_")
    }
    types = family.layer_types(model)
    assert types == ["chunked_attention"] * 3 + ["full_attention"]
    for layer, kind in enumerate(types):
        expected = symbols.CHUNK_CTX_LEN if kind == "chunked_attention" else symbols.CTX_LEN
        assert slots[symbols.past_key(layer)] == slots[symbols.past_value(layer)] == expected
    from qeff_vision.runtime.generate import make_generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    for ctx_len, ring in ((512, BLOCK), (12, 12)):
        shape = LanguageShape((PrefillBucket(8, 8),), 8, ctx_len)
        generator = make_generator(runtime.checkpoint, runtime.vision, runtime.language, shape)
        caches = generator.empty_cache()
        rows = {row.name: row for row in generator.io.rows(*KV_ROLES)}
        assert {caches[name].shape[2] for name in rows if rows[name].layer < 3} == {ring}
        assert caches[symbols.past_key(3)].shape[2] == ctx_len


def _crossings(start: int, stop: int) -> int:
    """Block boundaries strictly inside positions [start, stop)."""
    return (stop - 1) // BLOCK - start // BLOCK


def test_text_prompt_and_decode_cross_blocks_with_straddling_chunks(runtime):
    """A 20-token bucket against 16-position blocks: chunks straddle boundaries; decode crosses more."""
    processed = runtime.inputs(("Tell me a long story about a lighthouse keeper and the sea.",), [])
    plan, result = runtime.run(processed, [20])
    length = result.prompt_tokens
    assert _crossings(0, length + NEW_TOKENS) >= 3
    assert sum(_crossings(c.start, c.stop) > 0 for c in plan.chunks) >= 2  # chunks straddle blocks
    assert length % 20 and len(plan.chunks) >= 3


@pytest.mark.parametrize(("seq_lens", "least_chunks"), [((16,), (2, 3)), ((12, 24), (1, 2))])
def test_one_tile_and_two_by_two_images_straddle_chunks(runtime, seq_lens, least_chunks):
    """A 1-tile image (9 rows) and a 2x2-tile image (4 tiles + global, 45 rows) split across chunks.

    With 16-token chunks both images straddle chunk (and block) boundaries; with buckets 12 and 24
    the planner's chunks differ in size and the 2x2 image still spans several.
    """
    images = [helpers.image(*ONE_TILE, seed=1), helpers.image(*TWO_BY_TWO, seed=2)]
    processed = runtime.inputs(("<image>", "and", "<image>", "What differs between these?"), images)
    assert processed["pixel_values"].shape[0] == 1 + 5
    plan, result = runtime.run(processed, seq_lens)
    assert [len(chunks_of_image(plan, image)) >= least for image, least in enumerate(least_chunks)] == [
        True
    ] * 2
    assert result.images == 2 and result.image_rows == 9 + 45
    assert _crossings(0, result.prompt_tokens) >= 3


def test_four_staggered_requests_with_compute_context_lengths(cb_exported, hf_model):
    """Continuous batching and CCL: five requests (four staggered, the fifth reuses a freed slot),
    decode calls at batch 4; every request's tokens equal transformers generate alone."""
    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from tests.test_batched_engine import SEQ_LENS, SLOTS, check_against_transformers, run_five

    runtime = FamilyRuntime(FAMILY, cb_exported(FAMILY, ccl=True), *hf_model(FAMILY))
    buckets = tuple(PrefillBucket(s, s) for s in SEQ_LENS)
    shape = LanguageShape(buckets, max(SEQ_LENS), 512, (64, 128, 512), (96, 112, 128, 512))
    generator = Generator(runtime.checkpoint, runtime.vision, runtime.language, shape)
    requests, report = run_five(runtime, generator)
    assert report.batched and report.full_batch_size == SLOTS and max(report.decode_batches) >= 2
    check_against_transformers(runtime, requests, report)
    fifth = report.requests[4]
    assert any(r.slot == fifth.slot and r.finished_step < fifth.admitted_step for r in report.requests[:4])
    used = {ccl for request in report.requests for ccl in request.result.ccl_history}
    assert len(used & {96, 112}) >= 1  # the decode CCL grew with the positions


@pytest.mark.parametrize("ctx_len", [32768, 131072])
def test_scout_kv_bytes_chunked_rings_and_nope_layers(ctx_len):
    """benchmarks/kv_memory.py on the pinned Scout: 36 chunked layers keep 8,192 slots, 12 NoPE ctx_len."""
    kv_memory = helpers.load_benchmark("kv_memory")
    config = kv_memory.ROOT / "specs" / "configs" / "Llama-4-Scout-17B-16E-Instruct" / "config.json"
    description = describe_checkpoint(config.parent, config)
    sizes = kv_memory.layout_bytes(get_family(FAMILY), description, ctx_len, kv_bytes=2, batch=1)
    per_slot = 2 * 2 * 8 * 128  # K and V, 2 bytes, 8 KV heads x 128
    assert sizes["ours"] == sizes["QEfficient"] == per_slot * (36 * 8192 + 12 * ctx_len)
    assert sizes["full ctx"] == per_slot * 48 * ctx_len


def test_the_config_view_derives_layer_types_as_transformers_and_notes_its_defaults():
    """No ``layer_types``: the ``no_rope_layers`` flags, else every ``no_rope_layer_interval``-th is NoPE."""
    family = get_family(FAMILY)
    text = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 128}
    config = {"vision_config": {"image_size": 336}, "image_token_index": 9, "text_config": text}
    derived = ModelDescription(config)
    assert family.layer_types(derived) == (["chunked_attention"] * 3 + ["full_attention"]) * 2
    notes = family.config_view(derived).notes
    assert any(note.startswith("text_config.no_rope_layer_interval not set; using 4") for note in notes)
    assert any(note.startswith("text_config.attention_chunk_size not set; using 8192") for note in notes)
    flagged = ModelDescription({**config, "text_config": {**text, "no_rope_layers": [1, 0] * 4}})
    assert family.layer_types(flagged) == ["chunked_attention", "full_attention"] * 4
    view = family.vision(derived)
    assert (view.tile, view.max_tiles, view.tokens_per_tile) == (336, 16, 144)
