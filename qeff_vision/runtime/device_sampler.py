"""The host side of the on-device sampler: what each call feeds it and what it returns.

A language program exported with ``compile.language.sampler`` (:mod:`qeff_vision.contract.sampler_io`)
returns ``next_tokens`` instead of logits. Per call the host feeds, for each row, its request's
sampling parameters (:class:`~qeff_vision.inputs.sampling_params.SamplingParams`, vLLM's names, as
QEfficient's inputs: ``temperatures``, ``top_ks``, ``top_ps``, ``min_ps``,
``repetition_penalties``, ``presence_penalties``), ``random_numbers`` drawn from the request's
own seeded generator (so a request's tokens depend on its seed only, whatever shares its steps),
and ``last_accepted_output_tokens`` (the call's token ids, as QEfficient's generation feeds it).
The penalty buffers live on the device; for a program run on the host (onnxruntime) they are
part of the call's state beside the KV cache (:meth:`ProgramSampler.empty_buffers`, so a
disaggregated hand-off copies them too). The program starts a slot's repetition buffer afresh
when a request's prompt starts there (position 0) and clears its presence buffer on every
prefill chunk, so a reused slot keeps nothing of its previous occupant; a turn resuming a kept
prefix in its slot adds to the repetition buffer (the prefix is part of its prompt).

Feeding conventions (QEfficient's sampler has no "all tokens" top-k): ``top_k`` 0 or -1 is fed
as ``max_top_k_ids``, a larger one is clipped to it; a greedy request (temperature below vLLM's
epsilon) is fed temperature 0; an idle row greedy with neutral parameters.

The host copy of QEfficient's sampler math that the tests hold the graph to (same random
numbers, same token) is ``tests/gumbel_max.py``; the drivers of a program by hand are
``tests/sampler_harness.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.contract.sampler_io import (
    LAST_ACCEPTED_OUTPUT_TOKENS,
    MIN_PS,
    NEXT_TOKENS,
    PRESENCE_PENALTIES,
    RANDOM_NUMBERS,
    REPETITION_PENALTIES,
    TEMPERATURES,
    TOKEN_BITMASKS,
    TOP_KS,
    TOP_PS,
    SamplerOptions,
)
from qeff_vision.inputs.sampling_params import GREEDY, SamplingParams

# Uniform draws stay inside (0, 1): -log(-log(u)) is finite at both ends.
UNIFORM_LOW, UNIFORM_HIGH = np.float32(2.0**-24), np.float32(1 - 2.0**-24)


def top_k_fed(top_k: int, max_top_k_ids: int) -> int:
    """The ``top_ks`` value of a request's ``top_k`` (0 or -1: all, i.e. ``max_top_k_ids``)."""
    return max_top_k_ids if top_k <= 0 else min(top_k, max_top_k_ids)


def parameter_row(params: SamplingParams, max_top_k_ids: int) -> dict[str, float]:
    """One row of the sampler's parameter inputs for ``params``."""
    return {
        REPETITION_PENALTIES: params.repetition_penalty,
        PRESENCE_PENALTIES: params.presence_penalty,
        TEMPERATURES: 0.0 if params.greedy else params.temperature,
        TOP_KS: top_k_fed(params.top_k, max_top_k_ids),
        TOP_PS: params.top_p,
        MIN_PS: params.min_p,
    }


class RequestDraws:
    """One request's random numbers: ``max_top_k_ids`` uniforms per step from its seeded generator."""

    def __init__(self, params: SamplingParams, max_top_k_ids: int, *, used: bool = True):
        self.params, self.max_top_k_ids = params, max_top_k_ids
        self._rng = np.random.default_rng(params.seed) if used else None

    def next(self) -> np.ndarray:
        """This step's [max_top_k_ids] float32 uniforms (0.5s when never read: greedy, or unused)."""
        if self.params.greedy or self._rng is None:
            return np.full(self.max_top_k_ids, 0.5, dtype=np.float32)
        return np.clip(self._rng.random(self.max_top_k_ids, dtype=np.float32), UNIFORM_LOW, UNIFORM_HIGH)


def used_draws(draws: RequestDraws | None, used: bool) -> RequestDraws | None:
    """``draws`` for a call whose token is used, else the request's row that takes no draw (None stays).

    A call whose token nobody reads (a prefill chunk before the last, a replayed history token) is
    fed the request's parameters and constant numbers, and its generator is not advanced: a
    request's sampled tokens depend on its seed only, not on how many calls its prompt took.
    """
    return draws if draws is None or used else RequestDraws(draws.params, draws.max_top_k_ids, used=False)


def sampler_inputs(
    io: LanguageIO,
    options: SamplerOptions,
    vocab_size: int,
    input_ids: np.ndarray,
    rows: Sequence[RequestDraws | None],
) -> dict[str, np.ndarray]:
    """The sampler inputs of one call: each row's request's parameters and this step's draws.

    Args:
        io: The program's table (with the sampler's rows).
        options: The sampler's options (``max_top_k_ids`` sizes ``random_numbers``).
        vocab_size: The vocabulary (sizes ``token_bitmasks`` with guided decoding).
        input_ids: [rows, seq] the call's token ids (``last_accepted_output_tokens``).
        rows: Each row's request draws (one step is taken from each), None for an idle row
            (greedy, neutral parameters).
    """
    k = options.max_top_k_ids
    idle = np.full(k, 0.5, dtype=np.float32)
    values = [parameter_row(row.params if row is not None else GREEDY, k) for row in rows]
    draws = [row.next() if row is not None else idle for row in rows]
    feeds = {LAST_ACCEPTED_OUTPUT_TOKENS: np.ascontiguousarray(input_ids, dtype=np.int64)}
    for row in io.rows(Role.SAMPLING_PARAMETER):
        dtype = np.int32 if row.name == TOP_KS else np.float32
        feeds[row.name] = np.array([[value[row.name]] for value in values], dtype=dtype)
    feeds[RANDOM_NUMBERS] = np.stack(draws).astype(np.float32)
    if io.has(Role.TOKEN_BITMASK):  # no grammar: every token allowed
        feeds[TOKEN_BITMASKS] = np.ones((len(rows), vocab_size), dtype=bool)
    return feeds


class ProgramSampler:
    """The runtime's view of a language program compiled with the sampler (None without one).

    It holds nothing per request or per call: a request's parameters and seeded generator are
    its :class:`RequestDraws`, made by :meth:`draws` and kept in its request state; each call's
    feeds name the draws of its rows (:meth:`with_inputs`). For a program whose state the host
    keeps, the penalty buffers are slot state beside the KV cache (:meth:`empty_buffers`), so the
    slots hold, hand off and restore them as they do the KV. :func:`last_rows` / :func:`pick`
    read the token where the host read logits before.

    Args:
        io: The program's table with the sampler's rows.
        options: The sampler's options, as read from the graph (:func:`program_sampler`).
        vocab_size: The vocabulary.
    """

    def __init__(self, io: LanguageIO, options: SamplerOptions, vocab_size: int):
        self.io, self.options, self.vocab_size = io, options, vocab_size

    def draws(self, params: SamplingParams | None) -> RequestDraws:
        """A new request's parameters and its generator seeded from its ``seed``."""
        return RequestDraws(params or GREEDY, self.options.max_top_k_ids)

    def empty_buffers(self, slots: int) -> dict[str, np.ndarray]:
        """Zeroed penalty buffers of ``slots`` rows (host-kept state: the backend's ``host_state``)."""
        rows = self.io.rows(Role.PENALTY_BUFFER)
        return {row.name: np.zeros((slots, self.vocab_size), dtype=bool) for row in rows}

    def with_inputs(
        self, feeds: Mapping[str, np.ndarray], rows: Sequence[RequestDraws | None]
    ) -> dict[str, np.ndarray]:
        """``feeds`` plus the sampler's inputs, row ``i`` for ``rows[i]`` (None: an idle row)."""
        token_ids = feeds[self.io.name(Role.TOKEN_IDS)]
        return {**feeds, **sampler_inputs(self.io, self.options, self.vocab_size, token_ids, rows)}


def program_sampler(
    io: LanguageIO,
    input_dims: Mapping[str, Sequence],
    output_names: Sequence[str],
    vocab_size: int,
) -> tuple[LanguageIO, ProgramSampler | None]:
    """(the table, its hook) for a compiled language program read from its graph's IO.

    A program with a ``random_numbers`` input was compiled with the sampler: its options are read
    back (``max_top_k_ids`` from that input's width, ``return_pdfs`` from a ``probs`` output,
    guided decoding from a ``token_bitmasks`` input) and ``io`` gains the sampler's rows.
    """
    from qeff_vision.contract.sampler_io import PROBS, with_sampler

    if RANDOM_NUMBERS not in input_dims:
        return io, None
    width = input_dims[RANDOM_NUMBERS][-1]
    options = SamplerOptions(
        max_top_k_ids=int(width) if isinstance(width, int) else SamplerOptions().max_top_k_ids,
        return_pdfs=PROBS in output_names,
        guided_decoding=TOKEN_BITMASKS in input_dims,
    )
    sampled = with_sampler(io, options)
    return sampled, ProgramSampler(sampled, options, vocab_size)


def last_rows(outputs: Mapping[str, np.ndarray], logits_name: str | None) -> np.ndarray:
    """What the host chooses from per row: the device's token ([rows]) or the last position's logits."""
    if logits_name is None:  # a sampler program: next_tokens [rows, 1, 1]
        return np.asarray(outputs[NEXT_TOKENS])[:, -1, 0]
    return outputs[logits_name][:, -1]


def pick(sampler, row: np.ndarray) -> int:
    """The token of one row of :func:`last_rows`: the device's own, or ``sampler``'s choice from logits.

    A sampler whose ``reads_logits`` is False (a fixed continuation) is not given the row: a
    deferred program's logits are then never computed on the host's demand.
    """
    if not getattr(sampler, "reads_logits", True):
        return sampler.next_token(row)
    row = np.asarray(row)
    return int(row) if row.ndim == 0 else sampler.next_token(row)
