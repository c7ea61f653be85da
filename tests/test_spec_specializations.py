"""Specializations and custom IO: reference token facts, the vision-size policies, layouts, the table."""

from __future__ import annotations

import json

import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.families import get_family
from qeff_vision.families.base import ModelDescription
from qeff_vision.spec import (
    VisionSizePolicy,
    build_specializations,
    chunk_span,
    load_spec,
    resolve_layout,
    specialization_table,
    write_specializations,
)
from tests.test_spec_helpers import SPECS, spec_data, write_spec

LANGUAGE_SYMBOLS = ["batch_size", "seq_len", "vision_batch_size", "vision_size", "ctx_len"]
# (height, width) -> vision tokens, QEfficient's Qwen2.5-VL reference values.
REFERENCE_TOKENS = {(354, 536): 247, (640, 360): 299, (224, 224): 64, (1080, 1920): 2691, (1365, 2048): 3577}


def build(tmp_path, **overrides):
    return build_specializations(load_spec(write_spec(tmp_path, spec_data(**overrides))))


def language_sizes(result) -> list[tuple[str, str]]:
    return [(s.symbols["seq_len"], s.symbols["vision_size"]) for s in result.language.specializations]


# ---- reference facts ----


def test_reference_vision_symbols_of_354x536(tmp_path):
    result = build(tmp_path)
    (entry,) = result.vision.specializations
    assert entry.name == "Vision-354x536"
    assert dict(entry.symbols) == {
        "batch_size": "1",
        "grid_height": "988",
        "grid_width": "1176",
        "time": "1",
        "grid_h": "26",
        "grid_w": "38",
        "vision_size": "247",
    }


def test_reference_token_counts(tmp_path):
    images = [{"height": h, "width": w} for h, w in REFERENCE_TOKENS]
    result = build(tmp_path, ctx_len=8192, vision={"images": images})
    assert {(i.image.height, i.image.width): i.tokens for i in result.images} == REFERENCE_TOKENS
    sizes = [int(s.symbols["vision_size"]) for s in result.vision.specializations]
    assert sizes == list(REFERENCE_TOKENS.values())
    # Every value is a decimal string, as the compiler expects.
    for program in (result.vision, result.language):
        assert all(
            isinstance(v, str) and v.isdigit() for s in program.specializations for v in s.symbols.values()
        )


def test_family_defaults_match_the_pinned_processor_config():
    family = get_family("qwen2_5_vl")
    bare = ModelDescription({"vision_config": {}})
    assert family.pixel_limits(bare) == (4 * 28 * 28, 16384 * 28 * 28)


# ---- the vision-size policies ----

SMALL, LARGE = {"height": 224, "width": 224}, {"height": 1080, "width": 1920}  # 64 and 2691 tokens


@pytest.mark.parametrize(
    ("image", "max_images", "expected"),
    [
        (SMALL, 1, {32: 32, 128: 64, 512: 64}),
        (SMALL, 3, {32: 32, 128: 128, 512: 192}),
        (LARGE, 1, {32: 32, 128: 128, 512: 512}),
        (LARGE, 3, {32: 32, 128: 128, 512: 512}),
    ],
)
def test_chunk_policy(tmp_path, image, max_images, expected):
    result = build(
        tmp_path,
        ctx_len=16384,
        prefill={"seq_lens": [512, 32, 128]},
        vision={"images": [image], "max_images": max_images},
    )
    tokens = result.images[0].tokens
    assert result.request_image_tokens == tokens * max_images
    prefill = [(str(s), str(v)) for s, v in sorted(expected.items())]
    assert language_sizes(result) == [*prefill, ("1", str(max(expected.values())))]
    names = [s.name for s in result.language.specializations]
    assert names == ["Prefill-32", "Prefill-128", "Prefill-512", "Decode"]
    for entry in result.language.specializations:
        assert list(entry.symbols) == LANGUAGE_SYMBOLS
        assert entry.symbols["ctx_len"] == "16384" and entry.symbols["batch_size"] == "1"


def test_max_policy_gives_every_specialization_the_request_maximum(tmp_path):
    result = build(
        tmp_path,
        ctx_len=16384,
        prefill={"seq_lens": [32, 128]},
        vision={"images": [SMALL, LARGE], "max_images": 2, "vision_size": "max"},
    )
    assert language_sizes(result) == [("32", "5382"), ("128", "5382"), ("1", "5382")]


def test_integer_policy_is_used_as_is_and_warns(tmp_path):
    result = build(
        tmp_path, prefill={"seq_lens": [128, 512]}, vision={"images": [SMALL, LARGE], "vision_size": 256}
    )
    assert language_sizes(result) == [("128", "256"), ("512", "256"), ("1", "256")]
    assert [w.split(":")[0] for w in result.warnings] == ["vision.images[1]"]
    # A 512-token bucket still carries at most 256 placeholders: the 2691-token image spans 11-12 chunks.
    assert result.images[1].chunks[512] == (11, 12)


def test_policy_arithmetic():
    assert VisionSizePolicy("chunk").for_bucket(128, 64) == 64
    assert VisionSizePolicy("max").for_bucket(128, 64) == 64
    assert VisionSizePolicy("fixed", 7).for_bucket(128, 64) == 7
    assert chunk_span(247, 128) == (2, 3)
    assert chunk_span(256, 128) == (2, 3)
    assert chunk_span(1, 128) == (1, 1)
    assert chunk_span(129, 128) == (2, 2)


def test_resolutions_with_the_same_grid_share_a_vision_specialization(tmp_path):
    result = build(
        tmp_path, vision={"images": [{"height": 354, "width": 536}, {"height": 355, "width": 537}]}
    )
    assert [s.name for s in result.vision.specializations] == ["Vision-354x536"]
    assert [i.vision_specialization for i in result.images] == ["Vision-354x536", "Vision-354x536"]


# ---- custom IO ----


def parse_custom_io(text: str) -> dict[str, str]:
    entries = yaml.safe_load(text)
    assert all(set(entry) == {"IOName", "Precision"} for entry in entries)
    return {entry["IOName"]: entry["Precision"] for entry in entries}


@pytest.mark.parametrize(
    ("dtype", "compile_options", "vision_precision", "language_precision", "kv_precision"),
    [
        ("float32", {}, "float16", "float16", "float16"),
        ("float32", {"language": {"kv_cache_dtype": "mxint8"}}, "float16", "float16", "mxint8"),
        ("float32", {"convert_to_fp16": False}, "float32", "float32", "float16"),
        ("float32", {"vision": {"convert_to_fp16": False}}, "float32", "float16", "float16"),
        ("float16", {"convert_to_fp16": False, "kv_cache_dtype": "mxint8"}, "float16", "float16", "mxint8"),
    ],
)
def test_custom_io(tmp_path, dtype, compile_options, vision_precision, language_precision, kv_precision):
    result = build(tmp_path, dtype=dtype, compile=compile_options)
    vision = parse_custom_io(result.vision.custom_io_yaml())
    assert vision == {"pixel_values": vision_precision, "vision_embeds": vision_precision}
    language = parse_custom_io(result.language.custom_io_yaml())
    layers = 36  # Qwen2.5-VL-3B
    kv = {
        f"past_{kind}.{i}{suffix}"
        for i in range(layers)
        for kind in ("key", "value")
        for suffix in ("", "_RetainedState")
    }
    assert set(language) == kv | {"vision_embeds", "vision_embeds_RetainedState"}
    assert {language[name] for name in kv} == {kv_precision}
    assert language["vision_embeds"] == language["vision_embeds_RetainedState"] == language_precision
    # Graph order: inputs (vision_embeds, then the cache) before outputs.
    names = list(language)
    assert names[:3] == ["vision_embeds", "past_key.0", "past_value.0"]
    assert names.index("vision_embeds_RetainedState") == 1 + 2 * layers


def test_custom_io_text_layout(tmp_path):
    text = build(tmp_path).vision.custom_io_yaml()
    assert (
        text
        == "- IOName: pixel_values\n  Precision: float16\n\n- IOName: vision_embeds\n  Precision: float16\n"
    )


def test_custom_io_names_only_what_the_graph_has(tmp_path):
    result = build(tmp_path)
    family = get_family("qwen2_5_vl")
    graph = set(family.language_input_axes(36)) | set(family.language_output_axes(36))
    assert set(parse_custom_io(result.language.custom_io_yaml())) <= graph
    assert symbols.IMAGE_IDX not in parse_custom_io(result.language.custom_io_yaml())


# ---- layouts and files ----


def test_flat_and_named_layouts(tmp_path):
    flat = json.loads(build(tmp_path).language.specializations_json())
    assert flat["specializations"][0] == {
        "batch_size": "1",
        "seq_len": "128",
        "vision_batch_size": "1",
        "vision_size": "128",
        "ctx_len": "8192",
    }
    named = json.loads(build(tmp_path, specialization_layout="named").language.specializations_json())
    assert [e["name"] for e in named["specializations"]] == ["Prefill-128", "Prefill-512", "Decode"]
    assert named["specializations"][0]["symbols"] == flat["specializations"][0]
    vision = json.loads(build(tmp_path, specialization_layout="named").vision.specializations_json())
    assert vision["specializations"][0]["name"] == "Vision-354x536"


def test_auto_layout_follows_the_detected_sdk(tmp_path):
    assert resolve_layout("auto") == "flat"
    assert resolve_layout("auto", "named") == "named"
    assert resolve_layout("flat", "named") == "flat"
    spec = load_spec(write_spec(tmp_path, spec_data(specialization_layout="auto")))
    assert build_specializations(spec).language.layout == "flat"
    assert build_specializations(spec, layout=resolve_layout(spec.layout, "named")).language.layout == "named"
    with pytest.raises(ValueError):
        resolve_layout("tree")


def test_write_specializations(tmp_path):
    result = build(tmp_path)
    out = tmp_path / "out"
    (out / "vision").mkdir(parents=True)
    (out / "vision" / "model.onnx").write_text("keep me")
    written = write_specializations(result, out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        "lang/custom_io.yaml",
        "lang/specializations.json",
        "vision/custom_io.yaml",
        "vision/specializations.json",
    ]
    assert (out / "vision" / "model.onnx").read_text() == "keep me"
    assert not [p for p in out.rglob("*.tmp")]
    for relative, text in result.files().items():
        assert (out / relative).read_text() == text


def test_table(tmp_path):
    result = build(tmp_path, vision={"images": [{"height": 354, "width": 536}, LARGE]})
    table = specialization_table(result)
    lines = table.splitlines()
    assert "vision_size policy chunk, up to 2691 image tokens per request" in lines[0]
    assert any(
        line.split()[:2] == ["language", "Prefill-128"] and line.endswith("seq_len=128 vision_size=128")
        for line in lines
    )
    assert any(
        line.split()[:2] == ["language", "Decode"] and line.endswith("seq_len=1 vision_size=512")
        for line in lines
    )
    image_rows = {
        line.split()[0]: line.split()[1:] for line in lines if line.startswith(("354x536", "1080x1920"))
    }
    assert image_rows["354x536"] == ["247", "Vision-354x536", "2-3", "1-2"]
    assert image_rows["1080x1920"] == ["2691", "Vision-1080x1920", "22-23", "6-7"]


def test_whole_image_policy_counts_only_images_that_fit_whole():
    from qeff_vision.spec.policy import VisionSizePolicy, WholeImages

    gemma = WholeImages(tokens=(256,), max_images=4, gap=2)
    assert gemma.most_rows(128) == 0
    assert gemma.most_rows(512) == 256  # two images need 2 x 256 + 2 tokens
    assert gemma.most_rows(514) == 512
    assert gemma.most_rows(5000) == 1024  # max_images bounds it
    mixed = WholeImages(tokens=(100, 250), max_images=3, gap=0)
    assert mixed.most_rows(260) == 250 and mixed.most_rows(300) == 300  # 3 x 100 beats 250
    assert mixed.most_rows(350) == 350 and mixed.most_rows(450) == 450 and mixed.most_rows(1000) == 750
    chunk = VisionSizePolicy()
    assert chunk.for_bucket(128, 1024, gemma) == 1  # a text-only bucket still has one row
    assert chunk.for_bucket(512, 1024, gemma) == 256
    assert chunk.for_bucket(512, 1024) == 512  # splittable families: min(S, M)


def test_gemma3_spec_gets_whole_image_vision_sizes():
    from qeff_vision.spec import build_specializations, load_spec

    result = build_specializations(load_spec(SPECS / "gemma3" / "gemma-3-4b-it.yaml"))
    sizes = {s.name: s.symbols["vision_size"] for s in result.language.specializations}
    assert sizes == {"Prefill-128": "1", "Prefill-512": "256", "Decode": "256"}
