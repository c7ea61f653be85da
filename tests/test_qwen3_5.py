"""Qwen3.5: a hybrid decoder whose linear-attention layers keep conv and recurrent states.

The tiny checkpoint has layers linear, linear, full, linear (a linear layer before the first full
one) and 4 value heads over 2 key heads. Chunked generation must equal transformers generate
whatever the buckets (48: one partial 64-chunk of the gated delta rule; 160: three), across a
400-token prompt with two images and a text-only chunk between them, and for 200 decode steps.
The chunked tests run for Qwen3.5-MoE too, whose tiny checkpoint stores its experts per expert as
the published ones do (streaming export stacks them). The three-turn conversation and the
compile-and-run pipeline are the registry-wide harness's (tests/test_family_harness.py), three-stage
parity is tests/test_family_parity.py's.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.export.gated_delta import NAME as GATED_DELTA
from qeff_vision.export_record import read_export
from qeff_vision.families import get_family
from qeff_vision.families.base import describe_checkpoint
from qeff_vision.reference import reference_generate
from tests import helpers
from tests.family_runtime import FamilyRuntime, chunks_of_image

FAMILY = "qwen3_5"
LONG_TEXT = (
    "The first picture was taken in the morning, long before the second one, and the light is softer. "
)


@pytest.fixture(scope="module", params=[FAMILY, "qwen3_5_moe"])
def runtime(exported, hf_model, request):
    """Chunked generation of Qwen3.5 and of its MoE variant (same decoder layers, sparse MLPs)."""
    return FamilyRuntime(request.param, exported(request.param), *hf_model(request.param))


def test_language_program_has_state_rows_for_linear_layers(exported, tiny_checkpoint):
    manifest = read_export(exported(FAMILY))
    lang = manifest["programs"]["lang"]
    graph = onnx.load(str(exported(FAMILY) / lang["path"]), load_external_data=False)
    names = [value.name for value in graph.graph.input]
    assert names[:4] == [symbols.INPUT_IDS, symbols.POSITION_IDS, symbols.VISION_EMBEDS, symbols.IMAGE_IDX]
    assert names[4:12] == [
        "conv_state.0",
        "recurrent_state.0",
        "conv_state.1",
        "recurrent_state.1",
        "past_key.2",
        "past_value.2",
        "conv_state.3",
        "recurrent_state.3",
    ]
    dims = get_family(FAMILY).linear_attention(describe_checkpoint(tiny_checkpoint(FAMILY)))
    assert lang["inputs"]["conv_state.0"]["shape"] == ["batch_size", dims.conv_dim, dims.conv_kernel]
    assert lang["inputs"]["recurrent_state.3"]["shape"] == ["batch_size", 4, 16, 8]
    outputs = [value.name for value in graph.graph.output]
    assert "recurrent_state.3_RetainedState" in outputs
    # One GatedDeltaRule call per linear layer; its chunk loop is a Scan, not a traced unroll.
    calls = [node for node in graph.graph.node if node.op_type == GATED_DELTA]
    assert len(calls) == 3
    (function,) = [f for f in graph.functions if f.name == GATED_DELTA]
    assert [node.op_type for node in function.node].count("Scan") == 1


@pytest.mark.parametrize("seq_lens", [[48, 160], [48]])
def test_buckets_48_and_160_over_two_images_and_a_text_only_chunk(runtime, seq_lens):
    """A ~400-token prompt: image, 300 tokens of text, image, question; chunks of 48 and/or 160."""
    images = [helpers.image(224, 224, 3), helpers.image(300, 120, 4)]
    processed = runtime.inputs(["<image>", 3 * LONG_TEXT, "<image>", "What changed?"], images)
    assert 380 <= processed["input_ids"].shape[1] <= 440
    plan, result = runtime.run(processed, seq_lens)
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    between = plan.chunks[first[-1] + 1 : second[0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)
    assert {chunk.seq_len for chunk in plan.chunks} == {max(seq_lens)}  # the planner takes the largest
    assert result.tokens


@pytest.mark.parametrize("seq_lens", [[48], [160]])
def test_one_bucket_at_a_time(runtime, seq_lens):
    """Only 48-token chunks (never a whole 64-chunk), or only 160 (two whole and one partial)."""
    processed = runtime.inputs(["<image>", LONG_TEXT, "Describe."], [helpers.image(224, 224, 5)])
    plan, _ = runtime.run(processed, seq_lens)
    assert len(plan.chunks) == -(-plan.prompt_len // seq_lens[0]) > 1


def test_200_decode_steps_match_transformers(runtime):
    """Decode is the one-token recurrence: 200 steps after a chunked prefill stay token-identical."""
    processed = runtime.inputs(["<image>", "Tell me a long story."], [helpers.image(100, 150, 7)])
    generator = runtime.generator([48, 160])
    generator.eos_token_ids = set()  # run all 200 steps, as the reference does
    result = generator.generate(processed, max_new_tokens=200, keep_logits=True)
    tokens, logits = reference_generate(runtime.model, processed, 200, eos_token_ids=[])
    assert len(result.tokens) == 200
    assert result.tokens == tokens
    worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(result.logits, logits))
    assert worst <= 1e-3


def test_a_chunk_at_position_0_starts_from_zero_state(runtime):
    """Garbage in the retained states is ignored by a chunk whose first position is 0."""
    processed = runtime.inputs(["Hello there."], [])
    generator = runtime.generator([48])
    length = processed["input_ids"].shape[1]
    feeds = {
        symbols.INPUT_IDS: np.pad(processed["input_ids"], ((0, 0), (0, 48 - length))),
        symbols.POSITION_IDS: generator._positions(
            runtime.checkpoint.host.prompt_positions(processed), 0, length, 48
        ),
        symbols.IMAGE_IDX: np.zeros((1, 1), np.int64),
        **generator._vision_feeds_of_rows(np.zeros((1, 48, 64), np.float32)),
    }
    clean = generator.step(dict(feeds), generator.empty_cache())
    dirty_cache = {
        name: np.random.default_rng(0).standard_normal(value.shape).astype(np.float32)
        if not name.startswith("past_")
        else value
        for name, value in generator.empty_cache().items()
    }
    dirty = generator.step(dict(feeds), dirty_cache)
    np.testing.assert_array_equal(dirty[symbols.LOGITS], clean[symbols.LOGITS])
    for name in dirty_cache:
        if name.startswith(("conv_state", "recurrent_state")):
            np.testing.assert_array_equal(dirty[symbols.retained(name)], clean[symbols.retained(name)])


def test_per_expert_tensors_are_stacked_as_transformers_loads_them(tiny_checkpoint, hf_model):
    """Qwen3.5-MoE checkpoints store experts one by one; streaming export stacks them like transformers."""
    from qeff_vision.export.weight_sources import MergedSource, checkpoint_keys_for
    from qeff_vision.export.weights import Checkpoint

    model, _ = hf_model("qwen3_5_moe")
    checkpoint = Checkpoint(tiny_checkpoint("qwen3_5_moe"))
    sources = checkpoint_keys_for(model, checkpoint)
    params = dict(model.named_parameters())
    merged = [name for name, source in sources.items() if isinstance(source, MergedSource)]
    assert len(merged) == 2 * len(model.model.language_model.layers)  # gate_up_proj, down_proj
    for name in merged:
        values = sources[name].values(checkpoint.read, params[name].shape)
        assert torch.equal(values, params[name].detach()), name


def test_clip_straddling_chunks_matches_generate(runtime):
    """Video: an 8-frame clip (4 temporal patches as timestamped runs) split over 32-token chunks."""
    from tests.test_video import _ask, clip

    chat, (result,) = _ask(runtime, [32, 64], [([], [clip(8, 112, 140)], "What happens in the video?")])
    grid = chat.last_inputs.processed["video_grid_thw"][0]
    assert grid[0] == 4
    assert len([chunk for chunk in result.chunks if chunk.rows]) >= 2


def test_a_missing_delta_net_field_is_one_line_naming_it(tiny_checkpoint, tmp_path, capsys):
    """The Gated DeltaNet dimensions are read through the config view: a missing one is one line."""
    model = tmp_path / "model"
    model.mkdir()
    for name in tiny_checkpoint(FAMILY).iterdir():
        shutil.copy(name, model / name.name)
    config = model / "config.json"
    data = json.loads(config.read_text())
    del data["text_config"]["linear_key_head_dim"]
    config.write_text(json.dumps(data))
    assert main(["export", str(model), "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "config lacks required field 'text_config.linear_key_head_dim'" in err, err
    assert not (tmp_path / "out").exists()
