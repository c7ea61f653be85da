"""The device-runtime stand-in (tests/device_double) over a ``compile --backend onnxruntime`` OUT.

The stand-in is what the opt-in vLLM tier (tests/vllm_tier) serves through; here it is driven the
way the vllm-qaic plugin drives the device (``qaic_session_np.py`` / ``qaic.py``), without vLLM:
IO descriptor with allowed shapes, strict shape matching, outputs filled in place, prefill chunks
padded with input_ids / position_ids -1, each chunk's image rows zero-padded to the compiled
``vision_size`` with ``image_idx`` 0, decode rows of idle slots sent with ``batch_index`` -1.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests import helpers

FAMILY = "llava"
SEQ_LEN = 8  # the tiny LLaVA image is 16 rows: it spans at least two chunks
SLOTS = 2
NEW_TOKENS = 4
DOUBLE = Path(__file__).with_name("device_double")


@pytest.fixture
def rt(monkeypatch):
    """(qaicrt, QAicApi_pb2) of the stand-in for one test."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    for name in ("qaicrt", "QAicApi_pb2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    modules = importlib.import_module("qaicrt"), importlib.import_module("QAicApi_pb2")
    yield modules
    for name in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_checkpoint):
    """A continuous-batching tiny LLaVA compiled for onnxruntime: one 8-token bucket, 2 KV slots."""
    from qeff_vision import api

    root = tmp_path_factory.mktemp("stand-in-out")
    spec = {
        "name": "stand-in",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 128,
        "full_batch_size": SLOTS,
        "prefill": {"seq_lens": [SEQ_LEN]},
        "vision": {"images": [{"height": 336, "width": 336}], "vision_size": "chunk"},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(root / "spec.yaml", root / "out", backend="onnxruntime", progress=None)
    return root / "out"


class Session:
    """The plugin's use of one program: descriptor, bindings, ``setData`` of (index, array) pairs."""

    def __init__(self, rt, directory: Path):
        self.qaicrt, aicapi = rt
        qpc = self.qaicrt.Qpc(str(directory))
        status, raw = qpc.getIoDescriptor()
        assert status == self.qaicrt.QStatus.QS_SUCCESS
        self.desc = aicapi.IoDesc()
        self.desc.ParseFromString(bytes(raw))
        self.bindings = {b.name: b for b in self.desc.selected_set.bindings}
        dtypes = {
            aicapi.FLOAT_TYPE: np.float32,
            aicapi.FLOAT_16_TYPE: np.float16,
            aicapi.INT64_I_TYPE: np.int64,
        }
        self.dtype = {name: np.dtype(dtypes[b.type]) for name, b in self.bindings.items()}
        context = self.qaicrt.Context()
        self.queue = self.qaicrt.Queue(context, 0)
        program = self.qaicrt.Program(context, None, qpc, self.qaicrt.QAicProgramProperties())
        assert program.load() == self.qaicrt.QStatus.QS_SUCCESS
        program.activate()
        self.exec = self.qaicrt.ExecObj(context, program)

    def run(self, buffers: dict[str, np.ndarray]):
        pairs = [(self.bindings[name].index, np.ascontiguousarray(array)) for name, array in buffers.items()]
        assert self.exec.setData(pairs) == self.qaicrt.QStatus.QS_SUCCESS
        assert self.queue.enqueue(self.exec) == self.qaicrt.QStatus.QS_SUCCESS
        return self.exec.waitForCompletion()


def test_descriptor_comes_from_the_program_files(rt, out):
    _, aicapi = rt
    language = Session(rt, out / "lang")
    names = set(language.bindings)
    assert {"input_ids", "position_ids", "vision_embeds", "image_idx", "batch_index", "logits"} <= names
    assert {"past_key.0", "past_key.0_RetainedState"} <= names
    # custom_io.yaml: KV and vision_embeds in fp16 on the device; ids int64; logits fp32.
    assert language.bindings["vision_embeds"].type == aicapi.FLOAT_16_TYPE
    assert language.bindings["past_value.1_RetainedState"].type == aicapi.FLOAT_16_TYPE
    assert language.bindings["input_ids"].type == aicapi.INT64_I_TYPE
    assert language.bindings["logits"].type == aicapi.FLOAT_TYPE
    # One allowed shape set per specialization (prefill 8, decode at full_batch_size).
    index = language.bindings["input_ids"].index
    assert [list(s.shapes[index].dims) for s in language.desc.allowed_shapes] == [[1, SEQ_LEN], [SLOTS, 1]]
    assert list(language.bindings["input_ids"].dims) == [1, SEQ_LEN]  # the selected set: the first
    assert list(language.bindings["vision_embeds"].dims)[1] == SEQ_LEN
    assert language.bindings["past_key.0"].is_partial_buf_allowed


def test_a_vision_size_no_specialization_allows_is_rejected(rt, out):
    qaicrt, _ = rt
    language = Session(rt, out / "lang")
    hidden = language.bindings["vision_embeds"].dims[2]
    vocab = language.bindings["logits"].dims[2]
    buffers = {
        "input_ids": np.zeros((1, SEQ_LEN), np.int64),
        "position_ids": np.arange(SEQ_LEN, dtype=np.int64)[None],
        "vision_embeds": np.zeros((1, 2 * SEQ_LEN, hidden), np.float16),  # compiled: SEQ_LEN rows
        "image_idx": np.zeros((1, 1), np.int64),
        "batch_index": np.zeros((1, 1), np.int64),
        "logits": np.empty((1, 1, vocab), np.float32),
    }
    assert language.run(buffers) == qaicrt.QStatus.QS_ERROR
    assert "No matching dimension found" in qaicrt.ERRORS[-1]
    assert f"vision_embeds=[1, {2 * SEQ_LEN}, {hidden}]" in qaicrt.ERRORS[-1]
    # The same call with the compiled vision_size runs; a float32 buffer for an fp16 binding does not.
    buffers["vision_embeds"] = np.zeros((1, SEQ_LEN, hidden), np.float16)
    assert language.run(buffers) == qaicrt.QStatus.QS_SUCCESS
    buffers["vision_embeds"] = np.zeros((1, SEQ_LEN, hidden), np.float32)
    assert language.run(buffers) == qaicrt.QStatus.QS_ERROR


def _prefill(language, ids, image_rows, image_token, slot, vocab):
    """The plugin's prefill of one request: -1 padding, per-chunk image rows, logits in place."""
    count = len(ids)
    padded = -np.ones(-(-count // SEQ_LEN) * SEQ_LEN, np.int64)
    padded[:count] = ids
    positions = -np.ones_like(padded)
    positions[:count] = np.arange(count)
    hidden = language.bindings["vision_embeds"].dims
    used = 0
    logits = np.empty((1, 1, vocab), np.float32)
    for start in range(0, len(padded), SEQ_LEN):
        chunk = padded[start : start + SEQ_LEN]
        buffers = {
            "input_ids": chunk[None],
            "position_ids": positions[start : start + SEQ_LEN][None],
            "image_idx": np.zeros((1, 1), np.int64),
            "batch_index": np.array([[slot]], np.int64),
            "logits": logits,
        }
        rows = int((chunk == image_token).sum())
        if rows:  # vision_embeds only on chunks with image rows, zero-padded to the binding
            embeds = np.zeros(list(hidden), np.float16)
            embeds[0, :rows] = image_rows[used : used + rows]
            buffers["vision_embeds"] = embeds
            used += rows
        assert language.run(buffers) == language.qaicrt.QStatus.QS_SUCCESS, language.qaicrt.ERRORS[-1:]
    assert used == len(image_rows)
    return int(logits[0, -1].argmax()), count


def test_plugin_style_serving_matches_transformers_with_idle_rows(rt, out, hf_model):
    """Two requests in two KV slots; the first decodes alone with the idle row at batch_index -1."""
    model, processor = hf_model(FAMILY)
    image = helpers.image(336, 336, seed=4)
    requests = [
        helpers.process(processor, helpers.user_turn("<image>", "Describe it."), [image]),
        helpers.process(processor, helpers.user_turn("<image>", "What is this?"), [image]),
    ]
    references = [helpers.hf_generate(model, r, NEW_TOKENS, eos_token_ids=[])[0] for r in requests]

    vision = Session(rt, out / "vision")
    pixels = requests[0]["pixel_values"].numpy().astype(vision.dtype["pixel_values"])
    embeds = np.empty(list(vision.bindings["vision_embeds"].dims), vision.dtype["vision_embeds"])
    assert vision.run({"pixel_values": pixels, "vision_embeds": embeds}) == rt[0].QStatus.QS_SUCCESS
    language = Session(rt, out / "lang")
    vocab = language.bindings["logits"].dims[2]
    image_token = model.config.image_token_index

    tokens, lengths = [], []
    for slot, processed in enumerate(requests):
        first, length = _prefill(
            language, processed["input_ids"][0].numpy(), embeds[0], image_token, slot, vocab
        )
        tokens.append([first])
        lengths.append(length)

    def decode(active):
        ids = -np.ones((SLOTS, 1), np.int64)
        positions = -np.ones((SLOTS, 1), np.int64)
        slots = -np.ones((SLOTS, 1), np.int64)
        for row, slot in enumerate(active):
            ids[row, 0], positions[row, 0], slots[row, 0] = tokens[slot][-1], lengths[slot], slot
        logits = np.empty((SLOTS, 1, vocab), np.float32)
        buffers = {"input_ids": ids, "position_ids": positions, "batch_index": slots, "logits": logits}
        buffers["image_idx"] = np.zeros((1, 1), np.int64)
        assert language.run(buffers) == language.qaicrt.QStatus.QS_SUCCESS, language.qaicrt.ERRORS[-1:]
        for row, slot in enumerate(active):
            tokens[slot].append(int(logits[row, 0].argmax()))
            lengths[slot] += 1

    decode([0])  # slot 1 waits: its row is idle (batch_index -1) and its cache must survive
    while len(tokens[1]) < NEW_TOKENS:
        decode([0, 1] if len(tokens[0]) < NEW_TOKENS else [1])
    assert [t[:NEW_TOKENS] for t in tokens] == references
