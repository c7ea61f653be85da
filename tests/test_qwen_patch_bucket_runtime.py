"""Patch buckets end to end on tiny Qwen2.5-VL: compile (onnxruntime verifies every bucket), run
images of resolutions no spec lists at their own resolution, pack several images per call.

Acceptance of issue 14: tokens identical to transformers generate on the same image at its own
resolution (logits within fp32 tolerance, no resize note), through three buckets; six mixed
images need no more encoder calls than buckets used and equal encoding them one by one.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import yaml

from qeff_vision import api
from qeff_vision.runtime.conversation import open_conversation
from tests import helpers

FAMILY = "qwen2_5_vl"
# The tiny processor's max_pixels is 1,024 merged tokens = 4,096 patches: the largest bucket holds
# every image at its own resolution.
BUCKETS = (1024, 2048, 4096)
NAMED = ((28, 28), (28, 1792), (1792, 28), (1080, 1920), (2048, 1365))
NEW_TOKENS = 4
TOLERANCE = 1e-3  # fp32 logits after a 2-layer decoder and a packed, padded tower


def random_sizes(count: int, seed: int = 14) -> list[tuple[int, int]]:
    """Resolutions no spec lists: random sides from 20 to 1,500 pixels, aspect ratio within 1:8."""
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        height, width = rng.randint(20, 1500), rng.randint(20, 1500)
        if max(height, width) / min(height, width) <= 8:
            sizes.append((height, width))
    return sizes


ALL_SIZES = [*NAMED, *random_sizes(20)]
FAST_SIZES = [*NAMED[:4]]  # the two thin strips, the smallest and a 1080p image (4,092 patches)


@pytest.fixture(scope="module")
def bucket_artifacts(tmp_path_factory, tiny_checkpoint):
    """OUT of ``compile --backend onnxruntime`` for a three-bucket spec of the tiny checkpoint."""
    root = tmp_path_factory.mktemp("patch-buckets")
    spec = {
        "name": "tiny-patch-buckets",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 1536,
        "prefill": {"seq_lens": [128, 512]},
        "vision": {"patch_buckets": list(BUCKETS), "max_images": 1, "vision_size": "chunk"},
    }
    spec_path = root / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = root / "out"
    api.compile(spec_path, out, backend="onnxruntime", progress=None, status_stream=None)
    return out


def test_onnxruntime_backend_verifies_every_bucket(bucket_artifacts):
    """The export holds the patch-bucket program; each bucket ran with its bound shapes."""
    export = json.loads((bucket_artifacts / "export" / "export.json").read_text())
    assert export["vision_mode"] == "patch_buckets"
    vision = json.loads((bucket_artifacts / "manifest.json").read_text())["programs"]["vision"]
    runs = vision["verification"]["runs"]
    assert [run["output_shapes"]["vision_embeds"] for run in runs] == [[1, b // 4, 64] for b in BUCKETS]
    assert [run["symbols"]["window_blocks"] for run in runs] == [23, 44, 87]


def _parity(bucket_artifacts, hf_model, sizes):
    model, _ = hf_model(FAMILY)
    chat = open_conversation(bucket_artifacts, max_new_tokens=NEW_TOKENS)
    used = set()
    for seed, (height, width) in enumerate(sizes):
        chat.reset()
        result = chat.ask([helpers.image(height, width, seed)], "Describe.", keep_logits=True)
        inputs = {k: torch.as_tensor(v) for k, v in chat.last_inputs.processed.items()}
        tokens, logits = helpers.hf_generate(model, inputs, NEW_TOKENS)
        # No resize: the image ran at its own resolution (the one note: the template's opening
        # tokens, before the image, are still held from the last image's conversation).
        assert [note for note in result.notes if "already held" not in note] == [], (height, width)
        assert result.tokens == tokens, (height, width)
        assert max(float(np.abs(a - b).max()) for a, b in zip(result.logits, logits)) <= TOLERANCE
        (served,) = result.served
        assert served.startswith("image 1: patch bucket of "), served
        used.add(served.split(" rows")[0])
    return used


def test_images_at_their_own_resolution_generate_like_transformers(bucket_artifacts, hf_model):
    """28x28, 28x1792, 1792x28 and 1080x1920 through the buckets (the fast subset of the sweep)."""
    assert len(_parity(bucket_artifacts, hf_model, FAST_SIZES)) >= 2


@pytest.mark.slow
def test_twenty_five_resolutions_generate_like_transformers(bucket_artifacts, hf_model):
    """The acceptance sweep: the five named sizes plus twenty random ones."""
    assert len(_parity(bucket_artifacts, hf_model, ALL_SIZES)) == len(BUCKETS)


def test_six_mixed_images_pack_into_no_more_calls_than_buckets_used(bucket_artifacts, hf_model):
    """Packed encoding equals one-by-one encoding, with calls <= buckets used."""
    sizes = [(600, 900), (300, 300), (28, 1792), (140, 196), (84, 500), (700, 400)]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    chat = open_conversation(bucket_artifacts, max_new_tokens=NEW_TOKENS)
    generator = chat.generator
    processed = chat.prepare(images, "Compare.").processed
    prepared, inputs_by_key = generator._prepare_images(processed)
    served: dict[str, str] = {}  # what a request's state records: the call that served each image
    packed_encoder = generator._encoder(inputs_by_key, [0.0], served)
    calls_before = generator.vision.calls
    packed = packed_encoder(prepared)
    calls = generator.vision.calls - calls_before
    buckets_used = {line.split(" rows")[0] for line in served.values()}
    assert calls <= len(buckets_used) and calls < len(images)
    one_by_one = [packed_encoder([image])[0] for image in prepared]
    assert generator.vision.calls - calls_before == calls + len(images)
    for together, alone in zip(packed, one_by_one):
        assert together.shape == alone.shape
        assert np.abs(together - alone).max() <= 1e-5


def test_image_past_the_largest_bucket_is_downscaled_with_its_aspect_ratio(bucket_artifacts, hf_model):
    """The processor's own rule with max_pixels set to the bucket: aspect kept, a note, it fits."""
    from dataclasses import replace

    from qeff_vision.runtime.artifacts import image_fitter, load_artifacts

    _, processor = hf_model(FAMILY)
    artifacts = replace(load_artifacts(bucket_artifacts), patch_buckets=(1024,))
    fit = image_fitter(artifacts)
    small = helpers.image(300, 400, 0)
    assert fit(small) == (small, None)
    fitted, note = fit(helpers.image(1080, 1920, 1))
    assert note == (
        "downscaled from 1080x1920 to 336x588 (height x width, aspect ratio kept) to fit the largest "
        "patch bucket (1024 patches)"
    )
    grid = processor.image_processor(images=[fitted], return_tensors="np")["image_grid_thw"][0]
    assert grid.tolist() == [1, 24, 42]  # 1,008 patches, aspect 0.571 (1080/1920 = 0.5625)
