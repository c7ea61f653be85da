"""Qwen2.5-VL patch buckets: packed images with padding give transformers' rows for each image.

The patch-bucket tower gets ids from the host (:mod:`qeff_vision.families.qwen2_5_vl.patches`)
instead of a grid shape; padding patches and the other images of a packed call must change no
valid row, and a window block shared by partial windows of several images must keep them apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision import api
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.qwen2_5_vl import GRID_HEIGHT, WINDOW_BLOCKS
from qeff_vision.families.qwen2_5_vl.patches import Geometry, windows_needed
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.test_spec_helpers import DELETE, SPECS, problems_of, spec_data, write_spec

CONFIGS = SPECS / "configs"

TOLERANCE = 1e-4


def test_window_blocks_hold_any_one_image_of_the_bucket():
    """Every merged grid of a 1,024-patch bucket packs into the bucket's window blocks."""
    geometry = Geometry()
    tokens = 1024 // 4
    blocks = geometry.window_blocks(1024)
    worst = max(
        windows_needed([(2 * h, 2 * w)], geometry)
        for h in range(1, tokens + 1)
        for w in range(1, tokens // h + 1)
    )
    assert worst <= blocks


@pytest.mark.parametrize(
    "sizes, bucket",
    [
        ([(60, 250)], 256),
        ([(300, 120), (28, 600), (140, 196)], 512),
        ([(600, 28), (84, 84), (60, 250), (224, 224)], 512),
    ],
)
def test_packed_bucket_rows_equal_transformers_per_image(hf_model, sizes, bucket):
    """Each image's rows from one packed, padded call equal transformers on that image alone."""
    model, processor = hf_model("qwen2_5_vl")
    family = get_family("qwen2_5_vl")
    adapter, host = load_adapter(family), helpers.host(model, "qwen2_5_vl")
    encoder = adapter.patch_bucket_encoder(model)
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    items, references = [], []
    for image in images:
        processed = processor.image_processor(images=[image], return_tensors="np")
        items += host.vision_inputs(processed)
        torch_inputs = {k: torch.as_tensor(v) for k, v in processed.items()}
        references.append(adapter.hf_image_features(model, torch_inputs)[0].numpy())
    symbols = {GRID_HEIGHT: bucket, WINDOW_BLOCKS: Geometry().window_blocks(bucket)}
    feeds = host.pack_vision_inputs(items, symbols)
    assert feeds is not None
    with torch.no_grad():
        rows = encoder(*(torch.as_tensor(v) for v in feeds.values()))[0].numpy()
    assert rows.shape[0] == bucket // 4
    start = 0
    for reference in references:
        got = rows[start : start + len(reference)]
        assert np.abs(got - reference).max() <= TOLERANCE
        start += len(reference)


# ---- spec: vision.patch_buckets ----


def _bucket_spec(tmp_path, buckets, ctx_len=8192, **vision):
    data = spec_data(ctx_len=ctx_len, vision={"images": DELETE, "patch_buckets": buckets, **vision})
    return write_spec(tmp_path, data)


def test_patch_bucket_spec_specializes_one_vision_program_per_bucket(tmp_path):
    """Each bucket binds the patch-bucket graph's symbols; the largest bucket sizes the request."""
    spec = load_spec(_bucket_spec(tmp_path, [4096, 1024], max_images=2))
    assert spec.vision.patch_buckets == (1024, 4096) and spec.vision.images == ()
    result = build_specializations(spec)
    vision = {entry.name: dict(entry.symbols) for entry in result.vision.specializations}
    assert vision == {
        "Vision-patches1024": {
            "grid_height": "1024",
            "grid_width": "1176",
            "window_blocks": "23",
            "vision_size": "256",
        },
        "Vision-patches4096": {
            "grid_height": "4096",
            "grid_width": "1176",
            "window_blocks": "87",
            "vision_size": "1024",
        },
    }
    assert result.request_image_tokens == 2 * 1024
    lines = api.bucket_admission(_bucket_spec(tmp_path, [1024]))
    assert lines[0].startswith("patch bucket 1024: up to 256 image tokens per call")
    assert "1:1 448x448" in lines[0]  # 32 x 32 patches: the largest square image that fits 1,024


def test_patch_bucket_spec_problems_and_warnings(tmp_path):
    """Both modes at once, partial merged tokens, an unfillable bucket, a family without buckets."""
    both = spec_data(vision={"patch_buckets": [1024]})
    assert any("either images" in p for p in problems_of(write_spec(tmp_path, both)))
    # Clips keep per-(resolution, frames) programs: buckets carry no time axis.
    clips = spec_data(
        vision={"patch_buckets": [1024], "videos": [{"height": 224, "width": 224, "frames": 4}]}
    )
    del clips["vision"]["images"]
    assert any("either images/videos" in p for p in problems_of(write_spec(tmp_path, clips)))
    assert problems_of(_bucket_spec(tmp_path, [1022, 0])) == [
        "vision.patch_buckets[1]: must be a positive integer (got 0)"
    ]
    assert problems_of(_bucket_spec(tmp_path, [1022])) == [
        "vision.patch_buckets[0]: 1022 patches is not a multiple of 4 (one merged token is 4 patches)"
    ]
    # The 3B processor's max_pixels is 12,845,056 pixels = 65,536 patches.
    spec = load_spec(_bucket_spec(tmp_path, [1024, 70000], ctx_len=32768))
    assert spec.warnings == (
        "vision.patch_buckets: bucket 70000 is larger than any image the processor produces "
        "(max_pixels gives at most 65536 patches): no single image fills it",
    )
    assert "does not fit ctx_len 8192" in problems_of(_bucket_spec(tmp_path, [65536]))[0]
    gemma = spec_data(model="google/gemma-3-4b-it", config=str(CONFIGS / "gemma-3-4b-it" / "config.json"))
    gemma["vision"] = {"patch_buckets": [1024]}
    assert any("has no patch-bucket vision program" in p for p in problems_of(write_spec(tmp_path, gemma)))


def test_a_clip_in_a_patch_bucket_call_is_refused_in_one_line():
    """Packing ids have no time axis: a clip (two temporal patches) gets a clear refusal, not wrong rows."""
    from qeff_vision.errors import UserError
    from qeff_vision.families.base import ModelDescription
    from qeff_vision.families.qwen2_5_vl import IMAGE_GRID_THW

    config = {"vision_config": {"window_size": 112, "spatial_merge_size": 2, "patch_size": 14}}
    host = get_family("qwen2_5_vl").host(ModelDescription(config))
    pixels = np.zeros((2 * 16, 1176), np.float32)
    clip = {"pixel_values": pixels, IMAGE_GRID_THW: np.zeros((1, 2, 4, 4), np.int64)}
    with pytest.raises(UserError, match="video clip needs a per-resolution vision program"):
        host.pack_vision_inputs([clip], {GRID_HEIGHT: 1024, WINDOW_BLOCKS: 23})
