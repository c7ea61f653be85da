"""InternVL: token math equals transformers' tiling for any image, one vision graph for every tile count,
and chunk-aware generation token-identical to transformers generate.

The tiny checkpoint tiles at 112 px (16 tokens a tile) onto canvases of up to 4 tiles plus a
thumbnail, so an image is 16 to 80 placeholder tokens, fenced by ``<img>`` and ``</img>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision import symbols
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.internvl import BATCHED_NUM_PATCHES
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.family_runtime import FamilyRuntime, chunks_of_image

FAMILY = "internvl"
SPECS = Path(__file__).resolve().parent.parent / "specs"
INTERNVL3_8B = describe_checkpoint(SPECS / "configs" / "InternVL3-8B-hf")
LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light is softer. "
)


def _transformers_tiles(model: ModelDescription, height: int, width: int) -> int:
    from transformers import GotOcr2ImageProcessor

    processor = GotOcr2ImageProcessor(**model.processor)
    return processor.get_number_of_image_patches(height, width, {"crop_to_patches": True})


# ---- torch-free token math on the pinned InternVL3-8B-hf snapshot ----


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6000), st.integers(1, 6000))
def test_tile_count_equals_transformers_for_any_size(height, width):
    values = get_family(FAMILY).vision_symbols(INTERNVL3_8B, ImageSize(height, width))
    assert values[BATCHED_NUM_PATCHES] == _transformers_tiles(INTERNVL3_8B, height, width)
    assert values[symbols.VISION_SIZE] == 256 * values[BATCHED_NUM_PATCHES]


def test_spec_has_one_vision_specialization_per_tile_count():
    result = build_specializations(load_spec(SPECS / "internvl" / "internvl3-8b-hf.yaml"))
    tiles = [int(s.symbols[BATCHED_NUM_PATCHES]) for s in result.vision.specializations]
    assert tiles == [1, 9, 11, 13]
    assert result.request_image_tokens == 2 * 13 * 256


# ---- the tiny checkpoint ----


def test_placeholders_written_by_the_processor_match_the_token_math(hf_model):
    model, processor = hf_model(FAMILY)
    description = ModelDescription(model.config.to_dict(), processor.image_processor.to_dict())
    sizes = [(100, 100), (100, 150), (300, 120), (60, 250), (1, 900)]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    inputs = helpers.process(processor, helpers.user_turn(*["<image>"] * len(sizes), "Hi"), images)
    expected = [get_family(FAMILY).image_tokens(description, ImageSize(*size)) for size in sizes]
    counts = helpers.host(model, FAMILY).placeholder_counts(helpers.as_numpy(inputs))
    assert counts == expected
    assert sorted(set(expected)) == [16, 48, 64, 80]  # 1 tile; 2, 3 or 4 tiles + thumbnail


def test_one_vision_graph_serves_every_tile_count(hf_model, exported):
    """One image's tiles per call, [tiles, 3, S, S] as QEfficient and the vllm-qaic plugin send them."""
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    for height, width in ((100, 100), (100, 150), (60, 250)):
        pair = [helpers.image(height, width, 0), helpers.image(height, width, 1)]
        processed = processor.image_processor(images=pair, return_tensors="pt")
        reference = [f.numpy() for f in adapter.hf_image_features(model, processed)]
        inputs = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
        for one, expected in zip(inputs, reference, strict=True):
            assert one[symbols.PIXEL_VALUES].ndim == 4
            embeds = program.run(one)[symbols.VISION_EMBEDS]
            assert embeds.shape == (1, *expected.shape)
            assert np.abs(embeds[0] - expected).max() <= 1e-4, (height, width)


# ---- chunked generation vs transformers generate ----


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return FamilyRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_image_straddles_two_chunks(runtime, protocol):
    processed = runtime.inputs(["<image>", "Describe this image."], [helpers.image(100, 150)])
    plan, _ = runtime.run(processed, [32], protocol)
    first, second = chunks_of_image(plan, 0)[:2]
    assert second == first + 1 and 0 < plan.chunks[first].placeholders < plan.segments[0].rows


def test_two_images_in_one_chunk(runtime):
    images = [helpers.image(300, 120, 1), helpers.image(100, 100, 2)]
    processed = runtime.inputs(["<image>", "<image>", "Which is brighter?"], images)
    plan, result = runtime.run(processed, [128])
    assert any(chunk.images == (0, 1) for chunk in plan)
    assert result.encoder_calls == 2  # two tile counts: two vision calls


def test_image_then_text_only_chunk_then_image(runtime):
    images = [helpers.image(60, 250, 3), helpers.image(100, 150, 4)]
    processed = runtime.inputs(["<image>", 2 * LONG_TEXT, "<image>", "What changed?"], images)
    plan, _ = runtime.run(processed, [16, 64])
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    between = plan.chunks[first[-1] + 1 : second[0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)
