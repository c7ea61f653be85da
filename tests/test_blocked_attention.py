"""Attention in blocks is what the graphs compute, exactly, for every family (issue 54).

Each family's tiny checkpoint is exported twice: unblocked (one block per attention, the graphs
before blocking) and with small blocks forced (3 query blocks in the vision towers, 3 key blocks
with the online softmax in the language program), so the blocked path is the one under test even
at tiny sizes. Both graphs run on onnxruntime at fp32 on the same processor inputs: the vision
embeddings and the language logits agree within 1e-5 of their range and the greedy tokens are the
same. Registry-parametrized; every family must be classified as a full-attention tower (its vision
graph gains blocks) or a per-tile one (bounded by the tile, unchanged), as its `vision_attention`
declaration says; the forced policy also puts the experts of MoE families in blocks.
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
from qeff_vision.spec.activation_estimate import blocked_towers
from tests import helpers

FAMILIES = [family.name for family in all_families()]
# Towers whose attention is blocked in the export, as each family's ``vision_attention``
# declaration says (patches attend to a whole image or clip, or to a tile so large (Gemma 3's
# 4,096 patches), tiles so many (InternVL's 13, Molmo2's 16 frames) or all tiles at once (mllama)
# that the scores pass 256 MiB); the others are bounded by a tile of fixed size (LLaVA, Llama 4).
FULL_ATTENTION = set(blocked_towers())
PER_TILE = set(FAMILIES) - FULL_ATTENTION
FORCED = AttentionBlocking(vision_blocks=3, language_blocks=3, expert_blocks=3, expert_chunks=2)
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


def test_the_declarations_classify_the_towers():
    # Whole-image towers and the tiled ones whose scores pass the bound are blocked; the towers of
    # one small fixed tile are not (a regression guard on the declarations the lists come from).
    assert {"qwen2_5_vl", "qwen3_vl", "kimi_k25", "mistral3", "gemma4", "mllama"} <= FULL_ATTENTION
    assert {"llava", "llava_next", "llama4"} <= PER_TILE


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


# More query blocks than the smallest image has patches (the default policy gives Qwen2.5-VL 50
# blocks; the processors' smallest image has a handful of patches).
MANY = AttentionBlocking(vision_blocks=64)


def _zero_sized(graph, feeds) -> list[str]:
    """Values of ``graph`` with a zero-sized dimension at the shapes ``feeds`` bind."""
    from qeff_vision.compile.activation_memory import _specialized
    from qeff_vision.compile.weight_reads import _bind

    model = onnx.load(str(graph), load_external_data=False)
    values = {}
    for value in model.graph.input:
        for dim, size in zip(value.type.tensor_type.shape.dim, feeds[value.name].shape):
            if dim.dim_param:
                values[dim.dim_param] = int(size)
    _bind(model, values)
    return [name for name, (_, dims) in _specialized(model).items() if 0 in dims]


@pytest.mark.parametrize("family", helpers.tiered(sorted(FULL_ATTENTION), keep=("qwen2_5_vl", "gemma4")))
def test_an_image_smaller_than_the_block_count_has_no_empty_block(
    family, exports, hf_model, tiny_checkpoint, tmp_path
):
    """64 query blocks, an image of a few patches: every block non-empty, the unblocked embeddings."""
    from qeff_vision.exporter import export_model

    family_obj = all_families()[FAMILIES.index(family)]
    if family_obj.decoder_kind != TOKEN_MERGE:
        pytest.skip("cross-attention decoder: its tower's tiles are fixed-size (no small image)")
    unblocked, _ = exports(family)
    export_model(tiny_checkpoint(family), tmp_path, progress=None, attention_blocking=MANY)
    model, processor = hf_model(family)
    processed = processor.image_processor(images=[helpers.image(28, 28, 3)], return_tensors="pt")
    inputs = helpers.host(model, family).vision_inputs(helpers.as_numpy(processed))[0]
    graph = tmp_path / "vision" / "model.onnx"
    assert _ops(graph, "Softmax") > _ops(unblocked / "vision" / "model.onnx", "Softmax")
    assert _zero_sized(graph, inputs) == []
    whole = OnnxProgram(unblocked / "vision" / "model.onnx").run(inputs)["vision_embeds"]
    parts = OnnxProgram(graph).run(inputs)["vision_embeds"]
    assert _close(parts, whole) <= RELATIVE


# A 1280x720 image: thousands of patches even at tiny widths (Qwen2.5-VL's tiny tower: 4,600),
# so each of the forced blocks holds ~1,500 query rows, as a 1080p image does at real widths.
HIGH = (720, 1280)


@pytest.mark.parametrize("family", helpers.tiered(sorted(FULL_ATTENTION), keep=("qwen2_5_vl",)))
def test_blocked_graphs_at_a_high_resolution(family, exports, hf_model):
    """fp32: the same tokens, logits and image embeddings within 1e-5 of the range; device precision
    (fp16 emulated with the automatic plan): within the device tolerance, tokens equal wherever the
    fp32 margin allows (the criterion of :func:`test_blocked_graphs_at_device_precision`)."""
    from tests.test_device_precision_families import RELATIVE_TOLERANCE, _plans

    unblocked, blocked = exports(family)
    model, processor = hf_model(family)
    image = helpers.image(*HIGH, 11)
    family_obj = all_families()[FAMILIES.index(family)]
    if family_obj.decoder_kind == TOKEN_MERGE:
        processed = processor.image_processor(images=[image], return_tensors="pt")
        feeds = helpers.host(model, family).vision_inputs(helpers.as_numpy(processed))[0]
        whole, parts = (
            OnnxProgram(d / "vision" / "model.onnx").run(feeds)["vision_embeds"] for d in exports(family)
        )
        assert _close(parts, whole) <= RELATIVE
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Describe this image."), [image])
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)

    def generate(directory, plans=None):
        return generator_for_export(directory, shape, fp32_values=plans).generate(
            helpers.as_numpy(inputs), max_new_tokens=6, keep_logits=True
        )

    reference, ours = generate(unblocked), generate(blocked)
    assert ours.tokens == reference.tokens
    for step, (logits, ref) in enumerate(zip(ours.logits, reference.logits)):
        assert _close(logits, ref) <= RELATIVE, step
    device = generate(blocked, _plans(blocked, length + 3)[0])
    for step, (logits, ref) in enumerate(zip(device.logits, reference.logits)):
        assert np.isfinite(logits).all()
        deviation = np.abs(logits - ref).max()
        assert deviation <= RELATIVE_TOLERANCE * (ref.max() - ref.min()), (step, deviation)
        top = np.sort(ref.reshape(-1))[-2:]
        if top[1] - top[0] > 2 * deviation:
            assert device.tokens[step] == reference.tokens[step], step
        if device.tokens[step] != reference.tokens[step]:
            break
