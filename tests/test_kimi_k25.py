"""Kimi-K2.5's own checks: token math, compile sizing, and attention that reads only the latent cache.

The registry-parametrized suites (parity, chunked runs, multi-turn, CB, disaggregated, padding rows)
cover the family end to end; these check what only this family has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_vision import symbols
from qeff_vision.contract.language_io import SLOT_ROLES
from qeff_vision.export.decoder import LanguageDecoder
from qeff_vision.exporter import example_values, load_adapter
from qeff_vision.families import ImageSize, describe_checkpoint, get_family
from qeff_vision.families.base import ModelDescription
from qeff_vision.families.kimi_k25.sizing import count_parameters
from tests import helpers

FAMILY = "kimi_k25"
PINNED = Path(__file__).resolve().parents[1] / "specs" / "configs" / "Kimi-K2.5"
# Landscape, portrait, square, past the 512-patch side and past the 16,384-patch budget.
SIZES = ((354, 536), (1080, 1920), (900, 300), (224, 224), (8000, 600), (4000, 4000), (13, 9))


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_token_math_is_the_processors(height, width):
    """Grid and placeholders from the pinned processor config equal transformers' processor's."""
    from transformers import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

    family, model = get_family(FAMILY), describe_checkpoint(PINNED)
    processor = Kimi_K25ImageProcessor()  # its class defaults are the pinned preprocessor_config.json
    _, (padded_h, padded_w) = navit_resize(
        height, width, 14, 2, processor.max_patches, processor.size["max_height"]
    )
    values = family.vision_symbols(model, ImageSize(height, width))
    assert (values["h"], values["w"]) == (padded_h // 14, padded_w // 14)
    assert values["num_patches"] == processor.get_number_of_image_patches(height, width)
    assert values[symbols.VISION_SIZE] == values["num_patches"] // 4


def test_compile_sizing_counts_every_parameter_of_the_published_config():
    """The validate note's parameter count equals the model transformers builds from the config."""
    from transformers import DeepseekV3Config, Kimi_K25Config, Kimi_K25ForConditionalGeneration

    config = describe_checkpoint(PINNED).config
    text = {k: v for k, v in config["text_config"].items() if k not in ("architectures", "model_type")}
    built = Kimi_K25Config(text_config=DeepseekV3Config(**text), tie_word_embeddings=False)
    with torch.device("meta"):
        model = Kimi_K25ForConditionalGeneration(built)
    total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for _, b in model.named_buffers() if "bias" in _
    )
    counted = count_parameters(config)
    assert counted.total == total
    assert 1.0e12 < counted.total < 1.1e12 and 30e9 < counted.active < 33e9


def test_validate_reports_devices_and_mxfp6_bytes():
    notes = get_family(FAMILY).config_view(describe_checkpoint(PINNED)).notes
    (sizing,) = [note for note in notes if note.startswith("compile sizing")]
    assert "1.03T parameters" in sizing and "804 GB" in sizing and "at least 26 devices" in sizing
    assert "70.3 KB per position" in sizing  # 61 layers x (512 + 64) x 2 bytes


def test_cache_rows_hold_the_latent_only():
    """Each layer keeps kv_lora_rank + qk_rope_head_dim values per position, not per-head K/V."""
    family = get_family(FAMILY)
    model = describe_checkpoint(PINNED)
    table = family.language_table(model)
    values = {symbols.BATCH_SIZE: 1, symbols.CTX_LEN: 1, **family.language_dims(model)}
    per_layer = {}
    for row in table.rows(*SLOT_ROLES):
        per_layer[row.layer] = per_layer.get(row.layer, 0) + int(np.prod(row.concrete_shape(values)))
    assert set(per_layer.values()) == {512 + 64} and len(per_layer) == 61


def test_exported_attention_never_expands_the_cache(hf_model):
    """The patched decoder matches transformers' logits and never calls kv_b_proj on cached latents."""
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(90, 120, 3)])
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    parts = adapter.decoder_parts(model)
    expanded = []
    hooks = [
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *args: expanded.append(args))
        for layer in parts.text_model.layers
    ]
    description = ModelDescription(model.config.to_dict())
    io = adapter.family.language_table(description)
    length = inputs["input_ids"].shape[1]
    values = {**example_values(adapter.family, description), symbols.CTX_LEN: length + 8}
    past = [torch.zeros(row.concrete_shape(values)) for row in io.rows(*SLOT_ROLES)]
    features = torch.cat(adapter.hf_image_features(model, inputs)).unsqueeze(0)
    positions = torch.arange(length).view(1, -1)
    try:
        with torch.no_grad():
            logits = LanguageDecoder(parts, io).eval()(
                inputs["input_ids"], positions, features, torch.zeros(1, 1, dtype=torch.int64), *past
            )[0]
    finally:
        for hook in hooks:
            hook.remove()
    assert expanded == []
    assert np.abs(logits[0, -1].numpy() - reference).max() <= 1e-3


def test_kv_memory_benchmark_compares_the_latent_cache_with_per_head_kv():
    """benchmarks/kv_memory.py on the pinned Kimi-K2.5: 61 x 576 x 2 B per position against per-head K/V."""
    kv_memory = helpers.load_benchmark("kv_memory")
    model = describe_checkpoint(PINNED)
    layouts = kv_memory.latent_layouts(get_family(FAMILY), model, kv_bytes=2)
    assert layouts["ours"] == layouts["QEfficient cache_compressed"] == 61 * (512 + 64) * 2 == 70272
    assert layouts["per-head K/V"] == 61 * 64 * (128 + 64 + 128) * 2  # 35.6x ours
    # The table's rows are the same bytes: a 128k-position sequence holds 8.58 GiB of latents.
    sizes = kv_memory.layout_bytes(get_family(FAMILY), model, 131072, kv_bytes=2, batch=1)
    assert sizes["ours"] == 70272 * 131072
    assert (
        kv_memory.latent_layouts(
            get_family("llava"), describe_checkpoint(PINNED.parent / "llava-1.5-7b-hf"), 2
        )
        is None
    )


def test_the_published_layout_loads_and_exports_as_transformers_reads_it(tiny_checkpoint, hf_model, exported):
    """The tiny checkpoint is moonshotai/Kimi-K2.5's layout: fused, rope-interleaved ``wqkv``, per-expert
    tensors, remote-code names. Each parameter's streamed source equals what transformers loads, and
    the exported vision graph equals transformers' image features.
    """
    from qeff_vision.export.weight_sources import SlicedSource, checkpoint_keys_for
    from qeff_vision.export.weights import Checkpoint
    from qeff_vision.runtime.session import OnnxProgram

    model, processor = hf_model(FAMILY)
    files = Checkpoint(tiny_checkpoint(FAMILY))
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in files.entries
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in files.entries
    assert not any(key.startswith("model.") for key in files.entries)
    keys = checkpoint_keys_for(model, files)
    query = keys["model.vision_tower.layers.0.attn.q_proj.weight"]
    assert (
        isinstance(query, SlicedSource) and query.rope_heads == model.config.vision_config.num_attention_heads
    )
    assert keys["model.vision_tower.layers.0.attn.v_proj.bias"].rope_heads == 0
    wanted = model.state_dict()
    assert set(keys) == set(wanted)
    for name, source in keys.items():
        assert torch.equal(source.values(files.read, wanted[name].shape), wanted[name]), name
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(((100, 150), (300, 120)))]
    processed = processor.image_processor(images=images, return_tensors="pt")
    reference = [f.numpy() for f in load_adapter(get_family(FAMILY)).hf_image_features(model, processed)]
    inputs = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
    for one, expected in zip(inputs, reference, strict=True):
        embeds = program.run(one)[symbols.VISION_EMBEDS]
        assert np.abs(embeds.reshape(expected.shape) - expected).max() <= 1e-4


def test_the_exported_graphs_have_no_buffer_inputs(exported):
    """A router's persistent ``e_score_correction_bias`` traces as a constant, not an input nothing feeds."""
    import onnx

    for program in ("vision", "lang"):
        graph = onnx.load(exported(FAMILY) / program / "model.onnx", load_external_data=False).graph
        names = [value.name for value in graph.input]
        assert not [name for name in names if "layers." in name or "correction_bias" in name], names
