"""Qwen3-VL-MoE: the experts export in the routed form (no routing-dependent shapes) and chunked generation is
token-identical to transformers generate (images: tests/test_qwen3_vl.py runs its generation tests
for both families; a clip here); the tiny checkpoint stores its experts in the published
[experts, in, out] layout, which the streaming export swaps exactly as transformers' loader does.

The tiny checkpoint is Qwen3-VL's (deepstack, interpolated positions, 16-pixel patches) with layer 0
a 4-expert top-2 sparse block and layer 1 a dense MLP.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors import safe_open

from qeff_vision import symbols
from qeff_vision.export_record import read_export
from qeff_vision.families import family_for
from qeff_vision.families.base import describe_checkpoint
from qeff_vision.families.qwen3_vl import NUM_FEATURE_LAYERS
from qeff_vision.media import Clip
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime

FAMILY = "qwen3_vl_moe"
SPECS = Path(__file__).resolve().parent.parent / "specs"


def test_pinned_30b_a3b_spec_specializations():
    spec = load_spec(SPECS / "qwen3_vl_moe" / "qwen3_vl_moe-30b-a3b-instruct.yaml")
    assert family_for(describe_checkpoint(SPECS / "configs" / "Qwen3-VL-30B-A3B-Instruct")).name == FAMILY
    result = build_specializations(spec)
    assert [s.symbols[symbols.VISION_SIZE] for s in result.vision.specializations] == ["187", "2040"]
    lang = [
        (s.name, s.symbols["seq_len"], s.symbols[symbols.VISION_SIZE])
        for s in result.language.specializations
    ]
    assert lang == [("Prefill-128", "128", "128"), ("Prefill-512", "512", "512"), ("Decode", "1", "512")]
    assert {s.symbols[NUM_FEATURE_LAYERS] for s in result.language.specializations} == {"3"}


def test_experts_stored_as_published_are_swapped_like_transformers(tiny_checkpoint, hf_model):
    model, _ = hf_model(FAMILY)
    experts = model.model.language_model.layers[0].mlp.experts
    with safe_open(str(tiny_checkpoint(FAMILY) / "model.safetensors"), "pt") as weights:
        stored = weights.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
    assert tuple(stored.shape) == (4, 64, 48) and tuple(experts.gate_up_proj.shape) == (4, 48, 64)
    assert np.array_equal(stored.transpose(1, 2).numpy(), experts.gate_up_proj.detach().numpy())


def test_language_graph_gathers_experts_without_routing_dependent_shapes(exported):
    manifest = read_export(exported(FAMILY))
    graph = onnx.load(
        str(exported(FAMILY) / manifest["programs"]["lang"]["path"]), load_external_data=False
    ).graph
    ops = {node.op_type for node in graph.node}
    assert "TopK" in ops and not ops & {"NonZero", "Loop", "If"}
    # Each stacked expert tensor is read through one Gather on axis 0 (tests/test_moe_routing.py counts).
    gathered = {node.input[0] for node in graph.node if node.op_type == "Gather"}
    experts = {init.name for init in graph.initializer if "experts" in init.name}
    assert len(experts) == 2 and experts <= gathered


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return FamilyRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


def test_clip_straddling_chunks(runtime):
    """An 8-frame clip (4 timestamped placeholder runs) over chunks of 32: tokens as transformers."""
    clip = Clip([helpers.image(112, 140, seed) for seed in range(8)], 2.0, "clip")
    chat = Conversation(runtime.generator([32, 64]), runtime.processor, max_new_tokens=NEW_TOKENS)
    result = chat.ask([], "What happens in the video?", videos=[clip], keep_logits=True)
    runtime.check(result, chat.last_inputs.processed, "qwen3_vl_moe clip")
    assert len([chunk for chunk in result.chunks if chunk.rows]) >= 2
