"""LLaVA-NeXT chunk-aware generation on onnxruntime vs transformers' generate (greedy, tokens identical).

The tiny checkpoint tiles images of any size onto its grid pinpoints, so each image size below
is its own vision specialization with its own token count (36 to 70 placeholders). The decoder
is causal, so an image may be split across chunks. Every case runs with several bucket sets and
both vision protocols, on programs restricted to the shapes a compiled QPC would accept, and each
edge case asserts that its plan really has the shape it is named after.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generate import DEFAULT_CACHE_BYTES, generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

FAMILY = "llava_next"
NEW_TOKENS = 6
CTX_LEN = 448
MAX_IMAGES = 2
LOGIT_TOLERANCE = 1e-3
PROTOCOLS = ("chunk", "full")
# Bucket sets (seq_len values): chunks that cut an image in several pieces, one mid size, a pair
# where the remainder takes the small bucket, and one bucket larger than every prompt.
SEQ_LEN_SETS = ((16, 64), (48,), (40, 256), (384,))
# Image sizes and the pinpoint each lands on (tiles of 56 px): 112x112 (rows cropped),
# 168x56 (columns cropped), 56x168 (rows cropped), 56x56 (nothing cropped).
WIDE, TALL, PANORAMA, SMALL = (100, 150), (300, 120), (60, 200), (40, 40)
IMAGE_SIZES = (WIDE, TALL, PANORAMA, SMALL)

LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light in it is softer. "
)
# Chat turns ("<image>" parts become the processor's placeholders); the last prompt is raw text so
# images can open and close it (a chat turn always starts with the role tags).
ONE_IMAGE = helpers.user_turn("<image>", "Describe this image.")
TWO_IMAGES_ADJACENT = helpers.user_turn("<image>", "<image>", "Which is brighter?")
IMAGE_TEXT_IMAGE = helpers.user_turn("<image>", LONG_TEXT, "<image>", "What changed?")
TEXT_ONLY = helpers.user_turn("Tell me a story.")
IMAGES_AT_BOTH_ENDS = "<image>\nWhat changed between these two?\n<image>"


class LlavaNext:
    """The tiny checkpoint, its export, and caches of transformers' answers and of generators."""

    def __init__(self, model, processor, export_dir):
        self.model, self.processor, self.export_dir = model, processor, export_dir
        self.description = ModelDescription(model.config.to_dict())
        self.family = get_family(FAMILY)
        self._references: dict = {}
        self._generators: dict = {}

    def tokens(self, size) -> int:
        return self.family.image_tokens(self.description, ImageSize(*size))

    def inputs(self, prompt, image_sizes):
        images = [helpers.image(height, width, seed) for seed, (height, width) in enumerate(image_sizes)]
        if isinstance(prompt, str):
            return self.processor(text=[prompt], images=images or None, return_tensors="pt")
        return helpers.process(self.processor, prompt, images)

    def reference(self, prompt, image_sizes):
        key = (repr(prompt), tuple(image_sizes))
        if key not in self._references:
            self._references[key] = helpers.hf_generate(
                self.model, self.inputs(prompt, image_sizes), NEW_TOKENS
            )
        return self._references[key]

    def shape(self, seq_lens, protocol: str) -> LanguageShape:
        most_rows = MAX_IMAGES * max(self.tokens(size) for size in IMAGE_SIZES)
        buckets = tuple(
            PrefillBucket(seq_len, min(seq_len, most_rows) if protocol == "chunk" else most_rows)
            for seq_len in seq_lens
        )
        return LanguageShape(buckets, max(bucket.vision_size for bucket in buckets), CTX_LEN)

    def specializations(self, shape: LanguageShape):
        """The vision (one per image size) and language specializations a compiled QPC would accept."""
        vision = [
            {symbols.BATCH_SIZE: 1, **self.family.vision_symbols(self.description, ImageSize(*size))}
            for size in IMAGE_SIZES
        ]
        common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: shape.ctx_len}
        language = [
            {**common, symbols.SEQ_LEN: bucket.seq_len, symbols.VISION_SIZE: bucket.vision_size}
            for bucket in shape.buckets
        ]
        language.append({**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: shape.decode_vision_size})
        return vision, language

    def generator(self, seq_lens, protocol: str):
        key = (tuple(seq_lens), protocol)
        if key not in self._generators:
            shape = self.shape(seq_lens, protocol)
            vision_specs, language_specs = self.specializations(shape)
            self._generators[key] = generator_for_export(
                self.export_dir,
                shape,
                vision_specializations=vision_specs,
                language_specializations=language_specs,
            )
        generator = self._generators[key]
        generator.cache = EmbeddingCache(DEFAULT_CACHE_BYTES)
        return generator


@pytest.fixture(scope="module")
def llava_next(hf_model, exported):
    """The shared :class:`LlavaNext` state of this module."""
    model, processor = hf_model(FAMILY)
    return LlavaNext(model, processor, exported(FAMILY))


def _generate(state: LlavaNext, prompt, image_sizes, seq_lens, protocol: str):
    """Run ``prompt`` both ways; assert identical tokens and close logits; return the chunk plan."""
    reference_tokens, reference_logits = state.reference(prompt, image_sizes)
    generator = state.generator(seq_lens, protocol)
    processed = helpers.as_numpy(state.inputs(prompt, image_sizes))
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol=protocol, keep_logits=True)
    assert result.tokens == reference_tokens, (prompt, seq_lens, protocol)
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, reference_logits))
    assert worst <= LOGIT_TOLERANCE, (prompt, seq_lens, protocol, worst)
    plan = generator.plan(processed["input_ids"].reshape(-1), processed, protocol)
    assert [span.rows for span in plan.segments] == [state.tokens(size) for size in image_sizes]
    assert result.encoder_calls <= len(image_sizes)  # each image encoded once, when first needed
    return plan


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seq_lens", SEQ_LEN_SETS, ids=lambda s: "S" + "-".join(map(str, s)))
@pytest.mark.parametrize(
    "prompt,image_sizes",
    [
        (ONE_IMAGE, [WIDE]),
        (TWO_IMAGES_ADJACENT, [TALL, SMALL]),
        (IMAGE_TEXT_IMAGE, [PANORAMA, TALL]),
        (IMAGES_AT_BOTH_ENDS, [SMALL, WIDE]),
        (TEXT_ONLY, []),
    ],
    ids=["one-image", "two-adjacent", "image-text-image", "both-ends", "text-only"],
)
def test_chunked_generation_matches_transformers(llava_next, prompt, image_sizes, seq_lens, protocol):
    _generate(llava_next, prompt, image_sizes, seq_lens, protocol)


# ---- the edge cases, each asserting its plan has the named shape ----


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_straddles_two_chunks(llava_next, protocol):
    plan = _generate(llava_next, ONE_IMAGE, [WIDE], (48,), protocol)
    first, second = [chunk for chunk in plan if chunk.images == (0,)][:2]
    assert first.index + 1 == second.index
    assert 0 < first.placeholders < plan.segments[0].rows


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_images_in_one_chunk(llava_next, protocol):
    plan = _generate(llava_next, TWO_IMAGES_ADJACENT, [TALL, SMALL], (40, 256), protocol)
    assert any(chunk.images == (0, 1) for chunk in plan)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_then_text_only_chunk_then_image(llava_next, protocol):
    plan = _generate(llava_next, IMAGE_TEXT_IMAGE, [PANORAMA, TALL], (16, 64), protocol)
    holding = [[chunk.index for chunk in plan if image in chunk.images] for image in (0, 1)]
    between = plan.chunks[holding[0][-1] + 1 : holding[1][0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_images_at_prompt_start_and_end(llava_next, protocol):
    plan = _generate(llava_next, IMAGES_AT_BOTH_ENDS, [SMALL, WIDE], (40, 256), protocol)
    first, last = plan.segments
    assert first.start == 0  # no BOS: the prompt's first token is a placeholder
    assert last.stop == plan.prompt_len  # and so is its last


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prompt_shorter_than_one_chunk(llava_next, protocol):
    plan = _generate(llava_next, ONE_IMAGE, [WIDE], (384,), protocol)
    assert len(plan) == 1 and plan.chunks[0].padding > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_last_chunk_padded_into_the_smallest_bucket(llava_next, protocol):
    plan = _generate(llava_next, IMAGE_TEXT_IMAGE, [PANORAMA, TALL], (16, 64), protocol)
    *full, last = plan.chunks
    assert all(chunk.seq_len == 64 and chunk.padding == 0 for chunk in full)
    assert last.padding > 0 and last.seq_len == min(s for s in (16, 64) if s >= last.tokens)


def test_same_image_twice_is_encoded_once(llava_next):
    image = helpers.image(*WIDE)
    inputs = helpers.process(llava_next.processor, TWO_IMAGES_ADJACENT, [image, image])
    reference_tokens, _ = helpers.hf_generate(llava_next.model, inputs, NEW_TOKENS)
    result = llava_next.generator((48,), "chunk").generate(
        helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS
    )
    assert result.tokens == reference_tokens
    assert result.encoder_calls == 1


def test_two_resolutions_in_one_chunk_use_two_vision_specializations(llava_next):
    plan = _generate(llava_next, IMAGE_TEXT_IMAGE, [PANORAMA, TALL], (384,), "chunk")
    assert plan.first_chunk_of_image == (0, 0)  # both encoded before the first call
    generator = llava_next.generator((384,), "chunk")
    processed = helpers.as_numpy(llava_next.inputs(IMAGE_TEXT_IMAGE, [PANORAMA, TALL]))
    assert generator.generate(processed, max_new_tokens=1).encoder_calls == 2  # one graph, two shapes
