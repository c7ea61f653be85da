"""The runtime over a real ``qeff-vision compile --backend onnxruntime`` output directory.

A tiny spec (vision_size chunk, two prefill buckets, two resolutions) is compiled once from the
session's export; generation goes through the manifest's programs, whose sessions accept only the
compiled specializations, exactly as the device would.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.runtime.artifacts import compiled_size_for, generator_for_artifacts, load_artifacts
from qeff_vision.runtime.conversation import open_conversation
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import QaicProgram, ShapeMismatch, qaic_runtime_available
from tests import helpers

FAMILY = "qwen2_5_vl"
SEQ_LENS = (32, 64)
RESOLUTIONS = ((112, 112), (140, 196))  # 16 and 35 image tokens on the tiny checkpoint
CTX_LEN = 512
NEW_TOKENS = 8
_COMPILED: dict[str, object] = {}


def compile_tiny(tmp_path_factory, tiny_checkpoint, exported):
    """OUT of ``compile --backend onnxruntime`` for the tiny spec (built once per session)."""
    if "out" not in _COMPILED:
        from qeff_vision import api

        root = tmp_path_factory.mktemp("runtime-compiled")
        spec = {
            "name": "runtime-tiny",
            "model": str(tiny_checkpoint(FAMILY)),
            "ctx_len": CTX_LEN,
            "prefill": {"seq_lens": list(SEQ_LENS)},
            "vision": {
                "images": [{"height": h, "width": w} for h, w in RESOLUTIONS],
                "max_images": 2,
                "vision_size": "chunk",
            },
        }
        spec_path = root / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        out = root / "out"
        api.compile(
            spec_path,
            out,
            backend="onnxruntime",
            export_dir=exported(FAMILY),
            progress=None,
            status_stream=None,
        )
        _COMPILED["out"] = out
    return _COMPILED["out"]


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory, tiny_checkpoint, exported):
    return compile_tiny(tmp_path_factory, tiny_checkpoint, exported)


@pytest.fixture(scope="module")
def chat_factory(artifacts_dir):
    return lambda **options: open_conversation(artifacts_dir, max_new_tokens=NEW_TOKENS, **options)


def test_artifacts_read_the_manifest(artifacts_dir, tiny_checkpoint):
    artifacts = load_artifacts(artifacts_dir)
    assert artifacts.backend == "onnxruntime"
    # Runtime files come from OUT's copy; the checkpoint (weights) is still known for references.
    assert artifacts.model_dir == artifacts_dir / "model"
    assert artifacts.checkpoint_dir.resolve() == tiny_checkpoint(FAMILY).resolve()
    # vision_size chunk with two images of at most 35 rows: V(S) = min(S, 70).
    assert artifacts.shape == LanguageShape((PrefillBucket(32, 32), PrefillBucket(64, 64)), 64, CTX_LEN)
    assert [s[symbols.VISION_SIZE] for s in artifacts.vision_specializations] == [16, 35]


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_compiled_artifacts_generate_like_transformers(artifacts_dir, chat_factory, hf_model, protocol):
    model, _ = hf_model(FAMILY)
    chat = chat_factory(protocol=protocol)
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(RESOLUTIONS)]
    result = chat.ask(images, "Describe both pictures.", keep_logits=True)
    inputs = {k: torch.as_tensor(v) for k, v in chat.last_inputs.processed.items()}
    tokens, logits = helpers.hf_generate(model, inputs, NEW_TOKENS)
    assert result.tokens == tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(result.logits, logits)) <= 1e-3
    # Only compiled shapes were sent: every chunk used a compiled bucket (V = S); full sends all
    # 51 rows, so only the 64-row bucket can carry it.
    buckets = {(c.seq_len, c.vision_size) for c in result.chunks}
    assert buckets <= ({(32, 32), (64, 64)} if protocol == "chunk" else {(64, 64)})
    assert chat.generator.language.specializations is not None
    assert result.notes == [] and result.images_encoded == 2 and result.encoder_calls == 2


def test_full_protocol_beyond_the_compiled_vision_size_is_a_user_error(chat_factory):
    chat = chat_factory()
    images = [helpers.image(112, 112, 0), helpers.image(140, 196, 1), helpers.image(140, 196, 2)]
    with pytest.raises(UserError, match="sends all 86 image rows .* largest compiled vision_size is 64"):
        chat.ask(images, "Three images.", protocol="full")
    assert chat.messages == [], "a failed turn is not kept"


def test_batch_one_vision_program_encodes_same_resolution_images_one_by_one(chat_factory):
    chat = chat_factory()
    images = [helpers.image(112, 112, 1), helpers.image(112, 112, 2)]
    result = chat.ask(images, "Two of a kind.")
    # The cache asks for one call per resolution; the compiled program takes batch_size 1 only.
    assert result.images_encoded == 2 and result.encoder_calls == 2
    assert chat.cache.stats.encoder_calls == 1


def test_uncompiled_language_shape_is_rejected(artifacts_dir):
    artifacts = load_artifacts(artifacts_dir)
    generator = generator_for_artifacts(artifacts)
    feeds = _language_feeds(generator, seq_len=48, vision_size=48)
    with pytest.raises(ShapeMismatch, match=r"seq_len=48.*match no compiled specialization"):
        generator.language.run(feeds)
    assert generator.language.accepts(_language_feeds(generator, seq_len=32, vision_size=32))
    # A generator told about a bucket that was never compiled fails on its first chunk.
    rogue = Generator(
        generator.checkpoint,
        generator.vision,
        generator.language,
        LanguageShape((PrefillBucket(48, 48),), 64, CTX_LEN),
    )
    processed = {"input_ids": np.full((1, 20), 65, dtype=np.int64)}
    with pytest.raises(ShapeMismatch, match="seq_len=48"):
        rogue.generate(processed, max_new_tokens=2)


def test_uncompiled_image_resolution_is_rejected_by_the_vision_program(artifacts_dir, hf_model):
    _, processor = hf_model(FAMILY)
    generator = generator_for_artifacts(artifacts_dir)
    image = helpers.image(224, 224)
    processed = helpers.as_numpy(processor.image_processor(images=[image], return_tensors="pt"))
    inputs = generator.host.vision_inputs(processed)[0]
    with pytest.raises(ShapeMismatch, match="vision: .*grid_h=16.*match no compiled specialization"):
        generator.vision.run(inputs)


def test_other_images_are_resized_to_the_closest_compiled_resolution(artifacts_dir, chat_factory):
    artifacts = load_artifacts(artifacts_dir)
    assert compiled_size_for(artifacts, 112, 112) is None
    assert compiled_size_for(artifacts, 120, 100) is None, "smart resize already lands on 112x112"
    target = compiled_size_for(artifacts, 300, 420)
    assert (target.height, target.width) == (140, 196)
    chat = chat_factory()
    result = chat.ask([helpers.image(300, 420, 3)], "What is this?")
    assert result.notes == [
        "image 0: resized from 300x420 to 140x196 (height x width), the closest compiled resolution"
    ]
    assert result.image_rows == 35


def test_qaic_artifacts_need_the_sdk_runtime(artifacts_dir, tmp_path):
    if qaic_runtime_available():
        pytest.skip("the SDK runtime is installed here")
    copy = tmp_path / "qaic-out"
    shutil.copytree(artifacts_dir, copy, symlinks=True, ignore=shutil.ignore_patterns("export"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["backend"] = "qaic"
    manifest["export"]["dir"] = str((artifacts_dir / "export").resolve())
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="needs the Cloud AI 100 runtime \\(qaicrt"):
        generator_for_artifacts(copy)
    with pytest.raises(UserError, match="qaicrt"):
        QaicProgram(copy / "lang", {"inputs": {}, "outputs": {}})


def test_missing_manifest_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no manifest.json; run `qeff-vision compile`"):
        load_artifacts(tmp_path)
    with pytest.raises(UserError, match="no such directory"):
        load_artifacts(tmp_path / "absent")


def _language_feeds(generator, seq_len: int, vision_size: int) -> dict[str, np.ndarray]:
    dims = generator.dims
    feeds = {
        symbols.INPUT_IDS: np.zeros((1, seq_len), dtype=np.int64),
        symbols.POSITION_IDS: np.zeros((4, 1, seq_len), dtype=np.int64),
        symbols.VISION_EMBEDS: np.zeros((1, vision_size, dims.hidden_size), dtype=np.float32),
        symbols.IMAGE_IDX: np.zeros((1, 1), dtype=np.int64),
    }
    feeds.update(generator.empty_cache())
    return feeds
