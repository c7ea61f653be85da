"""A continuous-batching program with the on-device sampler run beside the same program without it.

:class:`LockstepSlots` runs both exports of one tiny checkpoint on onnxruntime with the same feeds,
each with its own ``full_batch_size``-slot caches: the plain program's logits are what the host
sampler sees, the sampler program's ``next_tokens`` what the device returns, so a test compares
the two on every call. The sampler program's penalty buffers are kept on the host
(:class:`~qeff_vision.runtime.device_sampler.HostPenaltyBuffers`) and its inputs built by
:class:`~qeff_vision.runtime.device_sampler.DeviceSampler` from each slot's request.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.sampler_io import NEXT_TOKENS, SamplerOptions, with_sampler
from qeff_vision.runtime.device_sampler import DeviceSampler, HostPenaltyBuffers
from qeff_vision.runtime.generate import Generator
from tests.cb_harness import SlotCaches


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
