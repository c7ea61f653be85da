"""LLaVA-1.5 family: token math and the QEfficient reference facts, the pinned spec, config checks,
and the exported tower's feature selection against transformers for every layer/strategy setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qeff_vision import symbols
from qeff_vision.families import family_for, get_family
from qeff_vision.families.base import ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.llava import IMG_SIZE
from qeff_vision.spec import build_specializations, load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"
SNAPSHOT = SPECS / "configs" / "llava-1.5-7b-hf"
SPEC = SPECS / "llava" / "llava-1.5-7b-hf.yaml"
FAMILY = get_family("llava")


@pytest.fixture(scope="module")
def published() -> ModelDescription:
    """The pinned llava-hf/llava-1.5-7b-hf config and preprocessor config."""
    return describe_checkpoint(SNAPSHOT, SNAPSHOT / "config.json")


def _with(description: ModelDescription, processor=None, vision=None, **changes) -> ModelDescription:
    """``description`` with top-level ``changes``, vision_config entries ``vision`` and a ``processor``."""
    config = json.loads(json.dumps(dict(description.config)))
    config.update(changes)
    config["vision_config"].update(vision or {})
    return ModelDescription(config, description.processor if processor is None else processor)


def test_published_checkpoint_is_llava(published):
    assert family_for(published) is FAMILY
    assert FAMILY.image_token_id(published) == 32000


@pytest.mark.parametrize("height,width", [(336, 336), (1080, 1920), (480, 640), (30, 900)])
def test_reference_576_tokens_at_every_resolution(published, height, width):
    """QEfficient's reference: 336x336 with 14-pixel patches is 576 tokens; the processor resizes."""
    image = ImageSize(height, width)
    assert FAMILY.vision_symbols(published, image) == {IMG_SIZE: 336, symbols.VISION_SIZE: 576}
    assert FAMILY.validate_image(published, image) == []


def test_full_strategy_keeps_the_cls_token(published):
    assert FAMILY.tokens_per_image(_with(published, vision_feature_select_strategy="full")) == 577


def test_partial_text_config_gets_llama_defaults(published):
    """The published text_config names only a few fields; the rest are LlamaConfig's (Vicuna-7B's)."""
    dims = FAMILY.text_dims(published)
    assert (dims.hidden_size, dims.num_layers, dims.num_attention_heads) == (4096, 32, 32)
    assert (dims.num_kv_heads, dims.head_dim, dims.vocab_size) == (32, 128, 32064)
    assert dims.max_position_embeddings == 4096


def test_config_problems_are_reported(published):
    image = ImageSize(336, 336)
    cropped = dict(published.processor, crop_size={"height": 224, "width": 224})
    assert FAMILY.validate_image(_with(published, processor=cropped), image) == [
        "the image processor crops to 224x224 but the vision tower takes 336x336"
    ]
    siglip = _with(published, vision={"model_type": "siglip_vision_model"})
    assert FAMILY.validate_image(siglip, image) == [
        "vision tower 'siglip_vision_model' is not supported; the llava family exports CLIP towers"
    ]
    assert (
        "not a multiple of patch_size"
        in FAMILY.validate_image(_with(published, vision={"image_size": 330}), image)[0]
    )
    assert "frames must be 1" in FAMILY.validate_image(published, ImageSize(336, 336, frames=4))[0]


def test_spec_specializations(published):
    result = build_specializations(load_spec(SPEC))
    (vision,) = result.vision.specializations  # every resolution shares the 336x336 graph
    assert dict(vision.symbols) == {"batch_size": "1", "img_size": "336", "vision_size": "576"}
    assert {image.tokens for image in result.images} == {576}
    assert result.request_image_tokens == 2 * 576
    sizes = [(s.symbols["seq_len"], s.symbols["vision_size"]) for s in result.language.specializations]
    assert sizes == [("128", "128"), ("512", "512"), ("1", "512")]


@pytest.mark.parametrize(
    "feature_layer,strategy",
    [(-2, "default"), (-1, "full"), (1, "default"), ([-3, -1], "default"), ([1, -2], "full")],
)
def test_exported_tower_selects_like_transformers(hf_model, feature_layer, strategy):
    """Truncated tower + selection + projector == transformers' get_image_features, any setting."""
    from transformers import LlavaForConditionalGeneration

    from qeff_vision.families.llava.export import VisionEncoder

    tiny, _ = hf_model("llava")
    config = type(tiny.config).from_dict(tiny.config.to_dict())
    config.vision_feature_layer, config.vision_feature_select_strategy = feature_layer, strategy
    torch.manual_seed(1)
    model = LlavaForConditionalGeneration(config).eval()
    size = config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = torch.stack(list(model.model.get_image_features(pixel_values=pixels).pooler_output))
        ours = VisionEncoder(model).eval()(pixels)
    tokens = FAMILY.tokens_per_image(ModelDescription(config.to_dict()))
    assert ours.shape == reference.shape == (2, tokens, config.text_config.hidden_size)
    assert (ours - reference).abs().max() <= 1e-5
