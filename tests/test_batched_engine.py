"""Batched engine, every family: five staggered requests through four slots match transformers alone.

Requests differ in images (none, one, two), resolutions and prompt lengths, and arrive at
staggered steps so that the fifth takes the slot a finished one freed: each request's tokens must
equal transformers generate run alone on that request and every step's logits must be within fp32
tolerance. A slot's previous occupant leaking into the next (stale cache rows, a wrong ring
position) would move the fifth request's logits.
"""

from __future__ import annotations

import pytest

from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime

FAMILIES = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE]
SLOTS = 4
SEQ_LENS = (32, 64)


def five_requests(runtime: FamilyRuntime) -> list[tuple[dict, int, int]]:
    """(processed, max_new_tokens, arrival_step) of five different requests; the fifth arrives last."""
    sizes = list(runtime.adapter.test_image_sizes)
    a, b, c = sizes[0], sizes[1 % len(sizes)], sizes[2 % len(sizes)]
    turns = [
        (("<image>", "Describe this image."), [helpers.image(*a, seed=1)], NEW_TOKENS, 0),
        (("Write a short poem about the sea and the sky, please.",), [], NEW_TOKENS - 2, 0),
        (
            ("<image>", "<image>", "Compare."),
            [helpers.image(*b, seed=2), helpers.image(*c, seed=3)],
            NEW_TOKENS,
            1,
        ),
        (("<image>", "What is this?"), [helpers.image(*c, seed=4)], 3, 2),
        (("<image>", "And this one, in detail?"), [helpers.image(*b, seed=5)], NEW_TOKENS, 3),
    ]
    return [(runtime.inputs(parts, images), new, arrival) for parts, images, new, arrival in turns]


@pytest.fixture(scope="module")
def runtimes(hf_model, exported):
    built = {}

    def get(family: str) -> FamilyRuntime:
        if family not in built:
            model, processor = hf_model(family)
            built[family] = FamilyRuntime(family, exported(family), model, processor)
        return built[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_five_staggered_requests_through_four_slots_match_transformers(family, runtimes):
    runtime = runtimes(family)
    generator = runtime.generator(SEQ_LENS, cache=EmbeddingCache(64 * 2**20))
    engine = BatchedEngine(generator, full_batch_size=SLOTS)
    requests = five_requests(runtime)
    report = engine.run(
        [EngineRequest(processed, new, arrival) for processed, new, arrival in requests], keep_logits=True
    )
    for (processed, new, _), done in zip(requests, report.requests):
        tokens, logits = (
            runtime.reference(processed) if new == NEW_TOKENS else _reference(runtime, processed, new)
        )
        assert done.result.tokens == tokens, f"{family} request {done.number}: tokens differ"
        worst = max(float(abs(ours - ref).max()) for ours, ref in zip(done.result.logits, logits))
        assert worst <= 1e-3, f"{family} request {done.number}: logits differ by {worst}"
    fifth = report.requests[4]
    previous = [r for r in report.requests[:4] if r.slot == fifth.slot]
    assert previous and all(r.finished_step < fifth.admitted_step for r in previous), "no slot reuse"
    assert max(report.decode_batches) > 1


def _reference(runtime: FamilyRuntime, processed, new_tokens: int):
    tokens, logits = runtime.reference(processed)
    return tokens[:new_tokens], logits[:new_tokens]
