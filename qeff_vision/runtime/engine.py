"""The engine: the one prefill loop and the one decode loop, for every request of every deployment.

The host step of docs/design.md "Continuous batching protocol", scheduled by
:class:`~qeff_vision.runtime.scheduler.Scheduler`: each step admits arrived requests into free
slots, runs one prefilling request's next chunk (batch 1, into its slot) and one decode call for
every running request. A request is a :class:`~qeff_vision.runtime.request_state.RequestState`;
how image information reaches the language program is its decoder kind's runner
(:class:`~qeff_vision.runtime.sequence_runner.SequenceRunner`: the calls of each chunk, the extra
inputs of each decode step); where request state lives is the deployment's slots
(:mod:`qeff_vision.runtime.slots`). Images come from one
:class:`~qeff_vision.runtime.embedding_cache.EmbeddingCache` shared by all requests (an image two
requests show is encoded once).

A lone request (:meth:`BatchedEngine.generate`, what ``Generator.generate`` and ``run --prompt``
run) is a batch of one in slot 0: on a program compiled for ``full_batch_size`` F > 1 it decodes
in calls at batch F whose other rows are idle, the shapes the program was compiled for
(:func:`compiled_slots`); at F = 1 its slot is one host cache, which a conversation's next turn
continues from (a kept prefix, or a ``history``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.continuation import Continuation
from qeff_vision.runtime.device_sampler import last_rows, used_draws
from qeff_vision.runtime.planner import ChunkEnd, VisionProtocol
from qeff_vision.runtime.request_state import EngineRequest, RequestState
from qeff_vision.runtime.results import ChunkRecord, GenerationResult
from qeff_vision.runtime.scheduler import Scheduler, StepPlan
from qeff_vision.runtime.sequence_runner import SequenceRunner
from qeff_vision.runtime.slots import SequentialSlots

__all__ = ["BatchedEngine", "EngineReport", "EngineRequest", "RequestResult", "compiled_slots"]


@dataclass
class RequestResult:
    """One request's generation and where the schedule put it.

    Attributes:
        number: The request's index in the list given to :meth:`BatchedEngine.run`.
        arrival_step: When it arrived.
        slot: The KV slot it held.
        admitted_step: When it took the slot.
        first_token_step: When its last prefill chunk produced the first token.
        finished_step: When it freed the slot.
        result: Tokens, chunks and timings as a lone :meth:`Generator.generate` reports them;
            ``ttft`` counts from the arrival (queueing included), ``decode_seconds`` from the
            first token to the last.
        decode_batches: Requests served by each decode call this request was part of.
        error: Why the request failed (one line), None when it completed. A failed request
            freed its slot where it failed; the others were served on.
    """

    number: int
    arrival_step: int
    slot: int
    admitted_step: int
    first_token_step: int
    finished_step: int
    result: GenerationResult
    decode_batches: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def failed(self) -> bool:
        """True when the request failed before completing (see :attr:`error`)."""
        return self.error is not None

    @property
    def mean_occupancy(self) -> float:
        """Mean requests per decode call over this request's decode steps (0 without any)."""
        return sum(self.decode_batches) / len(self.decode_batches) if self.decode_batches else 0.0


@dataclass
class EngineReport:
    """A whole run: per-request results and the engine's totals.

    Attributes:
        requests: One result per request, in the order given.
        full_batch_size: Slots.
        steps: Engine steps that ran a call.
        decode_batches: Requests served by each decode call, in order.
        decode_seconds: Wall time of the decode steps: the host's work for the step (positions,
            feeds, the token choice per request) and the call(s); prefill chunks are not counted.
        decode_step_seconds: Wall time of each decode step (``decode_batches`` gives its requests).
        prefill_calls: Prefill chunks run.
        vision_bytes: ``vision_embeds`` bytes sent by every call (prefill chunks and decode steps).
        encoder_calls: Vision-program calls over the run.
        batched: Whether one call served a whole decode step
            (:class:`~qeff_vision.runtime.slots.BatchedSlots`).
    """

    requests: list[RequestResult]
    full_batch_size: int
    steps: int = 0
    decode_batches: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    decode_step_seconds: list[float] = field(default_factory=list)
    prefill_calls: int = 0
    vision_bytes: int = 0
    encoder_calls: int = 0
    batched: bool = False

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens produced by decode steps per second of decode steps.

        A request's first token comes from its last prefill chunk: neither it nor any prefill time
        is counted.
        """
        return sum(self.decode_batches) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_occupancy(self) -> float:
        """Mean fraction of the slots a decode call served."""
        if not self.decode_batches:
            return 0.0
        return sum(self.decode_batches) / (len(self.decode_batches) * self.full_batch_size)


class BatchedEngine:
    """Runs requests arriving at different steps through shared KV slots (see the module docstring).

    Args:
        generator: The decoder kind's runner; the engine uses its planning, image encoding, feeds
            and embedding cache, so every request is fed as it would be alone.
        full_batch_size: Slots. For a continuous-batching program, its ``full_batch_size`` (read
            from the compiled specializations when None); otherwise 1 unless given.
        protocol: Vision protocol of every request (``chunk`` or ``full``).
        one_sequence: The engine of a runner's lone requests: at one slot it is a host cache per
            sequence whatever the mode, so a conversation continues from it.
    """

    def __init__(
        self,
        generator: SequenceRunner,
        full_batch_size: int | None = None,
        protocol: str = VisionProtocol.CHUNK.value,
        *,
        one_sequence: bool = False,
    ):
        self.generator = generator
        self.protocol = protocol
        if full_batch_size is None and generator.io.has(Role.KV_SLOT):  # the program takes batch_index
            values = sorted(_full_batch_sizes(generator))
            if len(values) != 1:
                found = f"several full_batch_size values {values}" if values else "no full_batch_size"
                raise UserError(f"the language program's specializations record {found}")
            full_batch_size = values[0]
        full_batch_size = 1 if full_batch_size is None else full_batch_size
        if full_batch_size < 1:
            raise UserError(f"full_batch_size must be at least 1, got {full_batch_size}")
        if one_sequence and full_batch_size == 1:
            self.slots = SequentialSlots(generator, 1)
        else:  # where the requests' state lives is the deployment's answer
            self.slots = generator.deployment.engine_slots(generator, full_batch_size)

    @property
    def full_batch_size(self) -> int:
        """Slots."""
        return self.slots.full_batch_size

    def run(
        self,
        requests: Sequence[EngineRequest],
        *,
        keep_logits: bool = False,
        on_finish: Callable[[RequestResult], None] | None = None,
    ) -> EngineReport:
        """Serve ``requests`` to completion.

        Args:
            requests: The requests, each with its arrival step.
            keep_logits: Keep every step's logits row per request (parity checks).
            on_finish: Called with each request's result as soon as it frees its slot.

        Raises:
            UserError: A request does not fit ``ctx_len`` or the buckets (checked for every
                request before any call), or a shape was not compiled.
        """
        return self._serve(requests, keep_logits, on_finish, lone=False)

    def generate(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int = 32,
        protocol: str | None = None,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        sampling: SamplingParams | None = None,
        *,
        history: Continuation | None = None,
        keep_prefix: bool = False,
    ) -> GenerationResult:
        """One request alone: a batch of one, in slot 0 (the lowest free slot).

        Its prefill chunks are batch-1 calls into slot 0 and its decode steps calls at batch
        ``full_batch_size`` with the other rows idle, as :meth:`run` serves any request. It
        starts from a fresh cache, the prefix the program holds (``keep_prefix``, a cache per
        sequence only) or ``history``'s, and its result's ``continuation`` is where it stopped
        (a cache per sequence only).

        Args:
            processed: Processor outputs as numpy arrays.
            max_new_tokens: Upper bound of generated tokens.
            protocol: ``chunk`` or ``full`` (the engine's when None).
            on_token: Called with each token id as soon as it is known (streaming).
            keep_logits: Keep each step's logits row in the result.
            sampling: How tokens are chosen (greedy when None).
            history: A previous result's ``continuation`` to run after (consumed).
            keep_prefix: ``processed`` is the whole conversation: prefill only what follows the
                prefix the program holds (:mod:`~qeff_vision.runtime.kept_prefix`).

        Raises:
            UserError: The prompt does not fit ``ctx_len`` or the buckets, or a shape was not compiled.
        """
        keep = keep_prefix and self.slots.per_sequence
        request = EngineRequest(processed, max_new_tokens, 0, on_token, protocol, sampling, history, keep)
        (done,) = self._serve([request], keep_logits, None, lone=True).requests
        return done.result

    def _serve(
        self,
        requests: Sequence[EngineRequest],
        keep_logits: bool,
        on_finish: Callable[[RequestResult], None] | None,
        lone: bool,
    ) -> EngineReport:
        """:meth:`run`; ``lone``: one request from a fresh (or kept) cache, its errors unnumbered."""
        generator = self.generator
        started = time.perf_counter()
        vision_calls = generator.vision.calls
        states: list[RequestState | None] = []
        for number, request in enumerate(requests):
            try:
                states.append(RequestState(number, request, generator, self.protocol))
            except UserError as exc:
                raise UserError(str(exc) if lone else f"request {number}: {exc}") from None
        if lone:
            states[0].arrived_at = started
            states[0].initial = generator.initial_cache(states[0])
        scheduler = Scheduler([r.arrival_step for r in requests], self.full_batch_size)
        report = EngineReport([], self.full_batch_size, batched=self.slots.batched)
        results: dict[int, RequestResult] = {}
        while not scheduler.done:
            step = scheduler.plan_step()
            now = time.perf_counter()
            for state in states:
                if state is not None and not state.arrived_at and state.request.arrival_step <= step.step:
                    state.arrived_at = now
            failed: dict[int, str] = {}
            for number, slot in step.admitted:
                try:
                    self._admit(states[number], slot, step.step)
                except Exception as exc:  # noqa: BLE001 - one request's failure, see _failure
                    failed[number] = self._failure(states[number], exc, lone)
            finished = []
            if step.prefill is not None and step.prefill not in failed:
                try:
                    complete = self._prefill(states[step.prefill], step, report, keep_logits)
                except Exception as exc:  # noqa: BLE001 - one request's failure, see _failure
                    failed[step.prefill] = self._failure(states[step.prefill], exc, lone)
                else:
                    if complete is not None:  # the prompt's last chunk ran
                        scheduler.prefill_finished(step.prefill)
                    if complete:
                        finished.append(step.prefill)
            for number, error in failed.items():
                scheduler.finish(number)
                results[number] = self._failed_result(states[number], step.step, error)
                states[number] = None  # nothing of a finished request stays with the engine
                if on_finish:
                    on_finish(results[number])
            if step.decode:
                finished += self._decode([states[n] for n in step.decode], report, keep_logits)
            if step.prefill is not None or step.decode:
                report.steps += 1
            for number in finished:
                scheduler.finish(number)
                results[number] = self._result(states[number], step.step)
                states[number] = None  # its prompt arrays, chunk plan and caches go now, not at the end
                if on_finish:
                    on_finish(results[number])
            scheduler.advance()
        report.requests = [results[n] for n in range(len(requests))]
        report.encoder_calls = generator.vision.calls - vision_calls
        return report

    def _failure(self, state: RequestState, exc: Exception, lone: bool) -> str:
        """One request failed mid-prefill (an image refused when prepared, a device call's error).

        A lone request's error is the caller's (raised as it is). Among many, the request's slot
        is released (its prefill cache, its pinned images) and the engine serves the others; the
        error becomes the request's one-line report.
        """
        if lone:
            raise exc
        if state.chunks is not None:
            state.chunks.close()  # unpins the images its chunks held
        if state.slot >= 0:
            self.slots.release(state.slot)
        text = str(exc).strip().splitlines()
        return text[0] if text else type(exc).__name__

    def _failed_result(self, state: RequestState, step: int, error: str) -> RequestResult:
        result = GenerationResult(
            prompt_tokens=len(state.input_ids),
            tokens=[],
            chunks=state.records,
            ttft=0.0,
            decode_seconds=0.0,
            encoder_calls=state.encoder_calls,
            cache_hits=state.cache_hits,
            protocol=state.plan.protocol.value,
            images_encoded=state.images_encoded,
            vision_input=self.generator.vision_input,
            ccl_history=state.ccl_history,
        )
        return RequestResult(
            number=state.number,
            arrival_step=state.request.arrival_step,
            slot=state.slot,
            admitted_step=state.admitted_step,
            first_token_step=-1,
            finished_step=step,
            result=result,
            error=error,
        )

    def _admit(self, state: RequestState, slot: int, step: int) -> None:
        """Give ``state`` its slot and cache; a history's unfed tokens are fed there first."""
        state.slot, state.admitted_step = slot, step
        if state.initial is not None:
            self.slots.load(slot, state.initial)
        history = state.history
        if history is not None:
            host = self.generator.host
            for steps, token in enumerate(history.unfed, start=history.fed_steps):
                position = host.decode_positions(history.positions, steps)
                # A replayed token's output is discarded: it takes no draw of the request's.
                draws = used_draws(state.draws, used=False)
                self.slots.decode({slot: (token, position, history.decode_feeds, draws)})
                state.called(self.generator.ccl_at(True, [position]))
        # Images are prepared now and encoded when a chunk first needs them.
        state.chunks = self.generator.request_chunks(state)

    def _prefill(
        self, state: RequestState, step: StepPlan, report: EngineReport, keep_logits: bool
    ) -> bool | None:
        """Run the request's next chunk: None when chunks remain, else whether the request is complete."""
        generator = self.generator
        calls, stats, encode_before = generator.vision.calls, generator.cache.stats, state.encode_timer[0]
        call = next(state.chunks)
        after = generator.cache.stats
        chunk = call.chunk
        state.encoder_calls += generator.vision.calls - calls
        state.cache_hits += after.hits - stats.hits
        encoded = after.images_encoded - stats.images_encoded
        encoded = encoded if call.images_encoded is None else call.images_encoded
        state.images_encoded += encoded
        started = time.perf_counter()
        # Only the last chunk's token is used, so only it takes a draw: the request's sampled
        # tokens do not depend on how many chunks its prompt took (the bucket set).
        draws = used_draws(state.draws, used=chunk.index == len(state.plan.chunks) - 1)
        if chunk.end is ChunkEnd.DECODE_SHAPED:
            # Past the last prefill CCL: the token is a decode row of the request's slot (at
            # full_batch_size on a continuous-batching program, its other rows idle).
            token = int(call.feeds[generator.io.name(Role.TOKEN_IDS)][0, 0])
            positions = call.feeds[generator.io.name(Role.POSITIONS)]
            rows, _ = self.slots.decode({state.slot: (token, positions, state.decode_extra, draws)})
            row = rows[state.slot]
            state.called(generator.ccl_at(True, [positions]))
        else:
            for feeds in call.before:
                self.slots.prefill(state.slot, feeds)
                state.called(generator.call_ccl(feeds))
            # The on-device sampler's inputs (if any) are this request's: a chunk is one row.
            outputs = self.slots.prefill(state.slot, generator.with_sampler_inputs(call.feeds, [draws]))
            state.called(generator.call_ccl(call.feeds))
            generator.check_chunk_outputs(chunk, outputs)
            row = last_rows(outputs, generator.logits_name)[0]  # logits, or the device's token
        state.records.append(
            ChunkRecord(
                tokens=chunk.tokens,
                seq_len=chunk.seq_len,
                vision_size=chunk.vision_size,
                rows=chunk.rows,
                vision_bytes=call.vision_bytes,
                seconds=time.perf_counter() - started,
                encode_seconds=state.encode_timer[0] - encode_before,
                images_encoded=encoded,
                start=state.start + chunk.start,
            )
        )
        report.prefill_calls += 1
        report.vision_bytes += call.vision_bytes
        if chunk.index < len(state.plan.chunks) - 1:
            return None
        state.chunks.close()  # unpins the images the last chunk sent
        generator.prefill_done(state, self.slots.cache(state.slot))
        # Disaggregated: the prefill's KV moves to the decode program's slot (a no-op otherwise).
        self.slots.finish_prefill(state.slot)
        state.first_token_step = step.step
        return state.emit(row, keep_logits, generator.eos_token_ids)

    def _decode(self, running: list[RequestState], report: EngineReport, keep_logits: bool) -> list[int]:
        """One token for every running request; the numbers of those now complete."""
        started = time.perf_counter()
        host = self.generator.host
        tokens = {
            state.slot: (state.tokens[-1], state.next_positions(host), state.decode_extra, state.draws)
            for state in running
        }
        logits, sent = self.slots.decode(tokens)
        # One call serves every row of a batched cache (its length covers them all), else one
        # call per slot.
        together = [row[1] for row in tokens.values()]
        for state in running:
            state.called(
                self.generator.ccl_at(True, together if self.slots.batched else [tokens[state.slot][1]])
            )
        report.decode_batches.append(len(running))
        report.vision_bytes += sent
        finished = []
        for state in running:
            state.decode_batches.append(len(running))
            if state.emit(logits[state.slot], keep_logits, self.generator.eos_token_ids):
                finished.append(state.number)
        elapsed = time.perf_counter() - started
        report.decode_seconds += elapsed
        report.decode_step_seconds.append(elapsed)
        return finished

    def _result(self, state: RequestState, step: int) -> RequestResult:
        generator, tokens = self.generator, state.tokens
        # A lone request's slot cache is its own: where a later turn continues.
        cache = self.slots.cache(state.slot) if state.initial is not None else None
        continuation = None
        if cache is not None:
            continuation = Continuation(
                cache, state.positions, len(tokens) - 1, (tokens[-1],), dict(state.decode_extra)
            )
        images, rows = generator.request_images(state)
        result = GenerationResult(
            prompt_tokens=len(state.input_ids),
            tokens=tokens,
            chunks=state.records,
            ttft=state.first_token_at - state.arrived_at,
            decode_seconds=state.last_token_at - state.first_token_at,
            encoder_calls=state.encoder_calls,
            cache_hits=state.cache_hits,
            logits=state.logits,
            protocol=state.plan.protocol.value,
            images=images,
            image_rows=rows,
            images_encoded=state.images_encoded,
            vision_input=generator.vision_input,
            continuation=continuation,
            ccl_history=state.ccl_history,
        )
        return RequestResult(
            number=state.number,
            arrival_step=state.request.arrival_step,
            slot=state.slot,
            admitted_step=state.admitted_step,
            first_token_step=state.first_token_step,
            finished_step=step,
            result=generator.finish(state, result),
            decode_batches=state.decode_batches,
        )


def compiled_slots(generator: SequenceRunner) -> int:
    """Slots a lone sequence must run among: the compiled ``full_batch_size`` of the decoding program.

    1 for a program without ``batch_index`` or without a recorded ``full_batch_size`` (a bare
    export runs a sequence at batch 1). Above 1, the program decodes only at batch
    ``full_batch_size``: one request runs as a batch of one through :class:`BatchedEngine`.
    """
    return max(_full_batch_sizes(generator), default=1) if generator.io.has(Role.KV_SLOT) else 1


def _full_batch_sizes(generator: SequenceRunner) -> set[int]:
    """The ``full_batch_size`` values of the decoding program (a disaggregated pair's decode program)."""
    key = symbols.FULL_BATCH_SIZE
    specializations = generator.deployment.decode_specializations(generator.language) or ()
    return {int(entry[key]) for entry in specializations if key in entry}
