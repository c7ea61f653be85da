"""Gemma 3 chunk-aware generation on onnxruntime vs transformers generate (greedy, tokens identical).

Gemma 3 never splits an image across prefill chunks (its image tokens attend to each other both
ways), so the planner moves an image that would straddle a boundary whole into the next chunk. The
tiny checkpoint has 16 placeholders per image (22 prompt tokens with the markers) and a sliding
window of 8, shorter than every prompt here and than one image.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.families.gemma3.tiny import MM_TOKENS_PER_IMAGE, SLIDING_WINDOW
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import ChunkEnd, PrefillBucket
from tests import helpers

FAMILY = "gemma3"
CTX_LEN = 256
NEW_TOKENS = 8
LOGIT_TOLERANCE = 1e-3
PROTOCOLS = ("chunk", "full")
LONG_TEXT = "A paragraph of plain text that fills at least one whole prefill chunk between two images."

# Prompt name -> (chat parts, image sizes); "<image>" marks an image part.
PROMPTS = {
    "one_image": (("<image>", "Describe this image."), [(100, 150)]),
    "two_images": (("<image>", "<image>", "Compare."), [(90, 120), (120, 90)]),
    "image_text_image": (("<image>", LONG_TEXT, "<image>", "Which?"), [(64, 64), (200, 100)]),
    "image_at_start_and_end": (("<image>", "and", "<image>"), [(80, 80), (50, 70)]),
    "text_only": (("No image here, only a prompt longer than the sliding window.",), []),
}
# Bucket sets (seq_len, vision_size); the full protocol needs V >= all image rows (32 here).
BUCKETS = {
    "s16": ((16, 16),),
    "s16+s24": ((16, 32), (24, 32)),
    "s48": ((48, 32),),
    "s128": ((48, 32), (128, 64)),
}

_reference: dict[str, tuple] = {}
_generators: dict[tuple, object] = {}
_runs: dict[tuple, tuple] = {}


def _inputs(processor, name: str):
    parts, sizes = PROMPTS[name]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    return helpers.process(processor, helpers.user_turn(*parts), images)


def _hf(hf_model, name: str):
    """(processed numpy inputs, HF tokens, HF logits) per prompt, generated once per session."""
    if name not in _reference:
        model, processor = hf_model(FAMILY)
        inputs = _inputs(processor, name)
        tokens, logits = helpers.hf_generate(model, inputs, NEW_TOKENS)
        _reference[name] = (helpers.as_numpy(inputs), tokens, logits)
    return _reference[name]


def _generator(exported, buckets):
    """One generator (two onnxruntime sessions) per bucket set, shared by the tests."""
    if buckets not in _generators:
        _generators[buckets] = _new_generator(exported, buckets)
    return _generators[buckets]


def _new_generator(exported, buckets):
    prefill = tuple(PrefillBucket(s, v) for s, v in buckets)
    shape = LanguageShape(prefill, max(b.vision_size for b in prefill), CTX_LEN)
    common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: CTX_LEN}
    compiled = [{**common, symbols.SEQ_LEN: b.seq_len, symbols.VISION_SIZE: b.vision_size} for b in prefill]
    compiled.append({**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: shape.decode_vision_size})
    return generator_for_export(exported(FAMILY), shape, language_specializations=compiled)


def _chunk_holding(plan, span) -> int:
    """Index of the chunk whose tokens hold all of ``span`` (every image has one: none is split)."""
    return next(c.index for c in plan if c.start <= span.start and span.stop <= c.stop)


def _run(hf_model, exported, name: str, buckets, protocol: str):
    """Generate on onnxruntime, check tokens and logits against transformers; return (plan, result)."""
    if (name, buckets, protocol) not in _runs:
        _runs[name, buckets, protocol] = _generate_and_compare(hf_model, exported, name, buckets, protocol)
    return _runs[name, buckets, protocol]


def _generate_and_compare(hf_model, exported, name: str, buckets, protocol: str):
    processed, hf_tokens, hf_logits = _hf(hf_model, name)
    generator = _generator(exported, buckets)
    input_ids = processed["input_ids"].reshape(-1)
    plan = generator.plan(input_ids, processed, protocol)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol=protocol, keep_logits=True)
    assert result.tokens == hf_tokens, (name, buckets, protocol)
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, hf_logits))
    assert worst <= LOGIT_TOLERANCE, (name, buckets, protocol, worst)
    for span in plan.segments:  # no image is ever split: one chunk holds all its placeholders
        assert any(chunk.start <= span.start and span.stop <= chunk.stop for chunk in plan), span
    assert len(result.chunks) == len(plan)
    return plan, result


def _cases():
    """Prompt x bucket set x protocol; the full protocol only where V holds every image row."""
    for name, (_, sizes) in PROMPTS.items():
        for buckets, pairs in BUCKETS.items():
            for protocol in PROTOCOLS:
                if protocol == "chunk" or max(v for _, v in pairs) >= len(sizes) * MM_TOKENS_PER_IMAGE:
                    yield pytest.param(name, pairs, protocol, id=f"{name}-{buckets}-{protocol}")


@pytest.mark.parametrize(("name", "buckets", "protocol"), list(_cases()))
def test_chunked_generation_matches_transformers(name, buckets, protocol, hf_model, exported):
    """Tokens identical to generate and logits within 1e-3; every image whole in one chunk."""
    _run(hf_model, exported, name, buckets, protocol)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_straddling_a_boundary_moves_whole_into_the_next_chunk(protocol, hf_model, exported):
    """A 16-token bucket would cut the image at [10, 26): chunk 0 stops at the image, chunk 1 is the image."""
    plan, _ = _run(hf_model, exported, "one_image", BUCKETS["s16"], protocol)
    span = plan.segments[0]
    assert 0 < span.start < 16 < span.stop  # where a plain 16-token cut would fall
    first, second = plan.chunks[0], plan.chunks[1]
    assert (first.stop, first.end, first.placeholders) == (span.start, ChunkEnd.IMAGE_BOUNDARY, 0)
    assert (second.start, second.stop) == (span.start, span.stop)


def test_prompts_are_longer_than_the_sliding_window(hf_model):
    """The sliding layer's window cuts every prompt, one image, and the text-only prompt too."""
    assert MM_TOKENS_PER_IMAGE > SLIDING_WINDOW
    for name in PROMPTS:
        assert _hf(hf_model, name)[0]["input_ids"].shape[1] > 4 * SLIDING_WINDOW


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_images_in_one_chunk(protocol, hf_model, exported):
    """A 48-token bucket holds both images of the prompt (32 rows) in its first chunk."""
    plan, _ = _run(hf_model, exported, "two_images", BUCKETS["s48"], protocol)
    assert plan.chunks[0].images == (0, 1) and plan.chunks[0].placeholders == 2 * MM_TOKENS_PER_IMAGE


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_then_text_only_chunk_then_image(protocol, hf_model, exported):
    """Image A, a chunk with no placeholder, image B: B still reads its own rows (image_idx never resets)."""
    plan, _ = _run(hf_model, exported, "image_text_image", BUCKETS["s16+s24"], protocol)
    chunk_a, chunk_b = (_chunk_holding(plan, span) for span in plan.segments)
    between = plan.chunks[chunk_a + 1 : chunk_b]
    assert between and all(chunk.placeholders == 0 for chunk in between)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prompt_shorter_than_one_chunk_is_one_padded_chunk(protocol, hf_model, exported):
    """The 128-token bucket takes the whole prompt; the tail is padding (position -1)."""
    plan, _ = _run(hf_model, exported, "one_image", BUCKETS["s128"], protocol)
    assert len(plan) == 1 and plan.chunks[0].seq_len == 128 and plan.chunks[0].padding > 0


def test_image_at_start_and_end_and_last_chunk_padding(hf_model, exported):
    """Images open and close the user turn; the last chunk is the smallest bucket holding it, padded."""
    plan, _ = _run(hf_model, exported, "image_at_start_and_end", BUCKETS["s16+s24"], "chunk")
    decode = hf_model(FAMILY)[1].tokenizer.decode
    input_ids = _hf(hf_model, "image_at_start_and_end")[0]["input_ids"][0]
    first, last = plan.segments
    assert decode(input_ids[: first.start]) == "<bos><start_of_turn>user\n\n\n<start_of_image>"
    assert decode(input_ids[last.stop :]) == "<end_of_image>\n\n<end_of_turn>\n<start_of_turn>model\n"
    assert plan.chunks[-1].padding > 0


def test_pan_and_scan_crops_run_as_extra_images(hf_model, exported):
    """With pan-and-scan on, each crop is one more fixed-size image with its own whole block."""
    model, processor = hf_model(FAMILY)
    text = processor.apply_chat_template(
        helpers.user_turn("<image>", "Describe."), add_generation_prompt=True
    )
    inputs = processor(
        text=[text],
        images=[helpers.image(60, 300)],
        return_tensors="pt",
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=32,
    )
    crops = inputs["pixel_values"].shape[0] - 1
    assert crops >= 2
    hf_tokens, _ = helpers.hf_generate(model, inputs, NEW_TOKENS)
    generator = _generator(exported, ((32, 32),))
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS)
    assert result.tokens == hf_tokens
    assert sum(chunk.rows for chunk in result.chunks) == (crops + 1) * MM_TOKENS_PER_IMAGE
