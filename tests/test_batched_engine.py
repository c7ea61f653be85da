"""Batched engine, every family: five staggered requests through four KV slots match transformers alone.

The language program is each family's continuous-batching export (``batch_index``, caches with
``full_batch_size`` rows). Requests differ in images (none, one, two), resolutions and prompt
lengths, and arrive at staggered steps (0, 0, 1, 2, 3) so that the fifth takes the slot a finished
one freed: each request's tokens must equal transformers generate run alone on that request and
every step's logits must be within fp32 tolerance. A slot's previous occupant leaking into the
next (stale cache rows, a wrong ring position on Gemma 3's window layers) would move the fifth
request's logits. Decode steps are one call at batch 4 (idle slots at position -1).

This is also the "4 staggered requests under continuous batching" line of the Qwen3-VL, Mistral 3
and InternVL issues. Cost: the exports are the session's (shared with test_continuous_batching);
LLaVA and LLaVA-NeXT, whose decoders the others already cover, are ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision.contract.language_io import KV_ROLES, Role
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.in_place import aliasable
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers
from tests.family_runtime import LOGIT_TOLERANCE, NEW_TOKENS, FamilyRuntime

DEFAULT_TIER = ("qwen2_5_vl", "gemma3", "qwen3_vl", "qwen3_vl_moe", "mistral3", "internvl")
BATCHING = [
    name if name in DEFAULT_TIER else pytest.param(name, marks=pytest.mark.slow)
    for name in (f.name for f in all_families() if f.features.continuous_batching.supported)
    if get_family(name).decoder_kind == TOKEN_MERGE  # mllama through the engine: tests/test_mllama_cb.py
]
SLOTS = 4
SEQ_LENS = (32, 128)


def five_requests(runtime: FamilyRuntime) -> list[tuple[dict, int, int]]:
    """(processed, max_new_tokens, arrival_step) of five different requests; the fifth arrives last."""
    sizes = list(load_adapter(runtime.family).test_image_sizes)
    a, b, c = sizes[0], sizes[1 % len(sizes)], sizes[2 % len(sizes)]
    two = [helpers.image(*b, seed=2), helpers.image(*c, seed=3)]
    turns = [
        (("<image>", "Describe this image."), [helpers.image(*a, seed=1)], NEW_TOKENS, 0),
        (("<image>", "What is this?"), [helpers.image(*c, seed=4)], NEW_TOKENS - 2, 0),
        (("<image>", "<image>", "Compare."), two, NEW_TOKENS, 1),
        (("<image>", "And this one, in detail?"), [helpers.image(*b, seed=5)], 3, 2),
        # Text only and short: its first chunk ends well before the previous occupant's last position.
        (("Write a poem.",), [], NEW_TOKENS, 3),
    ]
    return [(runtime.inputs(parts, images), new, arrival) for parts, images, new, arrival in turns]


def check_against_transformers(runtime: FamilyRuntime, requests, report) -> None:
    """Each request: tokens identical to transformers generate alone, every step's logits close."""
    for (processed, new, _), done in zip(requests, report.requests):
        tokens, logits = runtime.reference(processed)  # NEW_TOKENS; greedy prefixes are shorter runs
        label = f"{runtime.family.name} request {done.number}"
        assert done.result.tokens == tokens[:new], f"{label}: tokens differ from transformers"
        assert len(done.result.logits) == len(done.result.tokens)
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(done.result.logits, logits))
        assert worst <= LOGIT_TOLERANCE, f"{label}: logits differ by {worst}"


def run_five(runtime: FamilyRuntime, generator: Generator, full_batch_size: int | None = SLOTS):
    requests = five_requests(runtime)
    engine = BatchedEngine(generator, full_batch_size=full_batch_size)
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    return requests, report


@pytest.mark.parametrize("family", BATCHING)
def test_five_staggered_requests_through_four_slots_match_transformers(family, hf_model, cb_exported):
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, cb_exported(family), model, processor)
    generator = runtime.generator(SEQ_LENS, cache=EmbeddingCache(64 * 2**20))
    requests, report = run_five(runtime, generator)
    assert report.batched and report.full_batch_size == SLOTS
    # Every cache (window rings included) was updated in place, not copied per call.
    kv = {row.name for row in generator.io.rows(*KV_ROLES)}
    assert aliasable(generator.language.path, generator.io.retained_outputs()) == kv
    check_against_transformers(runtime, requests, report)
    fifth = report.requests[4]
    before = [r for r in report.requests[:4] if r.slot == fifth.slot]
    assert before and all(r.finished_step < fifth.admitted_step for r in before), "the fifth reuses a slot"
    # The previous occupant filled cache positions beyond the fifth's first chunk: stale rows were
    # there for a wrong mask or ring position to read.
    previous = max(before, key=lambda r: r.finished_step).result
    assert previous.prompt_tokens + len(previous.tokens) > fifth.result.chunks[0].tokens
    assert max(report.decode_batches) >= 2, "several requests decode in one call"
    # One call per decode step, not one per request: fewer calls than decoded tokens.
    assert len(report.decode_batches) < sum(len(r.result.tokens) - 1 for r in report.requests)


def test_single_sequence_program_serves_the_same_schedule_call_by_call(hf_model, exported):
    """Without batch_index the engine keeps one host cache per slot: same tokens, one call per request."""
    model, processor = hf_model("qwen2_5_vl")
    runtime = FamilyRuntime("qwen2_5_vl", exported("qwen2_5_vl"), model, processor)
    requests, report = run_five(runtime, runtime.generator(SEQ_LENS))
    assert not report.batched
    check_against_transformers(runtime, requests, report)


def test_decode_ccl_covers_the_furthest_position_across_the_batch(hf_model, cb_exported):
    """Each decode call reads the smallest compiled CCL above the furthest position of any of its rows."""
    family = "qwen2_5_vl"
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, cb_exported(family, ccl=True), model, processor)
    prefill_ccls, decode_ccls = (64, 128, 512), (96, 112, 128, 512)
    buckets = tuple(PrefillBucket(s, s) for s in SEQ_LENS)
    shape = LanguageShape(buckets, max(SEQ_LENS), 512, prefill_ccls, decode_ccls)
    generator = Generator(runtime.checkpoint, runtime.vision, runtime.language, shape)
    calls = []
    run = runtime.language.run_retained  # the engine's calls (the slot cache is updated in place)

    def recording(feeds, state, retained):
        positions = feeds[generator.io.name(Role.POSITIONS)][0]  # M-RoPE: the text row
        ccl = len(feeds[generator.io.name(Role.COMP_CTX_LENGTHS)])
        calls.append((positions.shape[0], int(positions.max()), ccl))
        return run(feeds, state, retained)

    runtime.language.run_retained = recording
    try:
        requests, report = run_five(runtime, generator)
    finally:
        del runtime.language.run_retained
    check_against_transformers(runtime, requests, report)
    decode = [(furthest, ccl) for batch, furthest, ccl in calls if batch == SLOTS]
    assert decode and all(ccl == min(c for c in decode_ccls if c > furthest) for furthest, ccl in decode)
    assert len({ccl for _, ccl in decode}) > 1, "the decode CCL grows with the furthest position"


def test_a_slot_idle_between_prefill_chunks_keeps_its_gemma3_window(hf_model, cb_exported):
    """Gemma 3: a request prefilled in several chunks while two others decode (issue 31).

    Between its chunks the request's slot is an idle row of every decode call (position -1,
    ``batch_index`` its own slot): it must write nothing its ring or full layers read, so the
    request's tokens equal transformers alone. Chunks of 16 tokens over a window of 8 make each
    chunk rewrite the whole ring, and the decode calls run between those chunks.
    """
    family = "gemma3"
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, cb_exported(family), model, processor)
    generator = runtime.generator((16,))
    turns = [
        (("Write a poem.",), [], NEW_TOKENS, 0),
        (("Hi there",), [], NEW_TOKENS, 0),
        (("Tell me a long story about a dragon, a castle, the sea and a very old lighthouse.",), [], 3, 2),
    ]
    requests = [(runtime.inputs(parts, images), new, arrival) for parts, images, new, arrival in turns]
    engine = BatchedEngine(generator, full_batch_size=SLOTS)
    events = []
    prefill, decode = engine.slots.prefill, engine.slots.decode

    def recording_prefill(slot, feeds):
        events.append(("prefill", slot))
        return prefill(slot, feeds)

    def recording_decode(tokens):
        events.append(("decode", set(tokens)))
        return decode(tokens)

    engine.slots.prefill, engine.slots.decode = recording_prefill, recording_decode
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    check_against_transformers(runtime, requests, report)
    long = report.requests[2]
    assert len(long.result.chunks) >= 3, "the long prompt is prefilled in several chunks"
    chunk_steps = [i for i, (kind, slot) in enumerate(events) if kind == "prefill" and slot == long.slot]
    between = [
        slots for kind, slots in events[chunk_steps[0] : chunk_steps[-1]] if kind == "decode" and slots
    ]
    assert len(between) >= 2 and all(long.slot not in slots for slots in between), (
        "others decode while the long request's slot is idle between its chunks"
    )


def test_each_request_reports_how_its_own_images_were_served(hf_model, exported):
    """Serving notes belong to the request (issue 38): nothing carries over from an earlier one.

    The same image in two requests of one run is encoded for the first and served from the
    embedding cache for the second; a lone request afterwards on the same runner reports only
    its own images, and a text-only one none.
    """
    model, processor = hf_model("qwen2_5_vl")
    runtime = FamilyRuntime("qwen2_5_vl", exported("qwen2_5_vl"), model, processor)
    generator = runtime.generator(SEQ_LENS)
    image = helpers.image(64, 96, seed=7)
    shown = runtime.inputs(("<image>", "Describe this image."), [image])
    report = BatchedEngine(generator, full_batch_size=1).run(
        [EngineRequest(shown, 2), EngineRequest(shown, 2)]
    )
    first, second = (done.result.served for done in report.requests)
    assert len(first) == 1 and first[0].startswith("image 1: resolution-list program"), first
    assert second == ["image 1: embedding cache (encoded by an earlier turn)"]
    other = runtime.inputs(("<image>", "And this?"), [helpers.image(96, 64, seed=8)])
    (served,) = generator.generate(other, max_new_tokens=2).served
    assert served.startswith("image 1: resolution-list program"), served
    assert generator.generate(runtime.inputs(("Hi.",), []), max_new_tokens=2).served == []
