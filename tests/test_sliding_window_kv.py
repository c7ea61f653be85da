"""Window layers keep a ring of ``sliding_window`` KV slots; generation stays identical to transformers.

Gemma 3 tiny with its sliding window widened to 16: 64-token prompts whose images sit before, across
and after position 16 (the first window edge), prefill chunks of 16 and 32 tokens, then 40 decode
tokens, so the ring wraps many times in prefill and in decode.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.families import get_family
from qeff_vision.families.base import describe_checkpoint
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

WINDOW = 16
CTX_LEN = 128
NEW_TOKENS = 40
PROMPT_TOKENS = 64
LOGIT_TOLERANCE = 1e-3
# name -> chat parts ("<image>" is an image; "{pad}" becomes filler text up to PROMPT_TOKENS).
PROMPTS = {
    "image_across_first_edge": ("<image>", "{pad}"),
    "image_after_the_edge": ("{pad}", "<image>", "Say."),
    "images_both_sides": ("<image>", "{pad}", "<image>"),
    "text_only": ("{pad}",),
}


@pytest.fixture(scope="module")
def window16(tmp_path_factory):
    """(export dir, HF model, processor) of the tiny Gemma 3 with a 16-token window."""
    from qeff_vision.exporter import export_model
    from qeff_vision.families.gemma3.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("gemma3-window16")
    checkpoint = write_tiny_checkpoint(root / "model", sliding_window=WINDOW)
    out = root / "export"
    export_model(checkpoint, out, progress=None)
    return out, *helpers.load_hf(checkpoint)


def _inputs(processor, name: str):
    parts = list(PROMPTS[name])
    images = [helpers.image(40 + 30 * i, 60, seed=i) for i, p in enumerate(parts) if p == "<image>"]
    for filler in range(200):  # grow the filler until the prompt is PROMPT_TOKENS long
        text = "x" * filler
        inputs = helpers.process(
            processor, helpers.user_turn(*[text if p == "{pad}" else p for p in parts]), images
        )
        if inputs["input_ids"].shape[1] >= PROMPT_TOKENS:
            return inputs
    raise AssertionError(name)


def _generator(export_dir, seq_len: int):
    shape = LanguageShape((PrefillBucket(seq_len, seq_len),), seq_len, CTX_LEN)
    common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: CTX_LEN}
    common[symbols.SLIDING_WINDOW] = WINDOW
    compiled = [
        {**common, symbols.SEQ_LEN: seq_len, symbols.VISION_SIZE: seq_len},
        {**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: seq_len},
    ]
    return generator_for_export(export_dir, shape, language_specializations=compiled)


def test_sliding_layers_export_a_ring_of_window_slots(window16):
    export_dir, model, _ = window16
    import json

    inputs = json.loads((export_dir / "export.json").read_text())["programs"]["lang"]["inputs"]
    kinds = model.config.text_config.layer_types
    for layer, kind in enumerate(kinds):
        expected = symbols.SLIDING_WINDOW if kind == "sliding_attention" else symbols.CTX_LEN
        assert inputs[symbols.past_key(layer)]["shape"][2] == expected
    family = get_family("gemma3")
    description = describe_checkpoint(model.name_or_path)
    assert family.kv_cache_lengths(description, CTX_LEN)[symbols.SLIDING_WINDOW] == WINDOW
    assert family.kv_cache_lengths(description, 8)[symbols.SLIDING_WINDOW] == 8  # never above ctx_len


@pytest.mark.parametrize("seq_len", [16, 32])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_ring_buffer_generation_matches_transformers(window16, name, seq_len):
    export_dir, model, processor = window16
    inputs = _inputs(processor, name)
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, NEW_TOKENS)
    generator = _generator(export_dir, seq_len)
    past = generator.empty_cache()
    assert past[symbols.past_key(0)].shape[2] == WINDOW and past[symbols.past_key(1)].shape[2] == CTX_LEN
    processed = helpers.as_numpy(inputs)
    spans = generator.plan(processed["input_ids"].reshape(-1), processed, "chunk").segments
    if name != "text_only":
        assert spans and (spans[0].start < WINDOW < spans[0].stop or spans[-1].start > WINDOW)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol="chunk", keep_logits=True)
    assert result.tokens == hf_tokens
    assert len(hf_tokens) == NEW_TOKENS  # decode runs 40 steps past the prompt, far past the window
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, hf_logits))
    assert worst <= LOGIT_TOLERANCE, worst


def test_gemma_3_4b_kv_table_ours_no_larger_than_qefficient():
    """benchmarks/kv_memory.py's layouts for the pinned gemma-3-4b-it config (29 window layers of 34)."""
    kv_memory = helpers.load_benchmark("kv_memory")
    DEFAULT_CONFIG, layouts = kv_memory.DEFAULT_CONFIG, kv_memory.layouts  # noqa: N806
    family, description = get_family("gemma3"), describe_checkpoint(DEFAULT_CONFIG.parent, DEFAULT_CONFIG)
    for ctx_len in (4096, 8192, 32768):
        slots = layouts(family, description, ctx_len)
        assert slots["ours"] == 5 * ctx_len + 29 * 1024 <= slots["QEfficient"] < slots["full ctx"]
