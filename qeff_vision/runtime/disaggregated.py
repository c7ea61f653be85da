"""Disaggregated serving on the host: prefill on ``lang_prefill``, decode on ``lang_decode``.

A disaggregated compile (spec ``deployment: disaggregated``) has two language programs built from
one graph: ``lang_prefill`` holds only the prefill specializations at batch 1 (a continuous-
batching export binds ``full_batch_size`` 1 there: its cache is one request's), ``lang_decode``
only the decode specialization(s), at ``full_batch_size`` or batch 1. Each would run on its own
device pool; the KV a finished prefill wrote is copied into the request's decode slot (vLLM's
prefill/decode hand-off; QEfficient's disaggregated example feeds the prefill session's
``_RetainedState`` outputs to the decode session as inputs).

:class:`PhaseRouter` presents both programs to the :class:`~qeff_vision.runtime.generator.Generator`
as one language program: a call with ``seq_len`` > 1 goes to the prefill program, a one-token
call to the decode program, each accepting only its own specializations, so a decode-shaped call
on the prefill program (or the reverse) is refused as a device would refuse it. For one sequence
with a batch-1 decode program, the cache the prefill returned is the one the decode program
takes (the host hand-off); one sequence on a decode program at ``full_batch_size`` > 1 runs
through the batched engine like any request. :class:`DisaggregatedSlots` serves the batched
engine: each request prefills into its own batch-1 cache, and
:meth:`~DisaggregatedSlots.finish_prefill` copies it into the request's slot of the decode
program's cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.runtime.backends import backend_of
from qeff_vision.runtime.session import ShapeMismatch
from qeff_vision.runtime.slots import BatchedSlots, DecodeRow, SequentialSlots, SlotProvider

if TYPE_CHECKING:
    from qeff_vision.runtime.generator import Generator


class PhaseRouter(SlotProvider):
    """Two programs of one graph, as one language program: prefill calls to one, decode to the other.

    It is a :class:`~qeff_vision.runtime.slots.SlotProvider`: the batched engine prefills and
    decodes through its :class:`DisaggregatedSlots`.

    Args:
        prefill: The ``lang_prefill`` program (its specializations only).
        decode: The ``lang_decode`` program (its specializations only).
    """

    def __init__(self, prefill: Any, decode: Any):
        self.prefill = prefill
        self.decode = decode
        self.path = decode.path
        self.input_dims = prefill.input_dims
        self.output_names = prefill.output_names
        #: Where both programs keep their state (:func:`~qeff_vision.runtime.backends.backend_of`).
        self.backend = backend_of(prefill, decode)
        self.specializations = [*(prefill.specializations or ()), *(decode.specializations or ())]
        #: What the batched engine's slot count is read from (prefill binds full_batch_size 1).
        self.decode_specializations = decode.specializations
        #: Prefill KV hand-offs to a decode slot, and their bytes (what a device pair would transfer).
        self.handoffs = 0
        self.handoff_bytes = 0

    @property
    def calls(self) -> int:
        """Calls of both programs."""
        return self.prefill.calls + self.decode.calls

    @property
    def seconds(self) -> float:
        """Seconds spent in both programs."""
        return self.prefill.seconds + self.decode.seconds

    def program_for(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """The decode program for a one-token call, else the prefill program."""
        token_ids = feeds[symbols.INPUT_IDS]
        return self.decode if token_ids.shape[-1] == 1 else self.prefill

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on the phase's program (a shape it was not compiled for is refused).

        One sequence on a decode program compiled for ``full_batch_size`` > 1 (``run --prompt``)
        is a batch of one of the batched engine, which feeds the decode program at its batch
        (:func:`qeff_vision.runtime.engine.compiled_slots`).
        """
        return self.program_for(feeds).run(feeds)

    def run_retained(
        self, feeds: Mapping[str, np.ndarray], state: dict[str, np.ndarray], retained: Mapping[str, str]
    ) -> dict[str, np.ndarray]:
        """:meth:`~qeff_vision.runtime.session.CompiledProgram.run_retained` on the phase's program."""
        return self.program_for(feeds).run_retained(feeds, state, retained)

    def accepts(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """Whether the phase's program takes ``feeds``."""
        return self.program_for(feeds).accepts(feeds)

    def engine_slots(self, generator: Generator, full_batch_size: int) -> DisaggregatedSlots:
        """The batched engine's slots over these programs."""
        return DisaggregatedSlots(generator, full_batch_size, self)


class DisaggregatedSlots:
    """Engine slots whose prefill runs on ``lang_prefill`` and decode on ``lang_decode``.

    Each admitted request prefills into a batch-1 cache of its own (the prefill program's); when
    its last chunk has run, :meth:`finish_prefill` copies every KV row into the request's slot of
    the decode cache (one ``full_batch_size``-row cache for a continuous-batching decode program,
    one batch-1 cache per slot otherwise), which :class:`~qeff_vision.runtime.slots.BatchedSlots`
    or :class:`~qeff_vision.runtime.slots.SequentialSlots` then decode.

    Raises:
        UserError: The programs keep their caches on a device: the copy between device programs is
            the serving stack's KV transfer, not wired here.
    """

    def __init__(self, generator: Generator, full_batch_size: int, router: PhaseRouter):
        router.backend.check_state_transfer(
            "a disaggregated artifact on the device keeps each program's KV resident; the hand-off "
            "between them is the serving stack's KV transfer (vLLM): run it here with the "
            "onnxruntime backend"
        )
        self.generator = generator
        self.router = router
        batched = generator.io.has(Role.KV_SLOT)
        self.decode_slots = (BatchedSlots if batched else SequentialSlots)(generator, full_batch_size)
        self.batched = self.decode_slots.batched
        self.per_sequence = False  # the prefill program never holds the reply
        self.full_batch_size = full_batch_size
        self.staging: dict[int, dict[str, np.ndarray]] = {}

    def prefill(self, slot: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One chunk of the request in ``slot``, into its own batch-1 prefill cache."""
        if slot not in self.staging:
            self.staging[slot] = self.generator.empty_cache(1)
        return self.generator.step(feeds, self.staging[slot])

    def load(self, slot: int, past: dict[str, np.ndarray]) -> None:
        """The request in ``slot`` prefills from ``past`` (a batch-1 cache)."""
        self.staging[slot] = past

    def cache(self, slot: int) -> None:
        """None: the request's cache moves between programs."""
        return None

    def finish_prefill(self, slot: int) -> None:
        """Copy the request's prefill KV into its decode slot (the prefill/decode hand-off)."""
        past = self.staging.pop(slot)
        self.router.handoffs += 1
        self.router.handoff_bytes += sum(array.nbytes for array in past.values())
        self.decode_slots.load(slot, past)  # a batched cache's row is written in place

    def release(self, slot: int) -> None:
        """A request failed in ``slot`` (mid-prefill): its prefill cache goes with it."""
        self.staging.pop(slot, None)
        self.decode_slots.release(slot)

    def decode(self, tokens: Mapping[int, DecodeRow]) -> tuple[dict[int, np.ndarray], int]:
        """One decode step on the decode program (see the decode slots' ``decode``)."""
        return self.decode_slots.decode(tokens)


def phase_programs(
    program: Any, prefill: Sequence[Mapping[str, int]], decode: Sequence[Mapping[str, int]]
) -> PhaseRouter:
    """A :class:`PhaseRouter` over one loaded graph, viewed as the two compiled programs.

    On onnxruntime the two programs are the same file: one session serves both, each view
    accepting only its own specializations.
    """
    if not prefill or not decode:
        raise ShapeMismatch("a disaggregated artifact needs prefill and decode specializations")
    return PhaseRouter(program.restricted(prefill), program.restricted(decode))
