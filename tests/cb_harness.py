"""Continuous-batching export run by hand on onnxruntime: KV slots shared by several sequences.

:class:`SlotCaches` holds a continuous-batching program's ``full_batch_size``-slot caches on the
host (as a device keeps them resident). :class:`SlotProgram` presents one slot of it to the
single-sequence :class:`~qeff_vision.runtime.generate.Generator`, so a prompt is prefilled chunk
by chunk into that slot exactly as the generator feeds it (batch 1, its own ``batch_index``).
:func:`batched_decode` then runs one decode call at batch ``full_batch_size`` per step for every
prefilled sequence at once, idle slots fed position -1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import SLOT_ROLES
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.request_state import EngineRequest, RequestState


class SlotCaches:
    """The language program's KV inputs with ``full_batch_size`` slots on dim 0, zero at start."""

    def __init__(self, generator: Generator, full_batch_size: int):
        family, description = generator.family, generator.checkpoint.description
        values = {
            symbols.FULL_BATCH_SIZE: full_batch_size,
            symbols.BATCH_SIZE: full_batch_size,  # dim 0 of a table built without batch_index
            **family.language_dims(description),
            **family.kv_cache_lengths(description, generator.shape.ctx_len),
        }
        self.full_batch_size = full_batch_size
        # Every per-slot row of the table: KV caches (per-layer heads and head dims; shared-KV
        # layers have none) and recurrent layers' states.
        self.past: dict[str, np.ndarray] = {
            row.name: np.zeros(row.concrete_shape(values), np.float32)
            for row in generator.io.rows(*SLOT_ROLES)
        }

    def run(self, program, feeds: Mapping[str, np.ndarray], batch_index: np.ndarray) -> dict[str, np.ndarray]:
        """One call of ``program`` whose rows use the slots ``batch_index`` [batch, 1]; caches updated."""
        outputs = program.run({**feeds, **self.past, symbols.BATCH_INDEX: batch_index.astype(np.int64)})
        for name in self.past:
            self.past[name] = outputs[symbols.retained(name)]
        return outputs


class SlotProgram:
    """One KV slot of :class:`SlotCaches` seen as a single-sequence program that retains its state."""

    retains_state = True  # the Generator then sends no caches; SlotCaches adds them

    def __init__(self, program, caches: SlotCaches, slot: int):
        self.program, self.caches, self.slot = program, caches, slot
        self.input_dims = program.input_dims

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run with this slot's ``batch_index`` (the feeds have batch 1)."""
        return self.caches.run(self.program, feeds, np.array([[self.slot]]))


@dataclass
class SlotSequence:
    """One prefilled sequence waiting for batched decode."""

    slot: int
    positions: np.ndarray
    tokens: list[int]
    logits: list[np.ndarray]
    budget: int
    done: bool = field(default=False)


def prefill_into_slot(
    generator: Generator, processed: Mapping[str, np.ndarray], slot: int, max_new_tokens: int
) -> SlotSequence:
    """Prefill ``processed`` chunk by chunk into ``slot`` (the generator's language is a SlotProgram)."""
    assert isinstance(generator.language, SlotProgram) and generator.language.slot == slot
    request = RequestState(0, EngineRequest(processed, max_new_tokens), generator, "chunk")
    outputs = {}
    for call in generator.request_chunks(request):  # the engine's chunk calls, run here by hand
        outputs = generator.step(call.feeds, {})
    row = outputs[symbols.LOGITS][0, -1].copy()
    return SlotSequence(slot, request.positions, [int(row.argmax())], [row], max_new_tokens)


def batched_decode(
    generator: Generator, program, caches: SlotCaches, running: Sequence[SlotSequence], eos: Sequence[int]
) -> int:
    """Decode every running sequence together, one call at batch ``full_batch_size`` per step.

    A sequence stops at its token budget or an end-of-sequence id; its row is then idle (position
    -1, writes nothing another row reads). Returns the number of decode calls.
    """
    slots = caches.full_batch_size
    calls = 0
    for sequence in running:
        sequence.done = len(sequence.tokens) >= sequence.budget or sequence.tokens[-1] in eos
    while not all(sequence.done for sequence in running):
        by_slot = {sequence.slot: sequence for sequence in running if not sequence.done}
        feeds = decode_step_feeds(generator, running, slots)
        outputs = caches.run(program, feeds, np.arange(slots).reshape(slots, 1))
        calls += 1
        for slot, sequence in by_slot.items():
            row = outputs[symbols.LOGITS][slot, -1].copy()
            sequence.logits.append(row)
            sequence.tokens.append(int(row.argmax()))
            sequence.done = len(sequence.tokens) >= sequence.budget or sequence.tokens[-1] in eos
    return calls


def decode_step_feeds(
    generator: Generator, running: Sequence[SlotSequence], slots: int
) -> dict[str, np.ndarray]:
    """One batched decode call's feeds: each running sequence's last token in its slot, idle rows -1."""
    by_slot = {sequence.slot: sequence for sequence in running if not sequence.done}
    token_ids = np.zeros((slots, 1), dtype=np.int64)
    positions = []
    for slot in range(slots):
        sequence = by_slot.get(slot)
        if sequence is None:
            template = generator.host.decode_positions(running[0].positions, 0)
            positions.append(np.full_like(template, -1))
            continue
        token_ids[slot, 0] = sequence.tokens[-1]
        positions.append(generator.host.decode_positions(sequence.positions, len(sequence.tokens) - 1))
    rows = generator._vision_feeds_of_rows(
        np.zeros((1, generator.shape.decode_vision_size, generator.row_width), dtype=np.float32)
    )
    return {
        symbols.INPUT_IDS: token_ids,
        symbols.POSITION_IDS: np.ascontiguousarray(np.concatenate(positions, axis=-2)),
        symbols.IMAGE_IDX: np.zeros((1, 1), dtype=np.int64),
        **rows,
    }


def prefill_shape(lengths: Sequence[int], new_tokens: int) -> LanguageShape:
    """A bucket holding the longest prompt whole and a small one that chunks it; room for the new tokens."""
    largest = max(lengths) + 3
    buckets = tuple(PrefillBucket(s, s) for s in sorted({16, largest}))
    return LanguageShape(buckets, largest, largest + new_tokens + 8)
