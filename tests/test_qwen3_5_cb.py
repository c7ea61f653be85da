"""Qwen3.5 under continuous batching: six staggered requests through three slots.

Every slot holds a KV cache for the full-attention layer and conv/recurrent states for the three
linear layers. Requests arrive so that freed slots are taken again while other requests are still
prefilling (32-token chunks, several per prompt) or decoding; each must equal transformers generate
run alone. A new occupant that inherited its slot's recurrent state, an idle decode row that
decayed its state, or a prefill that wrote another slot would change its tokens or logits.
"""

from __future__ import annotations

from qeff_vision.contract.language_io import KV_ROLES
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.in_place import aliasable
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime
from tests.test_batched_engine import check_against_transformers

FAMILY = "qwen3_5"
SLOTS = 3


def _six_requests(runtime: FamilyRuntime):
    turns = [
        (("<image>", "Describe this image."), [helpers.image(100, 150, 1)], NEW_TOKENS, 0),
        # One token only: its slot frees while request 2 is still prefilling and request 0 decoding.
        (("Write a poem about the sea and the wind.",), [], 1, 0),
        (("<image>", "<image>", "Compare."), [helpers.image(224, 224, 2), helpers.image(300, 120, 3)], 4, 1),
        (("Hi",), [], 3, 2),
        (("<image>", "And this one, in detail?"), [helpers.image(224, 224, 4)], NEW_TOKENS, 3),
        (("Tell me about the castle.",), [], NEW_TOKENS, 4),
    ]
    return [(runtime.inputs(parts, images), new, arrival) for parts, images, new, arrival in turns]


def test_six_staggered_requests_through_three_slots_match_transformers(cb_exported, hf_model):
    runtime = FamilyRuntime(FAMILY, cb_exported(FAMILY), *hf_model(FAMILY))
    generator = runtime.generator([32], cache=EmbeddingCache(64 * 2**20))
    requests = _six_requests(runtime)
    engine = BatchedEngine(generator, full_batch_size=SLOTS)
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    assert report.batched and report.full_batch_size == SLOTS
    check_against_transformers(runtime, requests, report)
    # KV caches are updated in place; recurrent states are rewritten whole (a Where over the slots).
    kv = {row.name for row in generator.io.rows(*KV_ROLES)}
    assert kv <= aliasable(generator.language.path, generator.io.retained_outputs())
    reused = [
        r
        for r in report.requests
        if any(o.slot == r.slot and o.finished_step < r.admitted_step for o in report.requests)
    ]
    assert len(reused) >= 2, "slots are taken again"
    for request in reused:
        busy = [
            o
            for o in report.requests
            if o.slot != request.slot and o.admitted_step <= request.admitted_step <= o.finished_step
        ]
        assert busy, f"request {request.number} took its slot while no other request was running"
    prefilling = [
        r
        for r in reused
        if any(
            o.slot != r.slot and o.admitted_step <= r.admitted_step < o.first_token_step
            for o in report.requests
        )
    ]
    decoding = [
        r
        for r in reused
        if any(
            o.slot != r.slot and o.first_token_step <= r.admitted_step < o.finished_step
            for o in report.requests
        )
    ]
    schedule = [
        (o.number, o.slot, o.arrival_step, o.admitted_step, o.first_token_step, o.finished_step)
        for o in report.requests
    ]
    assert prefilling and decoding, f"slots reused {schedule} while others are mid-prefill and mid-decode"
    assert max(report.decode_batches) >= 2


def test_filler_rows_leave_every_slot_but_the_valid_rows_own():
    """A decode call whose padding rows name slot -1 or a slot a valid row writes (vLLM's filler rows)."""
    import torch

    from qeff_vision.export.recurrent_state import RecurrentStates

    state = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 3)
    conv = torch.arange(4 * 5 * 2, dtype=torch.float32).reshape(4, 5, 2)
    positions = torch.tensor([[7], [-1], [-1], [3]])  # rows 0 and 3 valid; rows 1 and 2 filler
    batch_index = torch.tensor([[2], [2], [-1], [0]])  # row 1 names row 0's slot, row 2 names -1
    states = RecurrentStates({0: conv}, {0: state}, positions, batch_index)
    read = states.state(0)
    assert torch.equal(read[0], state[2]) and torch.equal(read[3], state[0])
    new = torch.full((4, 2, 3), -5.0)
    new[0], new[3] = 100.0, 200.0
    states.update_state(0, new)
    written = states.retained(0, conv=False)
    assert torch.equal(written[2], new[0]) and torch.equal(written[0], new[3])
    assert torch.equal(written[1], state[1]) and torch.equal(written[3], state[3])  # no valid row named them
    window = states.conv_window(0, torch.ones(4, 5, 1))
    kept = states.retained(0, conv=True)
    assert torch.equal(kept[2], window[0, :, 1:]) and torch.equal(kept[0], window[3, :, 1:])
    assert torch.equal(kept[1], conv[1]) and torch.equal(kept[3], conv[3])
