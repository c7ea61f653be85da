"""Llama 3.2 Vision (mllama), the cross-attention decoder kind: token math equals the processor's,
three-stage parity of the vision K/V and the patched decoder, and chunked generation token-identical
to transformers generate with the cross states computed once per image.

The tiny checkpoint has 56 px tiles (4 x 17 cross-attention rows per image) and a 4-layer decoder
whose layers 1 and 3 are cross-attention layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_vision import api, symbols
from qeff_vision.cli import main
from qeff_vision.errors import UserError
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.base import CROSS_ATTENTION, ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.mllama import tiled_canvas
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers
from tests.family_runtime import CTX_LEN, NEW_TOKENS, FamilyRuntime

FAMILY = "mllama"
SPECS = Path(__file__).resolve().parent.parent / "specs"
SPEC = SPECS / "mllama" / "llama-3.2-11b-vision-instruct.yaml"
LLAMA_32_11B = describe_checkpoint(SPECS / "configs" / "Llama-3.2-11B-Vision-Instruct")
TOLERANCE = 1e-4
LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light is softer. "
)


def test_family_declares_the_cross_attention_kind_and_the_11b_shapes():
    family = get_family(FAMILY)
    assert family.decoder_kind == CROSS_ATTENTION
    assert family.states_per_image(LLAMA_32_11B) == 4 * 1601
    cross = [3, 8, 13, 18, 23, 28, 33, 38]
    assert list(family.vision_outputs(LLAMA_32_11B)) == [
        name for layer in cross for name in (symbols.past_key(layer), symbols.past_value(layer))
    ]
    axes = family.language_input_axes(40, family.kv_cache_symbols(LLAMA_32_11B))
    assert symbols.VISION_EMBEDS not in axes and symbols.IMAGE_IDX not in axes
    assert list(axes)[:3] == [symbols.INPUT_IDS, symbols.POSITION_IDS, symbols.CROSS_ATTENTION_MASK]
    assert [axes[symbols.past_key(i)][2] for i in (2, 3)] == [symbols.CTX_LEN, "cross_states"]


@pytest.mark.parametrize(
    "size", [(1, 1), (560, 560), (1080, 1920), (384, 3840), (3840, 384), (600, 1200), (4000, 90)]
)
def test_tiling_matches_the_processor(size):
    from transformers.models.mllama.image_processing_mllama import get_optimal_tiled_canvas

    family = get_family(FAMILY)
    height, width = size
    assert tiled_canvas(height, width, 4, 560) == tuple(
        int(x) for x in get_optimal_tiled_canvas(height, width, 4, 560)
    )
    rows, columns = family.tiles(LLAMA_32_11B, ImageSize(height, width))
    assert (
        family.aspect_ratio_id(LLAMA_32_11B, ImageSize(height, width))
        == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)].index((rows, columns)) + 1
    )


def test_aspect_ratio_ids_equal_the_tiny_processor(hf_model):
    _, processor = hf_model(FAMILY)
    family = get_family(FAMILY)
    model = describe_checkpoint(helpers_dir(processor))
    for height, width in ((50, 50), (100, 150), (300, 120), (20, 400)):
        processed = processor.image_processor(images=[helpers.image(height, width)], return_tensors="np")
        assert int(processed["aspect_ratio_ids"][0, 0]) == family.aspect_ratio_id(
            model, ImageSize(height, width)
        )


def helpers_dir(processor) -> Path:
    return Path(processor.tokenizer.name_or_path)


def test_spec_with_vision_size_is_refused_with_the_reason(tmp_path, capsys):
    text = SPEC.read_text().replace("  max_images: 2\n", "  max_images: 2\n  vision_size: chunk\n")
    spec = tmp_path / "mllama" / "vs.yaml"
    spec.parent.mkdir()
    spec.write_text(text.replace("../configs/", f"{SPECS}/configs/"))
    code = main(["validate", str(spec)])
    err = capsys.readouterr().err
    assert code == 2
    assert "vision.vision_size" in err and "cross-attention decoder" in err and "no vision_size axis" in err
    assert api.validate(SPEC) == ([], [])


def test_vision_kv_three_stage_parity(hf_model, exported):
    """transformers' cached cross K/V vs the patched torch encoder vs onnxruntime, one graph for all sizes."""
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    encoder = adapter.vision_encoder(model)
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    names = list(get_family(FAMILY).vision_outputs(describe_checkpoint(helpers_dir(processor))))
    for seed, (height, width) in enumerate(adapter.test_image_sizes):
        processed = processor.image_processor(
            images=[helpers.image(height, width, seed)], return_tensors="pt"
        )
        reference = adapter.hf_image_features(model, processed)
        arrays = {name: value.numpy() for name, value in processed.items() if torch.is_tensor(value)}
        inputs = helpers.host(model, FAMILY).vision_inputs(arrays)[0]
        with torch.no_grad():
            patched = encoder(*[torch.as_tensor(v) for v in inputs.values()])
        onnx = program.run(inputs)
        for index, name in enumerate(names):
            ref = reference[index].numpy()
            assert patched[index][0].shape == ref.shape == onnx[name][0].shape
            assert np.abs(patched[index][0].numpy() - ref).max() <= TOLERANCE, (height, width, name)
            assert np.abs(onnx[name][0] - ref).max() <= TOLERANCE, (height, width, name)


def test_patched_decoder_matches_transformers(hf_model):
    """The cross decoder on retained state (HF's cross K/V as inputs) vs transformers' forward."""
    from qeff_vision.families.mllama.export import CrossAttentionDecoder

    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    images = [helpers.image(90, 120, 3), helpers.image(300, 120, 4)]
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi", "<image>", "and?"), images)
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    cross = iter(adapter.hf_image_features(model, inputs))
    config = model.config.text_config
    length, head_dim = inputs["input_ids"].shape[1], config.hidden_size // config.num_attention_heads
    past = []
    for layer in range(config.num_hidden_layers):
        if layer in config.cross_attention_layers:
            past += [next(cross)[None], next(cross)[None]]
        else:
            past += [torch.zeros(1, config.num_key_value_heads, length + 8, head_dim)] * 2
    with torch.no_grad():
        io = get_family(FAMILY).language_table(ModelDescription(model.config.to_dict()))
        logits = CrossAttentionDecoder(model, io).eval()(
            inputs["input_ids"], torch.arange(length).view(1, -1), inputs["cross_attention_mask"], *past
        )[0]
    assert np.abs(logits[0, -1].numpy() - reference).max() <= 1e-3


class CrossRuntime(FamilyRuntime):
    """FamilyRuntime whose generators are the cross-attention host, counting what crosses to the program."""

    def generator(self, seq_lens, protocol="chunk", cache=None):
        buckets = tuple(PrefillBucket(s, 1) for s in seq_lens)
        mask = self.language.session.get_inputs()[2].shape
        return CrossAttentionGenerator(
            self.checkpoint,
            self.vision,
            self.language,
            LanguageShape(buckets, 1, CTX_LEN),
            cache,
            cross_mask_shape=mask,
        )


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return CrossRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


def _watch_cross_inputs(generator):
    """Record, per language call, the cross K/V inputs it received."""
    seen, run = [], generator.language.run

    def recording(feeds):
        seen.append({name: feeds[name].copy() for name in generator.cross_names if name in feeds})
        return run(feeds)

    generator.language.run = recording
    return seen


def test_two_images_chunked_and_cross_states_computed_once(runtime):
    images = [helpers.image(100, 150, 1), helpers.image(300, 120, 2)]
    processed = runtime.inputs(["<image>", "and", "<image>", "Which is wider?"], images)
    generator = runtime.generator([8])
    calls = runtime.vision.calls
    seen = _watch_cross_inputs(generator)
    try:
        result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    finally:
        del generator.language.run
    runtime.check(result, processed, "two images, chunks of 8")
    assert len(result.chunks) > 2 and result.encoder_calls == runtime.vision.calls - calls == 2
    # Every chunk and decode step read the very same states the vision program produced once.
    first = seen[0]
    assert first and all(first[n].shape[2] == 2 * 4 * 17 for n in first)
    assert len(seen) == len(result.chunks) + len(result.tokens) - 1
    assert all(all(np.array_equal(call[n], first[n]) for n in first) for call in seen[1:])


def test_image_text_only_chunk_image(runtime):
    images = [helpers.image(60, 250, 3), helpers.image(100, 150, 4)]
    processed = runtime.inputs(["<image>", 2 * LONG_TEXT, "<image>", "What changed?"], images)
    image_token = int(runtime.config["image_token_index"])
    positions = np.flatnonzero(processed["input_ids"][0] == image_token)
    generator = runtime.generator([16])
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, "image / text-only chunk / image")
    chunk_of = positions // 16
    assert chunk_of[1] - chunk_of[0] >= 2  # at least one chunk between them holds no image token


def test_text_only_prompt(runtime):
    processed = runtime.inputs(["Tell me a story about a lighthouse."], [])
    result = runtime.generator([16]).generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, "text only")
    assert result.encoder_calls == 0


def test_compiled_image_slots_pad_states_and_mask(runtime, exported):
    """A language program compiled for 3 image slots: one image is padded with states no token sees."""
    manifest = exported(FAMILY) / "lang" / "model.onnx"
    rows = get_family(FAMILY).states_per_image(describe_checkpoint(helpers_dir(runtime.processor)))
    common = {"batch_size": 1, "ctx_len": CTX_LEN, "max_num_images": 3, "cross_states": 3 * rows}
    language = OnnxProgram(manifest, [{**common, "seq_len": 16}, {**common, "seq_len": 1}])
    generator = runtime.generator([16])
    generator = CrossAttentionGenerator(
        runtime.checkpoint, runtime.vision, language, generator.shape, cross_mask_shape=(1, 1, 1, 4)
    )
    processed = runtime.inputs(["<image>", "Describe this image."], [helpers.image(100, 150, 7)])
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, "one image in three compiled slots")
    four = [helpers.image(60 + 10 * i, 90, i) for i in range(4)]
    too_many = runtime.inputs(["<image>"] * 4 + ["Compare."], four)
    with pytest.raises(UserError, match="compiled for at most 3"):
        generator.generate(too_many, max_new_tokens=2)
