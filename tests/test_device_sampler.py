"""On-device sampling (issue 40): QEfficient's sampler IO on every family, and its tokens.

* IO: every registered family's language program exported with the sampler has QEfficient's
  sampler inputs and outputs (names, order, dtypes, shapes; read from the exported graph), with
  and without continuous batching.
* Temperature 0 under continuous batching: the program's ``next_tokens`` equal transformers'
  greedy ``generate`` run alone on each request, every step, whichever slot it runs in.
* Sampled: the same random numbers give the compiled sampler's token and the host's
  (:class:`~qeff_vision.runtime.device_sampler.GumbelMaxSampler`, fed the plain program's logits)
  on every step, with repetition and presence penalties, top-k, top-p and min-p in use.
* A reused slot's penalty buffers hold nothing of its previous request; another slot's prefill
  leaves a running request's buffers alone.

The token checks run the sampler program beside the same checkpoint's plain continuous-batching
export (tests/sampler_harness.py), both on onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.contract.sampler_io import (
    NEXT_TOKENS,
    PRESENCE_BUFFER,
    PROBS,
    RANDOM_NUMBERS,
    REPETITION_BUFFER,
    SamplerOptions,
)
from qeff_vision.export_record import read_export
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers
from tests.cb_harness import SlotProgram, SlotSequence, decode_step_feeds, prefill_into_slot, prefill_shape
from tests.gumbel_max import GumbelMaxSampler
from tests.sampler_harness import LockstepSlots

FAMILIES = [f.name for f in all_families()]
CB_FAMILIES = [f.name for f in all_families() if f.features.continuous_batching.supported]
TOKEN_MERGE_CB = [f.name for f in all_families() if f.name in CB_FAMILIES and f.decoder_kind == TOKEN_MERGE]
FULL_BATCH_SIZE = 4
NEW_TOKENS = 6
# Below every tiny vocabulary; QEfficient's 512 needs a real one.
OPTIONS = SamplerOptions(max_top_k_ids=32)

# QEfficient's sampler IO (pinned quic/efficient-transformers ebf55e8, utils/sampler_utils.py
# get_sampling_inputs_and_outputs): name, dtype, shape; SLOTS is the penalty buffers' slot axis,
# VOCAB the vocabulary, TOP_K max_top_k_ids.
SLOTS, VOCAB, TOP_K = "<slots>", "<vocab>", "<max_top_k_ids>"
QEFFICIENT_INPUTS = [
    ("last_accepted_output_tokens", "int64", ["batch_size", "seq_len"]),
    ("past_repetition_penalty_buffer", "bool", [SLOTS, VOCAB]),
    ("repetition_penalties", "float32", ["batch_size", 1]),
    ("past_presence_penalty_buffer", "bool", [SLOTS, VOCAB]),
    ("presence_penalties", "float32", ["batch_size", 1]),
    ("temperatures", "float32", ["batch_size", 1]),
    ("top_ks", "int32", ["batch_size", 1]),
    ("top_ps", "float32", ["batch_size", 1]),
    ("min_ps", "float32", ["batch_size", 1]),
    ("random_numbers", "float32", ["batch_size", TOP_K]),
]
QEFFICIENT_BUFFER_OUTPUTS = [
    "past_repetition_penalty_buffer_RetainedState",
    "past_presence_penalty_buffer_RetainedState",
]


@pytest.fixture(scope="module")
def sampler_exported(tiny_checkpoint, tmp_path_factory):
    """``sampler_exported(family, cb=True, options=OPTIONS) -> Path``: the export with the sampler."""
    built = {}

    def build(family: str, cb: bool = True, options: SamplerOptions = OPTIONS):
        key = (family, cb, options)
        if key not in built:
            from qeff_vision.exporter import export_model

            out = tmp_path_factory.mktemp(f"sampler-{family}") / "export"
            export_model(tiny_checkpoint(family), out, continuous_batching=cb, sampler=options, progress=None)
            built[key] = out
        return built[key]

    return build


def _graph_io(export_dir):
    manifest = read_export(export_dir)
    graph = onnx.load(str(export_dir / "lang" / "model.onnx"), load_external_data=False).graph
    lang = manifest["programs"]["lang"]
    inputs = [(v.name, lang["inputs"][v.name]) for v in graph.input if v.name in lang["inputs"]]
    outputs = [(v.name, lang["outputs"][v.name]) for v in graph.output]
    return manifest, inputs, outputs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cb", [True, False], ids=["cb", "batch"])
def test_sampler_io_is_qefficients(family, cb, sampler_exported, exported, cb_exported):
    """QEfficient's names, order, dtypes and shapes; the rest of the IO is the plain program's."""
    if cb and family not in CB_FAMILIES:
        pytest.skip(f"{family} has no continuous batching")
    manifest, inputs, outputs = _graph_io(sampler_exported(family, cb))
    _, plain_inputs, plain_outputs = _graph_io(cb_exported(family) if cb else exported(family))
    vocab = Checkpoint.open(manifest["model"], family).dims.vocab_size
    bind = {
        SLOTS: symbols.FULL_BATCH_SIZE if cb else symbols.BATCH_SIZE,
        VOCAB: vocab,
        TOP_K: OPTIONS.max_top_k_ids,
    }
    expected = [(name, dtype, [bind.get(d, d) for d in shape]) for name, dtype, shape in QEFFICIENT_INPUTS]
    # QEfficient appends the sampler's inputs after every other input, in this order.
    assert [name for name, _ in inputs] == [name for name, _ in plain_inputs] + [n for n, _, _ in expected]
    described = dict(inputs)
    for name, dtype, shape in expected:
        assert (described[name]["dtype"], described[name]["shape"]) == (dtype, shape), name
    # next_tokens [batch, 1, 1] int64 where logits was; the buffers' retained states last.
    plain_names = [name for name, _ in plain_outputs]
    names = [name for name, _ in outputs]
    logits_at = plain_names.index(symbols.LOGITS)
    assert (
        names
        == plain_names[:logits_at] + [NEXT_TOKENS] + plain_names[logits_at + 1 :] + QEFFICIENT_BUFFER_OUTPUTS
    )
    described_out = dict(outputs)
    assert (described_out[NEXT_TOKENS]["dtype"], described_out[NEXT_TOKENS]["shape"]) == (
        "int64",
        ["batch_size", 1, 1],
    )
    for name in QEFFICIENT_BUFFER_OUTPUTS:
        assert (described_out[name]["dtype"], described_out[name]["shape"]) == ("bool", [bind[SLOTS], vocab])
    assert manifest["sampler"] == OPTIONS.to_dict()


def test_return_pdfs_and_guided_decoding_add_qefficients_rows(sampler_exported):
    """``probs`` [batch, 1, vocab] float32 just before ``next_tokens``; ``token_bitmasks`` bool last."""
    options = SamplerOptions(max_top_k_ids=8, return_pdfs=True, guided_decoding=True)
    manifest, inputs, outputs = _graph_io(sampler_exported("llava", True, options))
    vocab = Checkpoint.open(manifest["model"], "llava").dims.vocab_size
    assert inputs[-1] == (
        "token_bitmasks",
        {"dtype": "bool", "shape": ["batch_size", vocab], "axes": {"0": "batch_size"}},
    )
    names = [name for name, _ in outputs]
    assert names[:2] == [PROBS, NEXT_TOKENS]
    assert dict(outputs)[PROBS]["dtype"] == "float32" and dict(outputs)[PROBS]["shape"] == [
        "batch_size",
        1,
        vocab,
    ]


def _lockstep(family, cb_exported, sampler_exported, lengths):
    """(generator factory for a slot, the lockstep slots) over the plain and the sampler exports."""
    plain_dir, sampled_dir = cb_exported(family), sampler_exported(family)
    manifest = read_export(plain_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    vision = OnnxProgram(plain_dir / manifest["programs"]["vision"]["path"])
    plain = OnnxProgram(plain_dir / "lang" / "model.onnx")
    sampled = OnnxProgram(sampled_dir / "lang" / "model.onnx")
    shape = prefill_shape(lengths, NEW_TOKENS)
    slots = None

    def in_slot(slot: int) -> Generator:
        nonlocal slots
        generator = Generator(checkpoint, vision, plain, shape)
        slots = slots or LockstepSlots(generator, FULL_BATCH_SIZE, sampled, OPTIONS)
        generator.language = SlotProgram(plain, slots, slot)
        return generator

    first = in_slot(0)
    return in_slot, slots, plain, first


def _requests(processor):
    return {
        "previous": helpers.process(
            processor, helpers.user_turn("Tell me a long story about a dragon, a castle and the sea."), []
        ),
        "image": helpers.process(
            processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
        ),
        "text": helpers.process(processor, helpers.user_turn("Hi there"), []),
    }


def _prefill(in_slot, slots, processed, slot, params, hosts=None) -> SlotSequence:
    """Prefill into ``slot`` for a request with ``params``; the first token is the device's."""
    slots.device.admit(slot, params)
    slots.penalties.reset(slot)
    sequence = prefill_into_slot(in_slot(slot), processed, slot, NEW_TOKENS)
    if hosts is not None:
        vocab = slots.penalties.buffers[REPETITION_BUFFER].shape[1]
        host = hosts[slot] = GumbelMaxSampler(params, processed["input_ids"], vocab, OPTIONS.max_top_k_ids)
        assert slots.last_tokens[0] == host.next_token(
            sequence.logits[0], slots.last_feeds[RANDOM_NUMBERS][0]
        )
        host.accept(int(slots.last_tokens[0]))
    sequence.tokens[0] = int(slots.last_tokens[0])
    return sequence


def _decode(generator, plain, slots, running, hosts=None) -> int:
    """Decode every running sequence on the device's tokens; checks each against its host sampler."""
    steps = 0
    for sequence in running:
        sequence.done = len(sequence.tokens) >= sequence.budget
    while not all(sequence.done for sequence in running):
        feeds = decode_step_feeds(generator, running, FULL_BATCH_SIZE)
        outputs = slots.run(plain, feeds, np.arange(FULL_BATCH_SIZE).reshape(-1, 1))
        steps += 1
        for sequence in running:
            if sequence.done:
                continue
            logits = outputs[symbols.LOGITS][sequence.slot, -1]
            token = int(outputs[NEXT_TOKENS][sequence.slot, -1, 0])
            if hosts is not None:
                host = hosts[sequence.slot]
                draws = slots.last_feeds[RANDOM_NUMBERS][sequence.slot]
                assert token == host.next_token(logits, draws), (
                    f"slot {sequence.slot} step {len(sequence.tokens)}"
                )
                host.accept(token)
            sequence.logits.append(logits.copy())
            sequence.tokens.append(token)
            sequence.done = len(sequence.tokens) >= sequence.budget
    return steps


@pytest.mark.parametrize("family", TOKEN_MERGE_CB)
def test_temperature_zero_under_cb_equals_transformers_greedy(
    family, cb_exported, sampler_exported, hf_model
):
    """The device's tokens equal generate's, every step, for requests in a reused slot and another."""
    model, processor = hf_model(family)
    requests = _requests(processor)
    processed = {name: helpers.as_numpy(inputs) for name, inputs in requests.items()}
    in_slot, slots, plain, first = _lockstep(
        family, cb_exported, sampler_exported, [p["input_ids"].shape[1] for p in processed.values()]
    )
    greedy = SamplingParams()
    previous = _prefill(in_slot, slots, processed["previous"], 0, greedy)
    _decode(first, plain, slots, [previous])
    image = _prefill(in_slot, slots, processed["image"], 2, greedy)
    text = _prefill(in_slot, slots, processed["text"], 0, greedy)
    assert _decode(first, plain, slots, [image, text]) >= 1
    for name, sequence in (("image", image), ("text", text)):
        tokens, _ = helpers.hf_generate(model, requests[name], NEW_TOKENS)
        # generate stops at an end-of-sequence token; the device's decode here runs its budget.
        assert sequence.tokens[: len(tokens)] == tokens, f"{family} {name} (slot {sequence.slot})"


# Each request exercises a different part of the sampler; together every part is in use.
SAMPLED = {
    "image": SamplingParams(temperature=0.9, top_k=5, top_p=0.8, repetition_penalty=1.4, seed=7),
    "text": SamplingParams(
        temperature=1.3, min_p=0.15, presence_penalty=0.8, repetition_penalty=0.8, seed=11
    ),
}


@pytest.mark.parametrize("family", TOKEN_MERGE_CB)
def test_sampled_tokens_equal_the_host_samplers_on_every_step(
    family, cb_exported, sampler_exported, hf_model
):
    """Same logits, same random numbers: the compiled sampler's token is the host sampler's."""
    _, processor = hf_model(family)
    processed = {name: helpers.as_numpy(inputs) for name, inputs in _requests(processor).items()}
    in_slot, slots, plain, first = _lockstep(
        family, cb_exported, sampler_exported, [p["input_ids"].shape[1] for p in processed.values()]
    )
    hosts = {}
    previous = _prefill(
        in_slot, slots, processed["previous"], 0, SamplingParams(temperature=1.0, seed=3), hosts
    )
    _decode(first, plain, slots, [previous], hosts)
    image = _prefill(in_slot, slots, processed["image"], 2, SAMPLED["image"], hosts)
    text = _prefill(in_slot, slots, processed["text"], 0, SAMPLED["text"], hosts)
    _decode(first, plain, slots, [image, text], hosts)
    # The draws were used: some token is not the argmax of its (penalized) logits.
    drawn = [t != int(np.argmax(row)) for s in (image, text) for t, row in zip(s.tokens, s.logits)]
    assert any(drawn), f"{family}: every sampled token was the argmax; the test exercised no draw"


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_reused_slot_keeps_nothing_of_its_previous_request(family, cb_exported, sampler_exported, hf_model):
    """After the next prompt's first chunk, its slot's buffers hold its prompt only; others untouched."""
    _, processor = hf_model(family)
    processed = {name: helpers.as_numpy(inputs) for name, inputs in _requests(processor).items()}
    in_slot, slots, plain, first = _lockstep(
        family, cb_exported, sampler_exported, [p["input_ids"].shape[1] for p in processed.values()]
    )
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, seed=1)
    previous = _prefill(in_slot, slots, processed["previous"], 0, params)
    image = _prefill(in_slot, slots, processed["image"], 2, params)
    _decode(first, plain, slots, [previous, image])
    running = {name: buffer[2].copy() for name, buffer in slots.penalties.buffers.items()}
    assert running[PRESENCE_BUFFER].any()  # slot 2 has generated tokens
    # The device never sees the host's reset: put the previous request's marks back, so only the
    # program's own lifecycle (a prompt starting at position 0) can clear them.
    slots.device.admit(0, params)
    prefill_into_slot(in_slot(0), processed["text"], 0, NEW_TOKENS)
    buffers = slots.penalties.buffers
    prompt = np.zeros(buffers[REPETITION_BUFFER].shape[1], dtype=bool)
    prompt[processed["text"]["input_ids"].reshape(-1)] = True
    np.testing.assert_array_equal(buffers[REPETITION_BUFFER][0], prompt)
    assert not buffers[PRESENCE_BUFFER][0].any()
    for name, row in running.items():
        np.testing.assert_array_equal(buffers[name][2], row, err_msg=f"{name}: slot 2 changed")
