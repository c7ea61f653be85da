"""Qwen2.5-VL window blocks at window cost: batched padded windows equal transformers' tower.

The windowed encoder (scores [windows, heads, S, S]) and the masked-full encoder (scores
[heads, P, P] with a window-id mask) must both give transformers' rows, including for grids that
are not a multiple of the window (padded windows) and for several same-resolution images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.qwen2_5_vl.export import VisionEncoder
from tests import helpers

TOLERANCE = 1e-4


@pytest.mark.parametrize("sizes", [[(60, 250)], [(300, 120)], [(140, 196), (140, 196)]])
def test_windowed_and_masked_encoders_match_transformers(hf_model, sizes):
    """Padded windows (60x250, 300x120) and a two-image batch: windowed == masked == HF."""
    model, processor = hf_model("qwen2_5_vl")
    adapter = load_adapter(get_family("qwen2_5_vl"))
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    processed = processor.image_processor(images=images, return_tensors="pt")
    reference = torch.stack(adapter.hf_image_features(model, processed)).numpy()
    grid_t, grid_h, grid_w = processed["image_grid_thw"][0].tolist()
    inputs = (
        torch.as_tensor(processed["pixel_values"]),
        torch.zeros(len(images), grid_t, grid_h, grid_w, dtype=torch.int64),
    )
    for windowed in (True, False):
        encoder = VisionEncoder(model.model.visual, windowed=windowed).eval()
        with torch.no_grad():
            rows = encoder(*inputs).numpy()
        assert rows.shape == reference.shape
        assert np.abs(rows - reference).max() <= TOLERANCE, (sizes, windowed)


def test_windowed_encoder_matches_transformers_on_a_clip(hf_model):
    """A 4-frame clip (2 temporal patches, padded windows): each frame is windowed on its own."""
    model, processor = hf_model("qwen2_5_vl")
    frames = [np.asarray(helpers.image(60, 250, seed)) for seed in range(4)]
    processed = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    grid = processed["video_grid_thw"]
    with torch.no_grad():
        reference = model.model.visual(processed["pixel_values_videos"], grid_thw=grid).pooler_output
    grid_t, grid_h, grid_w = grid[0].tolist()
    assert grid_t == 2
    inputs = (processed["pixel_values_videos"], torch.zeros(1, grid_t, grid_h, grid_w, dtype=torch.int64))
    for windowed in (True, False):
        with torch.no_grad():
            rows = VisionEncoder(model.model.visual, windowed=windowed).eval()(*inputs)[0]
        assert rows.shape == reference.shape
        assert (rows - reference).abs().max().item() <= TOLERANCE, windowed
