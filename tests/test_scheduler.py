"""The continuous-batching scheduler (pure): admission, one prefill chunk per step, decode, slot reuse."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qeff_vision.runtime.scheduler import Phase, Scheduler


def drive(arrivals, slots, chunks, tokens):
    """Run the scheduler with ``chunks[r]`` prefill chunks and ``tokens[r]`` tokens per request.

    Returns the step plans and, per request, (slot, first token step, finished step).
    """
    scheduler = Scheduler(arrivals, slots)
    left = list(chunks)
    generated = [0] * len(arrivals)
    plans, where = [], {}
    while not scheduler.done:
        plan = scheduler.plan_step()
        plans.append(plan)
        finished = []
        if plan.prefill is not None:
            left[plan.prefill] -= 1
            if left[plan.prefill] == 0:
                scheduler.prefill_finished(plan.prefill)
                generated[plan.prefill] = 1
                where[plan.prefill] = [scheduler.slot_of[plan.prefill], plan.step, None]
                if tokens[plan.prefill] == 1:
                    finished.append(plan.prefill)
        for request in plan.decode:
            generated[request] += 1
            if generated[request] == tokens[request]:
                finished.append(request)
        for request in finished:
            scheduler.finish(request)
            where[request][2] = plan.step
        scheduler.advance()
    return plans, {r: tuple(v) for r, v in where.items()}


def test_staggered_requests_share_slots_and_the_fifth_reuses_a_freed_one():
    plans, where = drive([0, 0, 1, 2, 3], 4, chunks=[2, 1, 3, 1, 2], tokens=[3, 6, 4, 2, 3])
    # Admission: lowest free slot first, in arrival order.
    assert [where[r][0] for r in range(4)] == [0, 1, 2, 3]
    # One prefill chunk per step, first come first served: request 0's two chunks, then 1, then 2's three.
    assert [p.prefill for p in plans[:7]] == [0, 0, 1, 2, 2, 2, 3]
    # The first token comes from the last prefill chunk; decoding starts the step after.
    assert where[0][1] == 1 and plans[2].decode[:1] == (0,)
    assert all(0 not in p.decode for p in plans[:2])
    # The fifth waits for a free slot and takes the slot of the first request to finish.
    first_done = min(range(4), key=lambda r: where[r][2])
    admitted = next(p for p in plans if any(r == 4 for r, _ in p.admitted))
    assert admitted.step == where[first_done][2] + 1
    assert where[4][0] == where[first_done][0]
    # Several requests decode in one call.
    assert max(len(p.decode) for p in plans) >= 3


def test_decode_set_is_fixed_at_step_start_and_in_slot_order():
    plans, _ = drive([0, 0, 0], 3, chunks=[1, 1, 1], tokens=[5, 5, 5])
    assert [p.decode for p in plans[:4]] == [(), (0,), (0, 1), (0, 1, 2)]
    assert [p.occupancy for p in plans[:3]] == [3, 3, 3]


def test_clock_jumps_to_the_next_arrival_when_idle():
    plans, where = drive([5, 20], 2, chunks=[1, 1], tokens=[2, 1])
    assert [p.step for p in plans] == [5, 6, 20]
    assert where[1] == (0, 20, 20), "a one-token request frees its slot at its prefill step"


def test_one_slot_serves_requests_in_arrival_then_file_order():
    plans, where = drive([3, 1, 1], 1, chunks=[1, 1, 1], tokens=[1, 1, 1])
    assert [r for p in plans for r, _ in p.admitted] == [1, 2, 0]


def test_phases_and_bad_arguments():
    scheduler = Scheduler([0], 1)
    assert scheduler.phase == [Phase.PENDING]
    scheduler.plan_step()
    assert scheduler.phase == [Phase.PREFILL]
    with pytest.raises(ValueError, match="not running"):
        Scheduler([0], 1).finish(0)
    with pytest.raises(ValueError, match="at least 1"):
        Scheduler([0], 0)
    with pytest.raises(ValueError, match=">= 0"):
        Scheduler([-1], 1)


def test_scheduler_and_request_parser_import_no_numpy_or_torch():
    code = (
        "import sys, qeff_vision.runtime.scheduler, qeff_vision.inputs.requests; "
        "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
