"""GLM-4.1V's own token math and positions against transformers' processor and ``get_rope_index``.

The registry suites (parity, chunking, batching, deployments) cover the programs; these check the
host arithmetic the family writes itself on sizes the suites do not use: images smaller than one
28-pixel token side, past the processor's pixel budget, extreme aspect ratios, and two images of
different sizes with text between them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision.errors import UserError
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, describe_checkpoint
from tests import helpers

FAMILY = get_family("glm4v")
SIZES = [(20, 30), (100, 150), (224, 224), (300, 120), (27, 600), (700, 640), (33, 34)]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("glm4v")


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_image_tokens_match_the_processor(checkpoint, hf_model, height, width):
    _, processor = hf_model("glm4v")
    model = describe_checkpoint(checkpoint)
    out = processor.image_processor(images=[helpers.image(height, width)], return_tensors="np")
    grid = out["image_grid_thw"][0].tolist()
    symbols = FAMILY.vision_symbols(model, ImageSize(height, width))
    assert [symbols["time"], symbols["grid_h"], symbols["grid_w"]] == grid
    assert FAMILY.image_tokens(model, ImageSize(height, width)) == int(np.prod(grid)) // 4
    assert symbols["grid_height"] == out["pixel_values"].shape[0]
    assert symbols["grid_width"] == out["pixel_values"].shape[1]


def test_positions_of_two_images_match_get_rope_index(checkpoint, hf_model):
    model, processor = hf_model("glm4v")
    messages = helpers.user_turn("<image>", "between", "<image>", "after")
    inputs = helpers.process(processor, messages, [helpers.image(100, 150), helpers.image(300, 120, 1)])
    with torch.no_grad():
        reference, _ = model.model.get_rope_index(
            inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
    host = FAMILY.host(describe_checkpoint(checkpoint))
    positions = host.prompt_positions(helpers.as_numpy(inputs))
    length = inputs["input_ids"].shape[1]
    assert positions.shape == (4, 1, length)
    np.testing.assert_array_equal(positions[0, 0], np.arange(length))
    np.testing.assert_array_equal(positions[1:], reference.numpy())
    assert host.placeholder_counts(helpers.as_numpy(inputs)) == [
        int(np.prod(g)) // 4 for g in inputs["image_grid_thw"].tolist()
    ]
    items = host.vision_inputs(helpers.as_numpy(inputs))
    assert [item["image_grid_thw"].shape for item in items] == [
        (1, *g) for g in map(tuple, inputs["image_grid_thw"].tolist())
    ]


def test_a_clip_is_one_user_error(checkpoint):
    host = FAMILY.host(describe_checkpoint(checkpoint))
    with pytest.raises(UserError, match="video input is not supported"):
        host.has_images({"input_ids": np.zeros((1, 4)), "pixel_values_videos": np.zeros((8, 1176))})
    problems = FAMILY.validate_image(
        describe_checkpoint(checkpoint), ImageSize(224, 224, frames=4, video=True)
    )
    assert any("images only" in problem for problem in problems)
    assert FAMILY.validate_image(describe_checkpoint(checkpoint), ImageSize(10, 2100))  # aspect ratio > 200
