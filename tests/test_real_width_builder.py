"""The real-width config cut (qeff_vision/real_width.py), per family, without weights (default tier).

Every registered family has a pinned config; its cut keeps every width, keeps one layer of each
kind the pinned decoder has, re-indexes layer lists to the kept layers, keeps the lists whose
length sets a width, leaves no token id outside the cut vocabulary and routes among more experts
than a token picks.
"""

from __future__ import annotations

import json

import pytest

from qeff_vision.families import all_families
from qeff_vision.real_width import _TOKEN_KEY, cut_config, pinned_configs, smallest_pinned_config

FAMILIES = [family.name for family in all_families()]
WIDTHS = ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads")


@pytest.fixture(scope="module")
def cuts(tiny_checkpoint):
    """``cuts(family) -> (full, cut)``: the smallest pinned config as transformers reads it, and its cut."""
    import transformers

    from qeff_vision.checkpoint import quiet_transformers

    quiet_transformers()
    done = {}

    def build(family):
        if family not in done:
            full = transformers.AutoConfig.from_pretrained(smallest_pinned_config(family).parent).to_dict()
            tiny = json.loads((tiny_checkpoint(family) / "config.json").read_text())
            done[family] = full, cut_config(full, tiny)
        return done[family]

    return build


def _text(config):
    return config.get("text_config") or config


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_pinned_config(family):
    assert pinned_configs(family)
    assert smallest_pinned_config(family) in pinned_configs(family)


def test_the_smallest_config_is_the_narrowest():
    assert smallest_pinned_config("qwen2_5_vl").parent.name == "Qwen2.5-VL-3B-Instruct"
    assert smallest_pinned_config("gemma4").parent.name == "gemma-4-E2B-it"
    assert smallest_pinned_config("llama4").parent.name == "Llama-4-Scout-17B-16E-Instruct"  # fewer experts


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_keeps_widths_and_every_layer_kind(family, cuts):
    full, cut = cuts(family)
    for name in ("text_config", "vision_config"):
        before, after = full.get(name) or {}, cut.get(name) or {}
        for key in WIDTHS:
            assert after.get(key) == before.get(key), (name, key)
    text_full, text_cut = _text(full), _text(cut)
    layers = text_cut["num_hidden_layers"]
    assert 2 <= layers <= 6
    if text_full.get("layer_types"):
        assert set(text_cut["layer_types"]) == set(text_full["layer_types"])
        assert len(text_cut["layer_types"]) == layers
    for key in ("cross_attention_layers", "moe_layers"):
        if text_full.get(key):
            assert text_cut[key] and all(0 <= index < layers for index in text_cut[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_token_ids_fit_the_vocabulary(family, cuts):
    _, cut = cuts(family)
    # Molmo2's image tokens sit in an input-only vocabulary after vocab_size (the embedding has both).
    vocab = _text(cut)["vocab_size"] + int(_text(cut).get("additional_vocab_size") or 0)
    assert vocab < 1024
    for section in (cut, *(v for v in cut.values() if isinstance(v, dict))):
        for key, value in section.items():
            if _TOKEN_KEY.search(key) and "vocab_size" not in key and value is not None:
                for token in value if isinstance(value, list) else [value]:
                    assert 0 <= token < vocab, (key, token)


def test_layer_lists_follow_the_kept_layers(cuts):
    # mllama: one self-attention and one cross-attention layer; five intermediate tower layers
    # (vision_output_dim = 1,280 x 6 is a width) over a 5-layer tower, one global layer.
    _, cut = cuts("mllama")
    assert cut["text_config"]["cross_attention_layers"] == [1]
    assert cut["vision_config"]["intermediate_layers_indices"] == [0, 1, 2, 3, 4]
    assert cut["vision_config"]["num_hidden_layers"] == 5
    assert cut["vision_config"]["num_global_layers"] == 1
    # Qwen2.5-VL's tower: a window-attention layer, then a full-attention one.
    _, cut = cuts("qwen2_5_vl")
    assert cut["vision_config"]["depth"] == 2 and cut["vision_config"]["fullatt_block_indexes"] == [1]
    # Granite Vision concatenates four hidden states: they stay four distinct ones.
    _, cut = cuts("llava_next")
    assert cut["vision_feature_layer"] == [-4, -3, -2, -1]
    # Gemma 4 E2B: sliding and full layers, each once computing its KV and once reading it.
    _, cut = cuts("gemma4")
    text = cut["text_config"]
    assert text["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert text["num_kv_shared_layers"] == 2
    # Its full layers' 512-wide heads are per-layer overrides keyed by layer index: they follow.
    assert text["per_layer_config"] == {"1": {"head_dim": 512}, "3": {"head_dim": 512}}
    # Llama 4 Scout: a chunked RoPE layer and a full NoPE layer, both MoE, 4 of 16 experts.
    _, cut = cuts("llama4")
    text = cut["text_config"]
    assert text["no_rope_layers"] == [1, 0] and text["moe_layers"] == [0, 1]
    assert text["num_local_experts"] == 4


def test_a_built_checkpoint_loads_like_a_real_one(tmp_path):
    """Qwen2.5-VL-3B at real widths (2 + 2 layers, ~0.2 B parameters): transformers loads it, its
    processor resizes as the pinned one does, and its tokens are the tiny tokenizer's."""
    import transformers

    from qeff_vision.real_width import build_real_width_checkpoint

    out = build_real_width_checkpoint("qwen2_5_vl", tmp_path / "checkpoint")
    pinned = json.loads(
        (smallest_pinned_config("qwen2_5_vl").parent / "preprocessor_config.json").read_text()
    )
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.text_config.hidden_size == 2048 and config.text_config.num_hidden_layers == 2
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert processor.image_processor.patch_size == pinned["patch_size"]
    # The pinned min/max pixels override the tiny processor's size bounds when it loads.
    size = processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (pinned["min_pixels"], pinned["max_pixels"])
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    with pytest.raises(FileExistsError):
        build_real_width_checkpoint("qwen2_5_vl", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # nothing staged left behind


def test_a_build_in_the_published_dtype_is_drawn_and_saved_in_it(tmp_path):
    """``dtype="bfloat16"`` (Kimi-K2.5's real-width case): every floating tensor is saved as bf16, in
    shards no larger than ``SHARD_SIZE`` (so the save holds one shard's copy, not the model's), the
    config says so, and the config beside the weights is ``cut_pinned_config``'s."""
    from safetensors import safe_open

    from qeff_vision.real_width import (
        SHARD_SIZE,
        build_real_width_checkpoint,
        cut_pinned_config,
    )

    out = build_real_width_checkpoint("qwen2_5_vl", tmp_path / "checkpoint", dtype="bfloat16")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    limit = int(SHARD_SIZE.removesuffix("MB")) * 10**6
    dtypes = set()
    for shard in shards:
        assert shard.stat().st_size <= limit + 2**20, shard  # the header's few KiB over at most
        with safe_open(str(shard), "pt") as tensors:
            dtypes |= {str(tensors.get_slice(name).get_dtype()) for name in tensors.keys()}
    assert dtypes == {"BF16"}
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "bfloat16"
    expected = cut_pinned_config("qwen2_5_vl", smallest_pinned_config("qwen2_5_vl"))
    assert written["text_config"]["num_hidden_layers"] == expected["text_config"]["num_hidden_layers"]
    assert written["text_config"]["hidden_size"] == expected["text_config"]["hidden_size"] == 2048
    assert written["image_token_id"] == expected["image_token_id"]
    with pytest.raises(ValueError, match="dtype"):
        build_real_width_checkpoint("qwen2_5_vl", tmp_path / "other", dtype="int8")
