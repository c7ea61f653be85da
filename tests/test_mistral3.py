"""Mistral 3: token math equals transformers' Pixtral processor, one vision graph for every resolution,
and chunk-aware generation token-identical to transformers generate, with chunk boundaries after an
``[IMG_BREAK]`` and inside a row of image tokens.

The tiny checkpoint shrinks images to 168 px and tokenizes 28x28 pixels per token: up to 6 rows of
6 ``[IMG]``, each row ended by ``[IMG_BREAK]`` (the last by ``[IMG_END]``).
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
from qeff_vision.families.mistral3 import IMAGE_HEIGHT, IMAGE_WIDTH
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.family_runtime import FamilyRuntime, chunks_of_image

FAMILY = "mistral3"
SPECS = Path(__file__).resolve().parent.parent / "specs"
MISTRAL_SMALL = describe_checkpoint(SPECS / "configs" / "Mistral-Small-3.1-24B-Instruct-2503")
LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light is softer. "
)


# ---- torch-free token math on the pinned Mistral Small 3.1 snapshot ----


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_resize_and_tokens_equal_transformers_for_any_size(height, width):
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    family = get_family(FAMILY)
    values = family.vision_symbols(MISTRAL_SMALL, ImageSize(height, width))
    pixels = np.empty((height, width, 3), np.uint8)  # never touched: only its shape is read
    expected = get_resize_output_image_size(
        pixels, size=(1540, 1540), patch_size=28, input_data_format="channels_last"
    )
    assert (values[IMAGE_HEIGHT], values[IMAGE_WIDTH]) == expected
    rows, cols = expected[0] // 28, expected[1] // 28
    assert values[symbols.VISION_SIZE] == rows * cols
    assert family.prompt_tokens(MISTRAL_SMALL, ImageSize(height, width)) == rows * (cols + 1)


def test_spec_has_one_vision_specialization_per_resolution():
    result = build_specializations(load_spec(SPECS / "mistral3" / "mistral-small-3.1-24b-instruct-2503.yaml"))
    sizes = [
        (int(s.symbols[IMAGE_HEIGHT]), int(s.symbols[IMAGE_WIDTH])) for s in result.vision.specializations
    ]
    assert sizes == [(448, 448), (868, 1540), (168, 1540), (1540, 1540)]
    assert result.request_image_tokens == 2 * 55 * 55


# ---- the tiny checkpoint ----


def test_processor_writes_rows_of_placeholders_with_breaks(hf_model):
    model, processor = hf_model(FAMILY)
    description = ModelDescription(model.config.to_dict(), processor.image_processor.to_dict())
    family = get_family(FAMILY)
    sizes = [(100, 100), (100, 150), (300, 120), (60, 400), (20, 900)]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    inputs = helpers.as_numpy(
        helpers.process(processor, helpers.user_turn(*["<image>"] * len(sizes), "Hi"), images)
    )
    expected = [family.image_tokens(description, ImageSize(*size)) for size in sizes]
    assert helpers.host(model, FAMILY).placeholder_counts(inputs) == expected
    ids = inputs["input_ids"].reshape(-1)
    breaks, ends = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("[IMG_BREAK]", "[IMG_END]"))
    images_tokens = int(np.isin(ids, [model.config.image_token_index, breaks, ends]).sum())
    assert images_tokens == sum(family.prompt_tokens(description, ImageSize(*size)) for size in sizes)


def test_one_vision_graph_serves_every_resolution_batched(hf_model, exported):
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    for height, width in ((100, 100), (300, 120), (60, 400)):
        pair = [helpers.image(height, width, 0), helpers.image(height, width, 1)]
        processed = processor.image_processor(images=pair, return_tensors="pt", patch_size=28)
        reference = [f.numpy() for f in adapter.hf_image_features(model, processed)]
        inputs = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
        feeds = {name: np.concatenate([one[name] for one in inputs]) for name in inputs[0]}
        embeds = program.run(feeds)[symbols.VISION_EMBEDS]
        assert embeds.shape == (2, *reference[0].shape)
        assert max(np.abs(embeds[i] - reference[i]).max() for i in range(2)) <= 1e-4, (height, width)


# ---- chunked generation vs transformers generate ----


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return FamilyRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


def _break_positions(runtime, processed) -> np.ndarray:
    ids = processed["input_ids"].reshape(-1)
    return np.flatnonzero(ids == runtime.processor.tokenizer.convert_tokens_to_ids("[IMG_BREAK]"))


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_chunk_boundary_right_after_an_image_break(runtime, protocol):
    processed = runtime.inputs(["<image>", "Describe this image."], [helpers.image(100, 150)])
    boundary = int(_break_positions(runtime, processed)[1]) + 1  # after the second row's [IMG_BREAK]
    plan, _ = runtime.run(processed, [boundary], protocol)
    first, second = plan.chunks[:2]
    assert first.stop == boundary and first.images == second.images == (0,)
    assert (
        runtime.processor.tokenizer.convert_ids_to_tokens(int(processed["input_ids"][0, boundary - 1]))
        == "[IMG_BREAK]"
    )


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_chunk_boundary_inside_a_row(runtime, protocol):
    processed = runtime.inputs(["<image>", "Describe this image."], [helpers.image(100, 150)])
    boundary = int(_break_positions(runtime, processed)[0]) - 2  # two [IMG] of row one left over
    plan, _ = runtime.run(processed, [boundary], protocol)
    ids, image = processed["input_ids"].reshape(-1), runtime.model.config.image_token_index
    assert plan.chunks[0].stop == boundary and ids[boundary - 1] == ids[boundary] == image
    assert chunks_of_image(plan, 0)[:2] == [0, 1]


def test_two_images_in_one_chunk(runtime):
    images = [helpers.image(300, 120, 1), helpers.image(100, 100, 2)]
    processed = runtime.inputs(["<image>", "<image>", "Which is brighter?"], images)
    plan, result = runtime.run(processed, [128])
    assert any(chunk.images == (0, 1) for chunk in plan)
    assert result.encoder_calls == 2  # two resolutions: two vision calls


def test_image_then_text_only_chunk_then_image(runtime):
    images = [helpers.image(60, 400, 3), helpers.image(100, 150, 4)]
    processed = runtime.inputs(["<image>", 2 * LONG_TEXT, "<image>", "What changed?"], images)
    plan, _ = runtime.run(processed, [16, 64])
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    between = plan.chunks[first[-1] + 1 : second[0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)


def test_specialize_table_counts_the_row_breaks_an_image_spans():
    """1540x1540 is 55 rows of 55 [IMG] + a break: 3,079 tokens first to last, so 25 chunks of 128, not 24."""
    from qeff_vision.contract.segments import find_segments
    from qeff_vision.runtime.planner import PrefillBucket, plan_chunks

    result = build_specializations(load_spec(SPECS / "mistral3" / "mistral-small-3.1-24b-instruct-2503.yaml"))
    table = {(row.image.height, row.image.width): row.chunks for row in result.images}
    image, brk, end = 10, 12, 13
    for text_before in (0, 100):  # aligned, then the image starting mid-chunk
        ids = [1] * text_before + ([image] * 55 + [brk]) * 55
        ids[-1] = end
        spans = find_segments(ids, image, [55 * 55], multi_run=True)
        plan = plan_chunks(len(ids), spans, [PrefillBucket(128, 128)])
        used = sum(1 for chunk in plan if chunk.placeholders)
        low, high = table[(1540, 1540)][128]
        assert low <= used <= high
        if not text_before:
            assert used == low  # an image starting on a chunk boundary spans the fewest chunks
    assert table[(1540, 1540)][128] == (25, 26)
