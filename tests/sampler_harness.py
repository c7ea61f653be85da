"""A continuous-batching program with the on-device sampler run beside the same program without it.

:class:`LockstepSlots` runs both exports of one tiny checkpoint on onnxruntime with the same feeds,
each with its own ``full_batch_size``-slot caches: the plain program's logits are what the host
sampler sees, the sampler program's ``next_tokens`` what the device returns, so a test compares
the two on every call. The sampler program's penalty buffers are kept on the host
(:class:`HostPenaltyBuffers`) and its inputs built by :class:`DeviceSampler` from each slot's
request (the runtime keeps a request's draws in its request state instead; these drive a
program's calls by hand).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.contract.sampler_io import NEXT_TOKENS, SamplerOptions, with_sampler
from qeff_vision.inputs.sampling_params import GREEDY, SamplingParams
from qeff_vision.runtime.device_sampler import RequestDraws, sampler_inputs
from qeff_vision.runtime.generate import Generator
from tests.cb_harness import SlotCaches


class DeviceSampler:
    """Sampler feeds of a program driven by hand, from the request admitted to each slot.

    Args:
        io: The program's table (with the sampler's rows).
        options: The sampler's options (``max_top_k_ids`` sizes ``random_numbers``).
        vocab_size: The vocabulary (sizes ``token_bitmasks`` with guided decoding).
    """

    def __init__(self, io: LanguageIO, options: SamplerOptions, vocab_size: int):
        self.io, self.options, self.vocab_size = io, options, vocab_size
        self.next_tokens_name = io.name(Role.NEXT_TOKENS, output=True)
        self._requests: dict[int, RequestDraws] = {}

    def admit(self, slot: int, params: SamplingParams | None) -> None:
        """A request takes ``slot``: its parameters and a generator seeded from its ``seed``."""
        self._requests[slot] = RequestDraws(params or GREEDY, self.options.max_top_k_ids)

    def feeds(self, input_ids: np.ndarray, row_slots: Sequence[int | None]) -> dict[str, np.ndarray]:
        """The sampler inputs of one call.

        Args:
            input_ids: [rows, seq] the call's token ids (``last_accepted_output_tokens``).
            row_slots: Each row's slot, None for an idle row (greedy, neutral parameters).
        """
        rows = [self._requests.get(slot) if slot is not None else None for slot in row_slots]
        return sampler_inputs(self.io, self.options, self.vocab_size, input_ids, rows)

    def tokens(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """[rows] the token each row's call returned."""
        return np.asarray(outputs[self.next_tokens_name])[:, -1, 0].astype(np.int64)


class HostPenaltyBuffers:
    """The penalty buffers of a program that keeps no state itself (onnxruntime), per slot.

    Args:
        io: The program's table (with the sampler's rows).
        slots: Slots (``full_batch_size``, or the batch).
        vocab_size: The vocabulary.
    """

    def __init__(self, io: LanguageIO, slots: int, vocab_size: int):
        self.rows = io.rows(Role.PENALTY_BUFFER)
        self.buffers = {row.name: np.zeros((slots, vocab_size), dtype=bool) for row in self.rows}

    def feeds(self) -> dict[str, np.ndarray]:
        """The buffers as inputs of the next call."""
        return dict(self.buffers)

    def update(self, outputs: Mapping[str, np.ndarray]) -> None:
        """Keep the buffers a call returned."""
        for row in self.rows:
            self.buffers[row.name] = np.asarray(outputs[row.retained])

    def reset(self, slot: int) -> None:
        """Clear ``slot`` for a new request."""
        for buffer in self.buffers.values():
            buffer[slot] = False


class LockstepSlots(SlotCaches):
    """:class:`SlotCaches` for the plain program, with the sampler program run beside it on each call.

    ``run`` returns the plain program's outputs plus the sampler program's ``next_tokens``; the
    last call's sampler feeds and returned penalty buffers are kept for inspection.
    """

    def __init__(self, generator: Generator, full_batch_size: int, sampled, options: SamplerOptions):
        super().__init__(generator, full_batch_size)
        self.sampled = sampled
        self.sampled_caches = SlotCaches(generator, full_batch_size)
        self.io = with_sampler(generator.io, options)
        vocab = generator.dims.vocab_size
        self.device = DeviceSampler(self.io, options, vocab)
        self.penalties = HostPenaltyBuffers(self.io, full_batch_size, vocab)
        self.last_feeds: dict[str, np.ndarray] = {}
        self.last_tokens = np.zeros(0, dtype=np.int64)

    def run(self, program, feeds: Mapping[str, np.ndarray], batch_index: np.ndarray) -> dict[str, np.ndarray]:
        """One call of both programs; rows with no valid position are idle (no request's draws)."""
        outputs = super().run(program, feeds, batch_index)
        positions = feeds[symbols.POSITION_IDS]
        text = positions if positions.ndim == 2 else positions[0]
        row_slots = [int(slot) if (row >= 0).any() else None for slot, row in zip(batch_index[:, 0], text)]
        self.last_feeds = self.device.feeds(feeds[symbols.INPUT_IDS], row_slots)
        sampled = self.sampled_caches.run(
            self.sampled, {**feeds, **self.last_feeds, **self.penalties.feeds()}, batch_index
        )
        self.penalties.update(sampled)
        self.last_tokens = self.device.tokens(sampled)
        return {**outputs, NEXT_TOKENS: sampled[NEXT_TOKENS]}
