"""Qwen3-VL: token math equals transformers' processor, one vision graph (with deepstack rows) for every
resolution, and chunk-aware generation token-identical to transformers generate, with the deepstack
features sliced per chunk exactly like ``vision_embeds`` (the generation tests run for Qwen3-VL-MoE
too: tests/test_qwen3_vl_moe.py holds what is MoE's own).

The tiny checkpoint has 16-pixel patches, an 8x8 learned position table (interpolated to every
grid), two deepstack layers feeding both decoder layers, and images of 4..256 merged tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, describe_checkpoint
from qeff_vision.families.qwen2_5_vl import GRID_H, GRID_W
from qeff_vision.families.qwen3_vl import DEEPSTACK_FEATURES, NUM_FEATURE_LAYERS
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.compile_fixtures import write_spec
from tests.family_runtime import FamilyRuntime, chunks_of_image

FAMILY = "qwen3_vl"
SPECS = Path(__file__).resolve().parent.parent / "specs"
QWEN3_VL_8B = describe_checkpoint(SPECS / "configs" / "Qwen3-VL-8B-Instruct")
LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light is softer. "
)


# ---- torch-free token math on the pinned Qwen3-VL-8B snapshot ----


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_grid_equals_transformers_smart_resize_for_any_size(height, width):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    if max(height, width) / min(height, width) > 200:
        return  # the processor refuses these; validate_image says so
    family = get_family(FAMILY)
    values = family.vision_symbols(QWEN3_VL_8B, ImageSize(height, width))
    resized = smart_resize(height, width, factor=32, min_pixels=65536, max_pixels=16777216)
    assert (values[GRID_H], values[GRID_W]) == (resized[0] // 16, resized[1] // 16)
    assert values[symbols.VISION_SIZE] == resized[0] * resized[1] // (32 * 32)
    assert values[NUM_FEATURE_LAYERS] == 3


def test_specializations_of_the_pinned_8b_spec():
    result = build_specializations(load_spec(SPECS / "qwen3_vl" / "qwen3_vl-8b-instruct.yaml"))
    tokens = [int(s.symbols[symbols.VISION_SIZE]) for s in result.vision.specializations]
    assert tokens == [64, 220, 2040, 4096]  # QEfficient's 354x536 reference is 187 (4B spec)
    for spec in (*result.vision.specializations, *result.language.specializations):
        assert spec.symbols[NUM_FEATURE_LAYERS] == "3"
    lang = [
        (s.name, s.symbols["seq_len"], s.symbols[symbols.VISION_SIZE])
        for s in result.language.specializations
    ]
    assert lang == [
        ("Prefill-128", "128", "128"),
        ("Prefill-256", "256", "256"),
        ("Prefill-1024", "1024", "1024"),
        ("Decode", "1", "1024"),
    ]
    io = dict(result.language.custom_io)
    assert io[DEEPSTACK_FEATURES] == io[symbols.retained(DEEPSTACK_FEATURES)] == io[symbols.VISION_EMBEDS]


# ---- the tiny checkpoint ----


def test_language_program_declares_deepstack_features_like_qefficient(exported):
    import onnx

    from qeff_vision.export_record import read_export

    manifest = read_export(exported(FAMILY))
    lang, vision = manifest["programs"]["lang"], manifest["programs"]["vision"]
    graph = onnx.load(str(exported(FAMILY) / lang["path"]), load_external_data=False).graph
    inputs, outputs = [v.name for v in graph.input], [v.name for v in graph.output]
    assert inputs[:5] == ["input_ids", "position_ids", "vision_embeds", DEEPSTACK_FEATURES, "image_idx"]
    assert outputs[1:4] == [
        "vision_embeds_RetainedState",
        "deepstack_features_RetainedState",
        "image_idx_output",
    ]
    axes = {"0": NUM_FEATURE_LAYERS, "1": symbols.VISION_BATCH_SIZE, "2": symbols.VISION_SIZE}
    assert lang["inputs"][DEEPSTACK_FEATURES]["axes"] == axes
    assert vision["outputs"][DEEPSTACK_FEATURES]["axes"] == {
        "0": NUM_FEATURE_LAYERS,
        "1": symbols.BATCH_SIZE,
        "2": symbols.VISION_SIZE,
    }


def test_one_vision_graph_serves_every_resolution_with_deepstack_rows(hf_model, exported):
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    for height, width in ((100, 150), (224, 224), (300, 120), (500, 500)):
        processed = processor.image_processor(images=[helpers.image(height, width)], return_tensors="pt")
        embeds = adapter.hf_image_features(model, processed)[0].numpy()
        stacked = adapter.hf_stacked_rows(model, processed)[DEEPSTACK_FEATURES][0].numpy()
        reference = np.concatenate([embeds, *stacked], axis=-1)
        (inputs,) = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
        output = program.run(inputs)
        stacked = output[DEEPSTACK_FEATURES][:, 0]
        ours = np.concatenate([output[symbols.VISION_EMBEDS][0], *stacked], axis=-1)
        assert ours.shape == reference.shape and np.abs(ours - reference).max() <= 1e-4, (height, width)


@pytest.fixture(scope="module", params=[FAMILY, "qwen3_vl_moe"])
def runtime(exported, hf_model, request):
    """Chunked generation of Qwen3-VL and of its MoE variant (same host, sparse text MLPs)."""
    return FamilyRuntime(request.param, exported(request.param), *hf_model(request.param))


def test_deepstack_rows_change_the_logits(runtime):
    """The decoder reads deepstack_features: zeroing them moves the logits (a wiring check)."""
    processed = runtime.inputs(["<image>", "Describe."], [helpers.image(224, 224)])
    generator = runtime.generator([128])
    images, by_key = generator._prepare_images(processed)
    (rows,) = generator._encoder(by_key, [0.0])(images)
    length = processed["input_ids"].shape[1]
    wide = np.zeros((1, 128, rows.shape[1]), np.float32)
    wide[0, : rows.shape[0]] = rows
    feeds = {
        symbols.INPUT_IDS: np.pad(processed["input_ids"], ((0, 0), (0, 128 - length))),
        symbols.POSITION_IDS: generator._positions(
            runtime.checkpoint.host.prompt_positions(processed), 0, length, 128
        ),
        symbols.IMAGE_IDX: np.zeros((1, 1), np.int64),
        **generator._vision_feeds_of_rows(wide),
    }
    with_rows = generator.step(dict(feeds), generator.empty_cache())[symbols.LOGITS]
    feeds[DEEPSTACK_FEATURES] = np.zeros_like(feeds[DEEPSTACK_FEATURES])
    without = generator.step(feeds, generator.empty_cache())[symbols.LOGITS]
    assert np.abs(with_rows - without).max() > 1e-3


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_image_straddles_two_chunks(runtime, protocol):
    processed = runtime.inputs(["<image>", "Describe this image."], [helpers.image(224, 224)])
    plan, _ = runtime.run(processed, [32], protocol)
    first, second = chunks_of_image(plan, 0)[:2]
    assert second == first + 1 and 0 < plan.chunks[first].placeholders < plan.segments[0].rows


def test_two_images_of_different_resolutions(runtime):
    images = [helpers.image(300, 120, 1), helpers.image(100, 150, 2)]
    processed = runtime.inputs(["<image>", "<image>", "Which is brighter?"], images)
    plan, result = runtime.run(processed, [32, 128])
    assert [span.rows for span in plan.segments] == [36, 15]
    assert result.encoder_calls == 2  # two resolutions: two vision calls


def test_image_then_text_only_chunk_then_image(runtime):
    images = [helpers.image(224, 224, 3), helpers.image(100, 150, 4)]
    processed = runtime.inputs(["<image>", 2 * LONG_TEXT, "<image>", "What changed?"], images)
    plan, _ = runtime.run(processed, [16, 64])
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    between = plan.chunks[first[-1] + 1 : second[0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)


def test_compile_onnxruntime_verifies_deepstack_specializations(tiny_checkpoint, tmp_path, capsys):
    spec = write_spec(tmp_path / "tiny.yaml", model=str(tiny_checkpoint(FAMILY)), config=None, ctx_len=512)
    out = tmp_path / "out"
    assert main(["compile", str(spec), "-o", str(out), "--backend", "onnxruntime"]) == 0, (
        capsys.readouterr().err
    )
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    runs = manifest["programs"]["lang"]["verification"]["runs"]
    # 224x224 is 49 tokens and 354x536 is 187: V(S) = min(S, 187) for S = 64, 128; decode carries 128.
    assert [run["output_shapes"]["deepstack_features_RetainedState"] for run in runs] == [
        [2, 1, 64, 64],
        [2, 1, 128, 64],
        [2, 1, 128, 64],
    ]
    vision = manifest["programs"]["vision"]["verification"]["runs"]
    assert [run["output_shapes"][DEEPSTACK_FEATURES][2] for run in vision] == [49, 187]
    # The compiled artifacts generate like transformers: the 187-row image straddles chunks of
    # 128, then a text-only second turn reuses the cached rows.
    image = tmp_path / "image.png"
    helpers.image(354, 536).save(image)
    turns = ["--prompt", "Describe it.", "--prompt", "Which colour?"]
    code = main(["run", str(out), "--image", str(image), *turns, "--max-new-tokens", "4", "--compare-hf"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("compare-hf: tokens identical to transformers generate") == 2, err
