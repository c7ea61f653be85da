"""KV slots of the batched engine (:mod:`qeff_vision.runtime.engine`): prefill into one, decode all.

Two ways to hold the slots:

- :class:`BatchedSlots`: a continuous-batching program (``batch_index`` input, KV dim 0 =
  ``full_batch_size``): prefill writes slot ``batch_index``; one decode call at batch
  ``full_batch_size`` serves every running request, idle slots fed position -1 (they write
  nothing; their logits are ignored).
- :class:`SequentialSlots`: a single-sequence program on onnxruntime: each slot is its own
  batch-1 cache on the host and a decode step is one call per running request. Same schedule and
  tokens, none of the batching speed-up; a device keeps one resident cache, so a ``qaic`` program
  without continuous batching has one slot.

Both drive the program through :meth:`Generator.step <qeff_vision.runtime.generator.Generator.step>`.
A language program that holds its slots another way declares it by subclassing
:class:`SlotProvider` (the disaggregated pair: :mod:`qeff_vision.runtime.disaggregated`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision.contract.language_io import Role
from qeff_vision.runtime.backends import backend_of
from qeff_vision.runtime.device_sampler import last_rows

if TYPE_CHECKING:
    from qeff_vision.runtime.device_sampler import RequestDraws
    from qeff_vision.runtime.generator import Generator

# slot -> (last token, its position ids, the request's extra decode inputs by role, one row each,
# the request's draws for a program with the on-device sampler, else None)
DecodeRow = tuple[int, np.ndarray, Mapping[Role, np.ndarray], "RequestDraws | None"]


class SlotProvider(ABC):
    """A language program that builds the batched engine's slots itself, declared by subclassing.

    The engine asks such a program for its slots (:meth:`engine_slots`) and reads its slot count
    from :attr:`decode_specializations`; any other program gets :class:`BatchedSlots` or
    :class:`SequentialSlots` and its own ``specializations``. The check is nominal on purpose: an
    object that merely has members of these names is not taken for one.

    Attributes:
        decode_specializations: The specializations of the program that decodes (the engine's
            slot count is its ``full_batch_size``); None when not compiled.
    """

    decode_specializations: Sequence[Mapping[str, Any]] | None

    @abstractmethod
    def engine_slots(self, generator: Generator, full_batch_size: int) -> Any:
        """The engine's slots over this program.

        Args:
            generator: The single-request host the engine drives.
            full_batch_size: Slots.

        Returns:
            An object with the slots' members (``batched``, ``full_batch_size``, ``prefill``,
            ``finish_prefill``, ``release``, ``decode``), like :class:`BatchedSlots`.
        """


class SequentialSlots:
    """Slots for a single-sequence program: one batch-1 host cache per slot, one call per request.

    Args:
        generator: The single-sequence host (its language program has no ``batch_index``).
        full_batch_size: Slots to emulate.

    Raises:
        UserError: The program keeps its cache on the device (one cache: one slot only).
    """

    batched = False
    #: Each slot is one sequence's own cache: a lone request's result continues from it.
    per_sequence = True

    def __init__(self, generator: Generator, full_batch_size: int):
        backend_of(generator.language).check_slots(full_batch_size)
        self.generator = generator
        self.full_batch_size = full_batch_size
        self.past = [generator.empty_cache() for _ in range(full_batch_size)]

    def prefill(self, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One chunk of the request in ``slot``."""
        return self.generator.step(feeds, self.past[slot])

    def load(self, slot: int, past: dict[str, np.ndarray]) -> None:
        """The request in ``slot`` starts from ``past`` (a batch-1 cache, used as it is)."""
        self.past[slot] = past

    def cache(self, slot: int) -> dict[str, np.ndarray]:
        """The cache of ``slot`` (the calls replace its entries, never write into its arrays)."""
        return self.past[slot]

    def finish_prefill(self, slot: int) -> None:
        """Nothing to do: the request's prefill wrote its slot's cache, which it decodes from."""

    def release(self, slot: int) -> None:
        """A request failed in ``slot``: its next occupant starts from a fresh cache."""
        self.past[slot] = self.generator.empty_cache()

    def decode(self, tokens: Mapping[int, DecodeRow]) -> tuple[dict[int, np.ndarray], int]:
        """One lone decode step per running slot, given slot -> (last token, its positions, extra, draws).

        Returns:
            (last-position logits by slot, or the on-device sampler's token; vision bytes sent).
        """
        generator = self.generator
        logits = {}
        for slot, (token, positions, extra, draws) in tokens.items():
            outputs = generator.feed_token(token, positions, self.past[slot], extra, draws)
            logits[slot] = last_rows(outputs, generator.logits_name)[0]
        return logits, len(tokens) * _vision_bytes(generator)


class BatchedSlots:
    """Slots of a continuous-batching program: one cache with ``full_batch_size`` rows, one decode call.

    The cache is this object's alone, so calls update it in place where the backend can
    (:meth:`~qeff_vision.runtime.session.CompiledProgram.run_retained`). A decode call's inputs
    live in buffers made once and refilled per step.

    Args:
        generator: The host of the program (its language program has a ``batch_index`` input).
        full_batch_size: The program's ``full_batch_size``.
    """

    batched = True
    per_sequence = False

    def __init__(self, generator: Generator, full_batch_size: int):
        self.generator = generator
        self.full_batch_size = full_batch_size
        self.past = generator.empty_cache(full_batch_size)
        self.vision_bytes = _vision_bytes(generator)
        self._token_ids = np.zeros((full_batch_size, 1), np.int64)
        self._positions: np.ndarray | None = None  # shaped by the first decode call's rows
        self._extra: dict[Role, np.ndarray] = {}
        self._extra_shapes: dict[Role, tuple[int, ...]] = {}
        self._decode_feeds: dict[str, np.ndarray] = {}

    def prefill(self, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One chunk of the request in ``slot`` (batch 1, written to row ``slot`` of the cache)."""
        slot_index = self.generator.io.feeds({Role.KV_SLOT: np.array([[slot]], np.int64)})
        return self.generator.step({**feeds, **slot_index}, self.past, in_place=True)

    def load(self, slot: int, past: Mapping[str, np.ndarray]) -> None:
        """Row ``slot`` of the cache takes the batch-1 cache ``past`` (written in place)."""
        for name, rows in past.items():
            self.past[name][slot : slot + 1] = rows

    def cache(self, slot: int) -> None:
        """None: a slot is a row of one cache the calls update in place, nobody's to keep."""
        return None

    def finish_prefill(self, slot: int) -> None:
        """Nothing to do: the request's prefill wrote row ``slot`` of the cache it decodes from."""

    def release(self, slot: int) -> None:
        """A request failed in ``slot``: nothing to drop.

        Its row is the next occupant's to overwrite: positions restart at 0 and the masks read
        only what that occupant writes.
        """

    def decode(self, tokens: Mapping[int, DecodeRow]) -> tuple[dict[int, np.ndarray], int]:
        """One call at batch ``full_batch_size`` for slot -> (last token, its position ids, extra).

        A slot nobody decodes in (free, or its request still prefilling) gets token 0 at position
        -1 (M-RoPE: every row -1) and -1 in every extra input (a cross-attention mask row: no
        image slot in use), and greedy neutral sampler inputs; its logits are dropped.

        Returns:
            (last-position logits by running slot, or the on-device sampler's token; vision bytes
            sent).
        """
        _, template, extra_template, _ = next(iter(tokens.values()))
        if self._positions is None or self._extra_shapes != _shapes(extra_template):
            self._make_buffers(template, extra_template)
        self._token_ids.fill(0)
        self._positions.fill(-1)
        for buffer in self._extra.values():
            buffer.fill(-1)
        for slot, (token, positions, extra, _) in tokens.items():
            self._token_ids[slot, 0] = token
            self._positions[..., slot : slot + 1, :] = positions
            for role, row in extra.items():
                self._extra[role][slot : slot + 1] = row
        generator = self.generator
        draws = [tokens[slot][3] if slot in tokens else None for slot in range(self.full_batch_size)]
        feeds = generator.with_sampler_inputs(self._decode_feeds, draws)
        outputs = generator.step(feeds, self.past, in_place=True)
        rows = last_rows(outputs, generator.logits_name)  # logits, or the device's tokens
        return {slot: rows[slot] for slot in tokens}, self.vision_bytes

    def _make_buffers(self, positions: np.ndarray, extra: Mapping[Role, np.ndarray]) -> None:
        """Decode inputs at batch ``full_batch_size`` shaped like one request's rows, and their feeds."""
        slots = self.full_batch_size
        # Batch is the second-to-last axis of position_ids ([B, 1] or M-RoPE's [R, B, 1]).
        self._positions = np.zeros((*positions.shape[:-2], slots, positions.shape[-1]), np.int64)
        self._extra = {role: np.zeros((slots, *row.shape[1:]), row.dtype) for role, row in extra.items()}
        self._extra_shapes = _shapes(extra)
        self._decode_feeds = self.generator.decode_step_feeds(self._token_ids, self._positions, self._extra)
        batch_index = np.arange(slots, dtype=np.int64).reshape(slots, 1)
        self._decode_feeds.update(self.generator.io.feeds({Role.KV_SLOT: batch_index}))


def _shapes(arrays: Mapping[Role, np.ndarray]) -> dict[Role, tuple[int, ...]]:
    return {role: array.shape for role, array in arrays.items()}


def _vision_bytes(generator: Generator) -> int:
    """Bytes of vision rows one decode call sends (none when the device keeps them resident)."""
    rows = backend_of(generator.language).host_state(generator.decode_vision_feeds)
    return sum(array.nbytes for array in rows.values())
