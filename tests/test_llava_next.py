"""LLaVA-NeXT token math, specializations and vision graph: transformers' own numbers, one graph for all.

The family's torch-free token math must equal transformers' processor count (the placeholders it
writes) and the model's unpadding for every image size; QEfficient's Granite Vision reference
(1109x1610 -> 10 tiles of 384 -> 5,239 tokens) must come out of the pinned spec; and one exported
vision graph must serve every pinpoint of the tiny checkpoint, batched or not.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision import symbols
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.llava_next import IMAGE_SIZES, NUM_PATCHES, ImageGrid
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers

FAMILY = "llava_next"
SPECS = Path(__file__).resolve().parent.parent / "specs"
GRANITE = describe_checkpoint(SPECS / "configs" / "granite-vision-3.2-2b")


def _transformers_counts(
    model: ModelDescription, height: int, width: int
) -> tuple[int, int, tuple[int, int]]:
    """(tokens, tiles, unpadded grid) the way transformers computes them for this config."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches, unpad_image
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    vision = model.config["vision_config"]
    tile, patch = vision["image_size"], vision["patch_size"]
    pinpoints = model.config["image_grid_pinpoints"]
    processor = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints),
        patch_size=patch,
        num_additional_image_tokens=0,
        _get_unpadded_features=LlavaNextProcessor._get_unpadded_features.__get__(object()),
    )
    tokens = LlavaNextProcessor._get_number_of_features(processor, height, width, tile, tile)
    tiles = image_size_to_num_patches((height, width), pinpoints, tile)
    grid = get_family(FAMILY).image_grid(model, ImageSize(height, width))
    rows, cols = grid.tile_rows, grid.tile_cols
    side = tile // patch
    grid = unpad_image(torch.zeros(1, rows * side, cols * side), (height, width))
    return tokens, tiles, tuple(grid.shape[1:])


# ---- QEfficient's reference and the pinned Granite spec ----


def test_granite_reference_1109x1610_is_10_tiles_and_5239_tokens():
    family = get_family(FAMILY)
    assert family.image_tokens(GRANITE, ImageSize(1109, 1610)) == 5239
    assert family.image_grid(GRANITE, ImageSize(1109, 1610)) == ImageGrid(3, 3, 55, 81)
    # The vision output of 10 tiles holds the most rows 9 tiles can give: 3456x384 (9x1), uncropped.
    assert family.vision_symbols(GRANITE, ImageSize(1109, 1610)) == {
        NUM_PATCHES: 10,
        symbols.VISION_SIZE: 27 * 27 + 9 * 27 * (27 + 1),
    }


def test_granite_spec_has_a_vision_specialization_per_tile_count_and_5239_among_its_images():
    result = build_specializations(load_spec(SPECS / "llava_next" / "granite-vision-3.2-2b.yaml"))
    sizes = {(image.image.height, image.image.width): image.tokens for image in result.images}
    assert sizes[(1109, 1610)] == 5239
    tiles = {get_family(FAMILY).vision_symbols(GRANITE, image.image)[NUM_PATCHES] for image in result.images}
    assert len(result.vision.specializations) == len(tiles) < len(sizes)  # 384x3840, 3840x384: one
    assert result.request_image_tokens == max(sizes.values())


def test_granite_pinpoints_share_a_specialization_per_tile_count():
    spec = load_spec(SPECS / "llava_next" / "granite-vision-3.2-2b-pinpoints.yaml")
    pinpoints = [tuple(p) for p in GRANITE.config["image_grid_pinpoints"]]
    assert [(image.height, image.width) for image in spec.vision.images] == pinpoints
    result = build_specializations(spec)
    # One graph with static shapes: a specialization binds the tile count and the most rows it
    # can give, so pinpoints of one tile count (1x10, 10x1, 2x5, 5x2) share it.
    tile = 384
    counts = {(h // tile) * (w // tile) + 1 for h, w in pinpoints}
    bound = {(s.symbols[NUM_PATCHES], s.symbols[symbols.VISION_SIZE]) for s in result.vision.specializations}
    assert len(bound) == len(counts) == len(result.vision.specializations) < len(pinpoints)
    assert all(
        set(s.symbols) == {symbols.BATCH_SIZE, NUM_PATCHES, symbols.VISION_SIZE}
        for s in result.vision.specializations
    )
    for image in result.images:  # a pinpoint-sized image fills its grid: nothing is unpadded
        assert image.tokens == _transformers_counts(GRANITE, image.image.height, image.image.width)[0]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_token_math_equals_transformers_for_any_size(height, width):
    family = get_family(FAMILY)
    values = family.vision_symbols(GRANITE, ImageSize(height, width))
    image_grid = family.image_grid(GRANITE, ImageSize(height, width))
    tokens, tiles, grid = _transformers_counts(GRANITE, height, width)
    assert family.image_tokens(GRANITE, ImageSize(height, width)) == tokens <= values[symbols.VISION_SIZE]
    assert values[NUM_PATCHES] == tiles
    assert (image_grid.feature_height, image_grid.feature_width) == grid


# ---- the tiny checkpoint: processor placeholders, decoder multipliers ----


def test_placeholders_written_by_the_processor_match_the_token_math(hf_model):
    model, processor = hf_model(FAMILY)
    description = ModelDescription(model.config.to_dict())
    sizes = [(100, 150), (300, 120), (60, 200), (40, 40), (1, 500), (999, 1000), (57, 113)]
    images = [helpers.image(height, width, seed) for seed, (height, width) in enumerate(sizes)]
    inputs = helpers.process(processor, helpers.user_turn(*["<image>"] * len(sizes), "Hi"), images)
    written = int((inputs["input_ids"] == model.config.image_token_id).sum())
    expected = [get_family(FAMILY).image_tokens(description, ImageSize(*size)) for size in sizes]
    assert written == sum(expected)
    counts = helpers.host(model, FAMILY).placeholder_counts(helpers.as_numpy(inputs))
    assert list(counts) == expected


def test_tiny_decoder_exercises_every_granite_multiplier(tiny_checkpoint):
    text = json.loads((tiny_checkpoint(FAMILY) / "config.json").read_text())["text_config"]
    assert text["model_type"] == "granite"
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert text[name] not in (None, 1.0), name  # parity would not notice a multiplier of 1


# ---- one vision graph for every pinpoint ----


def test_one_vision_graph_serves_every_pinpoint_batched(hf_model, exported):
    """Each pinpoint of the tiny checkpoint, two same-size images per call, vs transformers."""
    from qeff_vision.exporter import load_adapter

    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    graph = json.loads((exported(FAMILY) / "export.json").read_text())["programs"]["vision"]
    assert graph["inputs"]["pixel_values"]["axes"] == {"0": symbols.BATCH_SIZE, "1": NUM_PATCHES}
    assert graph["inputs"][IMAGE_SIZES]["axes"] == {"0": symbols.BATCH_SIZE}
    for height, width in model.config.image_grid_pinpoints:
        pair = [helpers.image(height, width, 0), helpers.image(height, width, 1)]
        processed = processor.image_processor(images=pair, return_tensors="pt")
        reference = [f.numpy() for f in adapter.hf_image_features(model, processed)]
        inputs = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
        feeds = {name: np.concatenate([one[name] for one in inputs]) for name in inputs[0]}
        embeds = program.run(feeds)[symbols.VISION_EMBEDS]
        rows = len(reference[0])  # a pinpoint-sized image fills its grid: no row is padding
        assert embeds.shape[0] == 2 and embeds.shape[1] >= rows
        assert max(np.abs(embeds[i, :rows] - reference[i]).max() for i in range(2)) <= 1e-4, (height, width)
        assert not embeds[:, rows:].any()
