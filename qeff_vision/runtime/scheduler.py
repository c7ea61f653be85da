"""Continuous-batching scheduler: KV slots, a waiting queue, and what each engine step runs.

The shape of vLLM v1's scheduler (pinned vllm-project/vllm ``vllm/v1/core/sched/scheduler.py``:
one token budget per step, running requests' decode tokens first, the remainder to prefill
chunks), fitted to compiled programs: the prefill program runs at batch 1 with a compiled bucket,
so a step's budget is one decode token for every running request (one call at batch
``full_batch_size``) plus one prefill chunk of one request (its plan's next chunk). Each step:

1. Requests whose ``arrival_step`` has come join the waiting queue (arrival order, then file
   order) and take free slots, lowest slot first.
2. The earliest admitted request still prefilling gets its next chunk (first come, first served:
   it finishes its prompt before the next one starts).
3. Every request that was decoding when the step began decodes one token. A request whose
   prefill ends in this step produced its first token from the prefill logits and joins the
   decode batch from the next step (as in vLLM, the sampled token is fed back one step later).

A request that finishes (end-of-sequence or ``max_new_tokens``) frees its slot at once; a waiting
request takes it at the next step. When nothing is admitted or running, the clock jumps to the
next arrival (no call runs in between).

Pure: no numpy, no onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    """Where a request is."""

    PENDING = "pending"  # its arrival step has not come
    WAITING = "waiting"  # arrived, no free slot yet
    PREFILL = "prefill"  # holds a slot, prompt chunks left
    DECODE = "decode"  # holds a slot, generating
    DONE = "done"  # finished, slot freed


@dataclass(frozen=True)
class StepPlan:
    """What one engine step runs.

    Attributes:
        step: The step number (the scheduler's clock).
        admitted: (request, slot) pairs that took a slot at this step.
        prefill: The request that gets its next prefill chunk, or None.
        decode: Requests decoding one token each, in slot order (one batched call).
        slots: Slot -> request held at the start of the calls (None for a free slot).
    """

    step: int
    admitted: tuple[tuple[int, int], ...]
    prefill: int | None
    decode: tuple[int, ...]
    slots: tuple[int | None, ...]

    @property
    def occupancy(self) -> int:
        """Slots held during this step."""
        return sum(slot is not None for slot in self.slots)


class Scheduler:
    """Slots and phases of a fixed set of requests (see the module docstring for the policy).

    Args:
        arrival_steps: Each request's arrival step, indexed by request number.
        full_batch_size: Number of KV slots.

    Raises:
        ValueError: No slot, or a negative arrival step.
    """

    def __init__(self, arrival_steps: Sequence[int], full_batch_size: int):
        if full_batch_size < 1:
            raise ValueError(f"full_batch_size must be at least 1, got {full_batch_size}")
        if any(step < 0 for step in arrival_steps):
            raise ValueError("arrival steps must be >= 0")
        self.arrival_steps = list(arrival_steps)
        self.slots: list[int | None] = [None] * full_batch_size
        self.phase = [Phase.PENDING] * len(self.arrival_steps)
        self.slot_of: dict[int, int] = {}
        self.step = min(self.arrival_steps, default=0)
        self._admission: list[int] = []  # requests in the order they took a slot

    @property
    def full_batch_size(self) -> int:
        """Number of slots."""
        return len(self.slots)

    @property
    def done(self) -> bool:
        """Every request finished."""
        return all(phase is Phase.DONE for phase in self.phase)

    def plan_step(self) -> StepPlan:
        """Admit what can be admitted at the current step and say what the step runs."""
        for request, arrival in enumerate(self.arrival_steps):
            if self.phase[request] is Phase.PENDING and arrival <= self.step:
                self.phase[request] = Phase.WAITING
        waiting = sorted(
            (r for r, phase in enumerate(self.phase) if phase is Phase.WAITING),
            key=lambda r: (self.arrival_steps[r], r),
        )
        admitted = []
        for request in waiting:
            if None not in self.slots:
                break
            slot = self.slots.index(None)
            self.slots[slot] = request
            self.slot_of[request] = slot
            self.phase[request] = Phase.PREFILL
            self._admission.append(request)
            admitted.append((request, slot))
        prefill = next((r for r in self._admission if self.phase[r] is Phase.PREFILL), None)
        decode = tuple(r for r in self.slots if r is not None and self.phase[r] is Phase.DECODE)
        return StepPlan(self.step, tuple(admitted), prefill, decode, tuple(self.slots))

    def prefill_finished(self, request: int) -> None:
        """``request``'s last prompt chunk ran: it decodes from the next step."""
        self._expect(request, Phase.PREFILL)
        self.phase[request] = Phase.DECODE

    def finish(self, request: int) -> None:
        """``request`` is complete: its slot is free for the next step's admissions."""
        if self.phase[request] not in (Phase.PREFILL, Phase.DECODE):
            raise ValueError(f"request {request} is {self.phase[request].value}, not running")
        self.slots[self.slot_of.pop(request)] = None
        self.phase[request] = Phase.DONE
        self._admission.remove(request)  # a long run keeps only the running requests here

    def advance(self) -> None:
        """Move the clock to the next step, or straight to the next arrival when nothing runs."""
        self.step += 1
        if all(slot is None for slot in self.slots) and Phase.WAITING not in self.phase:
            pending = [a for r, a in enumerate(self.arrival_steps) if self.phase[r] is Phase.PENDING]
            if pending:
                self.step = max(self.step, min(pending))

    def _expect(self, request: int, phase: Phase) -> None:
        if self.phase[request] is not phase:
            raise ValueError(f"request {request} is {self.phase[request].value}, not {phase.value}")
