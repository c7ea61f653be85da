"""LLaVA-1.5 chunk-aware generation on onnxruntime vs transformers' generate (greedy, tokens identical).

Every image of the tiny checkpoint becomes 16 placeholders (56 px / 14 px patches, CLS dropped).
LLaVA's decoder is causal, so an image may be split across chunks: each case below is run with
several bucket sets and both vision protocols, with the programs restricted to the shapes a
compiled QPC would accept (the specializations those buckets make), and each edge case asserts
that its plan really has the shape it is named after.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.families.llava import IMG_SIZE
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generate import DEFAULT_CACHE_BYTES, generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

FAMILY = "llava"
NEW_TOKENS = 6
CTX_LEN = 192
MAX_IMAGES = 2
LOGIT_TOLERANCE = 1e-3
PROTOCOLS = ("chunk", "full")
# Bucket sets (seq_len values): tiny chunks that cut an image in three, one mid size, a pair where
# the remainder takes the small bucket, and one bucket larger than every prompt.
SEQ_LEN_SETS = ((8, 32), (16,), (24, 128), (128,))

# Prompts as LLaVA-1.5 writes them; "<image>" is expanded by the processor to 16 placeholders.
ONE_IMAGE = "USER: <image>\nDescribe this image. ASSISTANT:"
TWO_IMAGES_ADJACENT = "USER: <image>\n<image>\nWhich is brighter? ASSISTANT:"
IMAGE_TEXT_IMAGE = (
    "USER: <image>\nThis first picture was taken in the morning, long before the second one. "
    "<image>\nWhat changed? ASSISTANT:"
)
IMAGES_AT_BOTH_ENDS = "<image>\nWhat changed between these two?\n<image>"
TEXT_ONLY = "USER: Tell me a story. ASSISTANT:"


class Llava:
    """The tiny checkpoint, its export, and caches of transformers' answers and of generators.

    The cases share prompts and bucket sets, so each reference generation and each pair of
    onnxruntime sessions is made once; every run still gets a fresh embedding cache.
    """

    def __init__(self, model, processor, export_dir):
        self.model, self.processor, self.export_dir = model, processor, export_dir
        self.description = ModelDescription(model.config.to_dict())
        self.tokens = get_family(FAMILY).tokens_per_image(self.description)
        self._references: dict = {}
        self._generators: dict = {}

    def inputs(self, prompt: str, image_sizes):
        images = [helpers.image(height, width, seed) for seed, (height, width) in enumerate(image_sizes)]
        return self.processor(text=[prompt], images=images or None, return_tensors="pt")

    def reference(self, prompt: str, image_sizes):
        key = (prompt, tuple(image_sizes))
        if key not in self._references:
            self._references[key] = helpers.hf_generate(
                self.model, self.inputs(prompt, image_sizes), NEW_TOKENS
            )
        return self._references[key]

    def shape(self, seq_lens, protocol: str) -> LanguageShape:
        most_rows = MAX_IMAGES * self.tokens  # the most rows one request carries
        buckets = tuple(
            PrefillBucket(seq_len, min(seq_len, most_rows) if protocol == "chunk" else most_rows)
            for seq_len in seq_lens
        )
        return LanguageShape(buckets, max(bucket.vision_size for bucket in buckets), CTX_LEN)

    def specializations(self, shape: LanguageShape):
        """The vision and language specializations a QPC compiled for ``shape`` would accept.

        The vision program is compiled for batches of 1 to MAX_IMAGES images: the runtime may
        encode the images a chunk first needs in one call.
        """
        vision = get_family(FAMILY).vision_symbols(self.description, ImageSize(336, 336))
        common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: shape.ctx_len}
        language = [
            {**common, symbols.SEQ_LEN: bucket.seq_len, symbols.VISION_SIZE: bucket.vision_size}
            for bucket in shape.buckets
        ]
        language.append({**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: shape.decode_vision_size})
        return [{symbols.BATCH_SIZE: batch, **vision} for batch in range(1, MAX_IMAGES + 1)], language

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
def llava(hf_model, exported):
    """The shared :class:`Llava` state of this module."""
    model, processor = hf_model(FAMILY)
    return Llava(model, processor, exported(FAMILY))


def _generate(llava: Llava, prompt: str, image_sizes, seq_lens, protocol: str):
    """Run ``prompt`` both ways; assert identical tokens and close logits; return the chunk plan."""
    reference_tokens, reference_logits = llava.reference(prompt, image_sizes)
    generator = llava.generator(seq_lens, protocol)
    processed = helpers.as_numpy(llava.inputs(prompt, image_sizes))
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol=protocol, keep_logits=True)
    assert result.tokens == reference_tokens, (prompt, seq_lens, protocol)
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, reference_logits))
    assert worst <= LOGIT_TOLERANCE, (prompt, seq_lens, protocol, worst)
    plan = generator.plan(processed["input_ids"].reshape(-1), processed, protocol)
    assert [span.rows for span in plan.segments] == [llava.tokens] * len(image_sizes)
    assert result.encoder_calls <= len(image_sizes)  # each image encoded once, when first needed
    return plan


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("seq_lens", SEQ_LEN_SETS, ids=lambda s: "S" + "-".join(map(str, s)))
@pytest.mark.parametrize(
    "prompt,image_sizes",
    [
        (ONE_IMAGE, [(100, 150)]),
        (TWO_IMAGES_ADJACENT, [(120, 90), (64, 64)]),
        (IMAGE_TEXT_IMAGE, [(80, 200), (200, 80)]),
        (IMAGES_AT_BOTH_ENDS, [(90, 90), (150, 100)]),
        (TEXT_ONLY, []),
    ],
    ids=["one-image", "two-adjacent", "image-text-image", "both-ends", "text-only"],
)
def test_chunked_generation_matches_transformers(llava, prompt, image_sizes, seq_lens, protocol):
    _generate(llava, prompt, image_sizes, seq_lens, protocol)


# ---- the edge cases, each asserting its plan has the named shape ----


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_straddles_two_chunks(llava, protocol):
    plan = _generate(llava, ONE_IMAGE, [(100, 150)], (16,), protocol)
    first, second = [chunk for chunk in plan if chunk.images == (0,)]
    assert first.index + 1 == second.index
    assert 0 < first.placeholders < plan.segments[0].rows
    assert first.placeholders + second.placeholders == plan.segments[0].rows


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_images_in_one_chunk(llava, protocol):
    plan = _generate(llava, TWO_IMAGES_ADJACENT, [(120, 90), (64, 64)], (48,), protocol)
    assert plan.prompt_len > 48
    assert plan.chunks[0].images == (0, 1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_then_text_only_chunk_then_image(llava, protocol):
    plan = _generate(llava, IMAGE_TEXT_IMAGE, [(80, 200), (200, 80)], (16,), protocol)
    holding = [[chunk.index for chunk in plan if image in chunk.images] for image in (0, 1)]
    between = plan.chunks[holding[0][-1] + 1 : holding[1][0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_images_at_prompt_start_and_end(llava, protocol):
    plan = _generate(llava, IMAGES_AT_BOTH_ENDS, [(90, 90), (150, 100)], (24, 128), protocol)
    first, last = plan.segments
    assert first.start == 1  # right after <s>
    assert last.stop == plan.prompt_len  # the prompt's last token is a placeholder


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prompt_shorter_than_one_chunk(llava, protocol):
    plan = _generate(llava, ONE_IMAGE, [(100, 150)], (128,), protocol)
    assert len(plan) == 1 and plan.chunks[0].padding > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_last_chunk_padded_into_the_smallest_bucket(llava, protocol):
    plan = _generate(llava, IMAGE_TEXT_IMAGE, [(80, 200), (200, 80)], (8, 32), protocol)
    *full, last = plan.chunks
    assert all(chunk.seq_len == 32 and chunk.padding == 0 for chunk in full)
    assert last.padding > 0 and last.seq_len == min(s for s in (8, 32) if s >= last.tokens)


def test_same_image_twice_is_encoded_once(llava):
    image = helpers.image(100, 150)
    inputs = llava.processor(text=[TWO_IMAGES_ADJACENT], images=[image, image], return_tensors="pt")
    reference_tokens, _ = helpers.hf_generate(llava.model, inputs, NEW_TOKENS)
    result = llava.generator((16,), "chunk").generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS)
    assert result.tokens == reference_tokens
    assert result.encoder_calls == 1


def test_vision_specialization_is_the_towers_fixed_size(llava):
    symbols_of = get_family(FAMILY).vision_symbols
    small, large = ImageSize(30, 900), ImageSize(1080, 1920)
    assert symbols_of(llava.description, small) == symbols_of(llava.description, large)
    assert symbols_of(llava.description, small) == {IMG_SIZE: 56, symbols.VISION_SIZE: llava.tokens}
