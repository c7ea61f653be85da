"""Attention in blocks is what the graphs compute, exactly, for every family (issue 54).

Each family's tiny checkpoint is exported twice: unblocked (one block per attention, the graphs
before blocking) and with small blocks forced (3 query blocks in the vision towers, 3 key blocks
with the online softmax in the language program), so the blocked path is the one under test even
at tiny sizes. Both graphs run on onnxruntime at fp32 on the same processor inputs: the vision
embeddings and the language logits agree within 1e-5 of their range and the greedy tokens are the
same. Registry-parametrized; every family must be classified as a full-attention tower (its vision
graph gains blocks) or a per-tile one (bounded by the tile, unchanged).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision.contract.attention_blocking import UNBLOCKED, AttentionBlocking
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

FAMILIES = [family.name for family in all_families()]
# Towers whose attention is blocked in the export: patches attend to a whole image (or clip), or
# to a tile so large (Gemma 3's 4,096 patches), tiles so many (InternVL's 13, Molmo2's 16 video
# frames) or all tiles at once (mllama) that the scores pass 256 MiB.
FULL_ATTENTION = {
    "gemma3",
    "internvl",
    "mllama",
    "molmo2",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "kimi_k25",
    "mistral3",
    "gemma4",
}
# Towers bounded by a tile of fixed size and their tile count (under 256 MiB at real widths).
PER_TILE = {"llava", "llava_next", "llama4"}
FORCED = AttentionBlocking(vision_blocks=3, language_blocks=3)
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def exports(tiny_checkpoint, tmp_path_factory):
    """``exports(family) -> (unblocked dir, blocked dir)``, built once per module."""
    from qeff_vision.exporter import export_model

    built: dict[str, tuple] = {}

    def build(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(f"blocked-{family}")
            pair = []
            for name, policy in (("unblocked", UNBLOCKED), ("blocked", FORCED)):
                export_model(tiny_checkpoint(family), root / name, progress=None, attention_blocking=policy)
                pair.append(root / name)
            built[family] = tuple(pair)
        return built[family]

    return build


def _ops(path, op: str) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(node.op_type == op for node in model.graph.node)


def _close(ours: np.ndarray, reference: np.ndarray) -> float:
    """Largest deviation relative to the reference's range."""
    span = float(reference.max() - reference.min()) or 1.0
    return float(np.abs(ours - reference).max()) / span


def test_every_family_is_classified():
    assert FULL_ATTENTION | PER_TILE == set(FAMILIES) and not FULL_ATTENTION & PER_TILE


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_blocked_graphs_compute_the_unblocked_result(family, exports, hf_model):
    unblocked, blocked = exports(family)
    vision = [directory / "vision" / "model.onnx" for directory in (unblocked, blocked)]
    lang = [directory / "lang" / "model.onnx" for directory in (unblocked, blocked)]
    # The forced blocks are in the graphs: three query blocks per whole-image attention (window
    # attention, already small, stays whole), key blocks (ReduceMax of the online softmax instead
    # of Softmax) in every language attention.
    if family in FULL_ATTENTION:
        assert _ops(vision[1], "Softmax") > _ops(vision[0], "Softmax") > 0
    else:
        assert _ops(vision[1], "Softmax") == _ops(vision[0], "Softmax")
    assert _ops(lang[1], "Softmax") < _ops(lang[0], "Softmax")
    assert _ops(lang[1], "ReduceMax") > _ops(lang[0], "ReduceMax")

    model, processor = hf_model(family)
    family_obj = all_families()[FAMILIES.index(family)]
    if family_obj.decoder_kind == TOKEN_MERGE:
        adapter_sizes = family_obj.adapter().test_image_sizes
        for seed, (height, width) in enumerate(adapter_sizes):
            processed = processor.image_processor(
                images=[helpers.image(height, width, seed)], return_tensors="pt"
            )
            inputs = helpers.host(model, family).vision_inputs(helpers.as_numpy(processed))[0]
            whole, parts = (OnnxProgram(path).run(inputs)["vision_embeds"] for path in vision)
            assert _close(parts, whole) <= RELATIVE, (height, width)

    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    results = [
        generator_for_export(directory, LanguageShape((bucket,), bucket.vision_size, length + 64)).generate(
            helpers.as_numpy(inputs), max_new_tokens=6, keep_logits=True
        )
        for directory in (unblocked, blocked)
    ]
    assert results[1].tokens == results[0].tokens
    for ours, reference in zip(results[1].logits, results[0].logits):
        assert _close(ours, reference) <= RELATIVE


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_blocked_graphs_at_device_precision(family, exports, hf_model):
    """The forced-block graphs emulated at fp16 (with their automatic plan) track the fp32 unblocked
    logits within 1e-2 of the range, finite, tokens equal wherever the fp32 top-2 margin exceeds
    twice the deviation (tests/test_device_precision_families.py's criterion)."""
    from tests.test_device_precision_families import RELATIVE_TOLERANCE, _plans

    unblocked, blocked = exports(family)
    _, processor = hf_model(family)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)
    reference = generator_for_export(unblocked, shape).generate(
        helpers.as_numpy(inputs), max_new_tokens=6, keep_logits=True
    )
    plans, _ = _plans(blocked, length + 3)
    device = generator_for_export(blocked, shape, fp32_values=plans).generate(
        helpers.as_numpy(inputs), max_new_tokens=6, keep_logits=True
    )
    for step, (ours, ref) in enumerate(zip(device.logits, reference.logits)):
        assert np.isfinite(ours).all()
        deviation = np.abs(ours - ref).max()
        assert deviation <= RELATIVE_TOLERANCE * (ref.max() - ref.min()), (step, deviation)
        top = np.sort(ref.reshape(-1))[-2:]
        if top[1] - top[0] > 2 * deviation:
            assert device.tokens[step] == reference.tokens[step], step
        if device.tokens[step] != reference.tokens[step]:
            break
