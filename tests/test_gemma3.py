"""Gemma 3 family: features, token math on the pinned gemma-3-4b-it config, tiny checkpoint, masks.

The mask tests compare the generic decoder's position-built masks with transformers' own
``create_masks_for_vision_model`` (full layers: OR(causal, same image); sliding layers:
AND(window, OR(causal, same image))), for whole prompts and for prefill chunks.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_vision import api, symbols
from qeff_vision.export.decoder import FULL_ATTENTION, SLIDING_ATTENTION, attention_masks, same_image_links
from qeff_vision.families import ImageSize, ModelDescription, describe_checkpoint, family_for, get_family
from qeff_vision.families.base import TextDims
from qeff_vision.families.gemma3 import IMG_SIZE
from qeff_vision.families.gemma3.tiny import MM_TOKENS_PER_IMAGE, SLIDING_WINDOW, SPECIAL_TOKENS
from tests import helpers

PINNED = Path(__file__).resolve().parents[1] / "specs" / "configs" / "gemma-3-4b-it"
IMAGE_TOKEN = 7


# ---- features and token math ----


def test_features_say_why_images_are_never_split():
    family = get_family("gemma3")
    assert not family.features.chunk_split.supported
    assert "both ways" in family.features.chunk_split.note
    unsupported = [support for _, support in family.features.rows() if not support.supported]
    assert unsupported and all(support.note for support in unsupported)
    table = api.families_table()
    assert "gemma3 [Gemma 3]" in table and "chunk split allowed  no (the tokens of one image" in table


def test_pinned_gemma_3_4b_it_token_math_and_defaults():
    """256 tokens per image at any size (QEfficient's mm_tokens_per_image); defaults fill the text config."""
    model = describe_checkpoint(PINNED)
    family = family_for(model)
    assert family.name == "gemma3"
    assert family.text_dims(model) == TextDims(
        hidden_size=2560,
        num_layers=34,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=256,
        vocab_size=262_208,
        max_position_embeddings=131_072,
    )
    assert family.image_token_id(model) == 262_144
    for height, width in ((896, 896), (1080, 1920), (100, 3000)):
        image = ImageSize(height, width)
        assert family.validate_image(model, image) == []
        assert family.vision_symbols(model, image) == {IMG_SIZE: 896, symbols.VISION_SIZE: 256}
        assert family.image_tokens(model, image) == 256


def test_validate_image_reports_what_the_token_math_cannot_cover():
    family = get_family("gemma3")
    model = describe_checkpoint(PINNED)
    assert family.validate_image(model, ImageSize(896, 896, frames=2)) == [
        "frames must be 1: Gemma 3 takes images only"
    ]
    pan_and_scan = ModelDescription(model.config, {**model.processor, "do_pan_and_scan": True})
    assert "do_pan_and_scan" in family.validate_image(pan_and_scan, ImageSize(896, 896))[0]
    resized = ModelDescription(model.config, {**model.processor, "size": {"height": 448, "width": 448}})
    assert "vision tower takes 896 px" in family.validate_image(resized, ImageSize(896, 896))[0]
    odd = ModelDescription({**model.config, "mm_tokens_per_image": 200})
    assert "must be a square" in family.validate_image(odd, ImageSize(896, 896))[0]


# ---- tiny checkpoint ----


def test_tiny_checkpoint_loads_offline_with_gemma_tokens_template_and_processor(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = helpers.load_hf(tiny_checkpoint("gemma3"))
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert type(processor).__name__ == "Gemma3Processor"
    assert type(processor.image_processor).__name__.startswith("Gemma3ImageProcessor")
    tokenizer = processor.tokenizer
    assert all(tokenizer.convert_tokens_to_ids(t) != tokenizer.unk_token_id for t in SPECIAL_TOKENS)
    text = processor.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *helpers.user_turn("<image>", " What? ")],
        add_generation_prompt=True,
    )
    assert (
        text
        == "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What?<end_of_turn>\n<start_of_turn>model\n"
    )
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(30, 70)])
    soft = "<image_soft_token>" * MM_TOKENS_PER_IMAGE
    assert f"\n\n<start_of_image>{soft}<end_of_image>\n\n" in tokenizer.decode(inputs["input_ids"][0])
    assert int(inputs["token_type_ids"].sum()) == MM_TOKENS_PER_IMAGE
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 112, 112)
    text_config = model.config.text_config
    assert set(text_config.layer_types) == {SLIDING_ATTENTION, FULL_ATTENTION}
    assert text_config.sliding_window == SLIDING_WINDOW < MM_TOKENS_PER_IMAGE


# ---- masks vs transformers ----


def _hf_masks(token_ids: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = Gemma3TextConfig(
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=2,
        sliding_window=window,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION],
    )
    config._attn_implementation = "eager"
    length = token_ids.shape[1]
    # transformers 5.24 renamed the cache argument from past_key_values to cache.
    cache_argument = (
        "cache"
        if "cache" in inspect.signature(create_masks_for_vision_model).parameters
        else "past_key_values"
    )
    masks = create_masks_for_vision_model(
        config=config,
        inputs_embeds=torch.zeros(1, length, 8),
        attention_mask=None,
        **{cache_argument: None},
        position_ids=torch.arange(length).view(1, -1),
        block_sequence_ids=get_block_sequence_ids_for_mask((token_ids == IMAGE_TOKEN).long()),
    )
    return {name: mask[0, 0] == 0 for name, mask in masks.items()}


def _our_masks(token_ids: torch.Tensor, start: int, stop: int, window: int) -> dict[str, torch.Tensor]:
    """Masks of the prefill chunk [start, stop) over a cache of the whole prompt's length."""
    chunk = token_ids[:, start:stop]
    positions = torch.arange(start, stop).view(1, -1)
    masks = attention_masks(
        positions,
        token_ids.shape[1],
        [SLIDING_ATTENTION, FULL_ATTENTION],
        window,
        same_image_links(chunk, IMAGE_TOKEN),
        torch.float32,
    )
    return {name: mask[0, 0] == 0 for name, mask in masks.items()}


def _random_layout(random: np.random.RandomState) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Token ids with 1-3 image runs (separated by text) and the runs' [start, stop)."""
    ids, runs = [1] * random.randint(0, 4), []
    for _ in range(random.randint(1, 4)):
        start = len(ids)
        ids += [IMAGE_TOKEN] * random.randint(1, 12)
        runs.append((start, len(ids)))
        ids += [1] * random.randint(1, 6)
    return torch.tensor([ids]), runs


@pytest.mark.parametrize("seed", range(20))
def test_masks_match_transformers_for_whole_prompts_and_whole_image_chunks(seed):
    random = np.random.RandomState(seed)
    token_ids, runs = _random_layout(random)
    length = token_ids.shape[1]
    window = int(random.randint(1, 16))  # often shorter than an image: the window cuts its block
    reference = _hf_masks(token_ids, window)
    inside = {x for start, stop in runs for x in range(start + 1, stop)}
    cuts = sorted({0, length} | {int(x) for x in random.randint(1, length, size=3)} - inside)
    for start, stop in zip(cuts, cuts[1:]):
        ours = _our_masks(token_ids, start, stop, window)
        for layer_type in (SLIDING_ATTENTION, FULL_ATTENTION):
            assert torch.equal(ours[layer_type], reference[layer_type][start:stop]), (layer_type, start, stop)


def test_a_chunk_cut_inside_an_image_would_lose_its_forward_links():
    """Why images are never split: a chunk cannot see keys of a later chunk, which the image needs."""
    token_ids = torch.tensor([[1, 1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 1, 1]])
    reference = _hf_masks(token_ids, window=8)[FULL_ATTENTION]
    ours = _our_masks(token_ids, 0, 4, window=8)[FULL_ATTENTION]
    assert not torch.equal(ours, reference[0:4])
    assert bool(reference[2, 5]) and not bool(ours[2, 5])  # image token 0 sees image token 3 in HF


def test_a_spec_whose_buckets_cannot_hold_a_whole_image_is_rejected(tmp_path):
    """128-token chunks cannot carry a 256-token image, and Gemma 3 cannot split one."""
    spec = tmp_path / "gemma.yaml"
    spec.write_text(
        f"model: google/gemma-3-4b-it\nconfig: {PINNED / 'config.json'}\nctx_len: 4096\n"
        "prefill: {seq_lens: [128]}\nvision: {images: [{height: 896, width: 896}]}\n"
    )
    problems, _ = api.validate(spec)
    assert len(problems) == 1
    assert "896x896 is 256 tokens (256 image rows)" in problems[0] and "both ways" in problems[0]
    assert "add a bucket with seq_len >= 256 and vision_size >= 256" in problems[0]
    spec.write_text(spec.read_text().replace("[128]", "[128, 512]"))
    problems, warnings = api.validate(spec)
    # Valid; only the vLLM 0.23 plugin cannot serve it (it cuts chunks inside images: serve_fit).
    assert problems == [] and warnings and all(w.startswith("vLLM 0.23.0 + vllm-qaic") for w in warnings)
