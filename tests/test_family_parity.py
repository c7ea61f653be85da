"""Three-stage parity for every registered family on its tiny checkpoint.

transformers torch (reference) vs our export-patched torch modules vs onnxruntime on the exported
graphs. Parametrized over the registry, so a new family is tested by adding it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision import symbols
from qeff_vision.contract.language_io import SLOT_ROLES
from qeff_vision.export.decoder import LanguageDecoder
from qeff_vision.exporter import example_values, load_adapter
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE as TOKEN_MERGE_KIND
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

FAMILIES = [family.name for family in all_families()]
# The vision-embedding and patched-decoder stages below are those of the token-merge kind; the
# cross-attention kind's (vision K/V, cross decoder) are in tests/test_mllama.py.
TOKEN_MERGE = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE_KIND]
VISION_TOLERANCE = 1e-4
LOGIT_TOLERANCE = 1e-3


@pytest.mark.parametrize("family", TOKEN_MERGE)
def test_vision_three_stage_parity(family, hf_model, exported):
    """HF tower vs patched torch encoder vs onnxruntime, one graph, several resolutions."""
    model, processor = hf_model(family)
    adapter = load_adapter(all_families()[FAMILIES.index(family)])
    encoder = adapter.vision_encoder(model)
    program = OnnxProgram(exported(family) / "vision" / "model.onnx")
    for seed, (height, width) in enumerate(adapter.test_image_sizes):
        processed = processor.image_processor(
            images=[helpers.image(height, width, seed)], return_tensors="pt"
        )
        reference = adapter.hf_image_features(model, processed)[0].numpy()
        host = helpers.host(model, family)
        inputs = host.vision_inputs(helpers.as_numpy(processed))[0]
        with torch.no_grad():
            outputs = encoder(*[torch.as_tensor(v) for v in inputs.values()])
        # A tower with several outputs (Qwen3-VL adds deepstack_features) lists vision_embeds first.
        patched = (outputs[0] if isinstance(outputs, tuple) else outputs)[0].numpy()
        onnx = program.run(inputs)["vision_embeds"][0]
        assert patched.shape == onnx.shape
        # A fixed-length output (LLaVA-NeXT) pads the image's own rows with zeros.
        own = host.own_rows(inputs)
        if own is not None:
            assert not onnx[own:].any() and not patched[own:].any()
            patched, onnx = patched[:own], onnx[:own]
        assert patched.shape == reference.shape == onnx.shape
        assert np.abs(patched - reference).max() <= VISION_TOLERANCE, (height, width)
        assert np.abs(onnx - reference).max() <= VISION_TOLERANCE, (height, width)


@pytest.mark.parametrize("family", FAMILIES)
def test_language_one_chunk_then_decode_matches_generate(family, hf_model, exported):
    """One image, prefill in one chunk, 8 greedy decode steps through our KV cache on onnxruntime."""
    model, processor = hf_model(family)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=9)
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)  # one chunk, with tail padding
    generator = generator_for_export(
        exported(family), LanguageShape((bucket,), bucket.vision_size, length + 64)
    )
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=9, keep_logits=True)
    assert len(result.chunks) == 1
    assert result.tokens == hf_tokens
    worst = max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, hf_logits))
    assert worst <= LOGIT_TOLERANCE


@pytest.mark.parametrize("family", TOKEN_MERGE)
def test_patched_language_decoder_matches_transformers(family, hf_model):
    """The export-patched torch decoder (retained-state cache, position masks) vs HF's forward."""
    model, processor = hf_model(family)
    adapter = load_adapter(all_families()[FAMILIES.index(family)])
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(90, 120, 3)])
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    numpy_inputs = helpers.as_numpy(inputs)
    features = torch.cat(adapter.hf_image_features(model, inputs)).unsqueeze(0)
    # Stacked row inputs (Qwen3-VL's deepstack_features) follow vision_embeds: [depth, 1, rows, hidden].
    stacked = [
        torch.cat(rows, dim=1).unsqueeze(1) for rows in adapter.hf_stacked_rows(model, inputs).values()
    ]
    parts = adapter.decoder_parts(model)
    io = adapter.family.language_table(_description(model))
    decoder = LanguageDecoder(parts, io).eval()
    length = inputs["input_ids"].shape[1]
    # Zero caches of every layer, shaped by the table (window layers keep their ring length).
    values = {
        **example_values(adapter.family, _description(model)),
        symbols.CTX_LEN: length + 8,
        symbols.SLIDING_WINDOW: length + 8,
    }
    past = [torch.zeros(row.concrete_shape(values)) for row in io.rows(*SLOT_ROLES)]
    positions = torch.as_tensor(helpers.host(model, family).prompt_positions(numpy_inputs))
    with torch.no_grad():
        logits = decoder(
            inputs["input_ids"], positions, features, *stacked, torch.zeros(1, 1, dtype=torch.int64), *past
        )[0]
    assert np.abs(logits[0, -1].numpy() - reference).max() <= LOGIT_TOLERANCE


def _description(model):
    from qeff_vision.families.base import ModelDescription

    return ModelDescription(model.config.to_dict())
