"""Batched engine: several requests share the language program's KV slots (continuous batching).

The host step of docs/design.md "Continuous batching protocol", scheduled by
:class:`~qeff_vision.runtime.scheduler.Scheduler`: each step admits arrived requests into free
slots, runs one prefilling request's next chunk (batch 1, into its slot) and one decode call for
every running request. Each request is planned, encoded and fed exactly as
:class:`~qeff_vision.runtime.generator.Generator` does it alone (same chunk plan, same positions,
same chunk-local vision rows), so its tokens are the single-sequence ones; images come from one
:class:`~qeff_vision.runtime.embedding_cache.EmbeddingCache` shared by all requests (an image two
requests show is encoded once).

The slots themselves (one batched cache, or one host cache per slot) are held by
:mod:`qeff_vision.runtime.slots`.

A lone request on a program compiled for ``full_batch_size`` F > 1 (``run --prompt`` on a
continuous-batching artifact, what vLLM sends whenever one sequence is running) is a batch of one
(:meth:`BatchedEngine.generate`): it takes slot 0 and decodes in calls at batch F whose other rows
are idle, the shapes the program was compiled for (:func:`compiled_slots`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.runtime.deployment import deployment_of
from qeff_vision.runtime.device_sampler import last_rows, pick
from qeff_vision.runtime.planner import Chunk, ChunkPlan, VisionProtocol
from qeff_vision.runtime.results import ChunkRecord, GenerationResult
from qeff_vision.runtime.sampling import SamplingParams, TokenSampler
from qeff_vision.runtime.scheduler import Scheduler, StepPlan
from qeff_vision.runtime.sequence_runner import SequenceRunner


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine.

    Attributes:
        processed: Processor outputs as numpy arrays (what :meth:`Generator.generate` takes).
        max_new_tokens: Upper bound of generated tokens.
        arrival_step: The engine step at which the request arrives.
        on_token: Called with each token id as soon as it is known (streaming).
        protocol: Its vision protocol (``chunk`` or ``full``); the engine's when None.
        sampling: How its tokens are chosen (greedy when None); its own random generator, so its
            tokens do not depend on the requests it shares steps with.
    """

    processed: Mapping[str, Any]
    max_new_tokens: int = 32
    arrival_step: int = 0
    on_token: Callable[[int], None] | None = None
    protocol: str | None = None
    sampling: SamplingParams | None = None


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
    """

    number: int
    arrival_step: int
    slot: int
    admitted_step: int
    first_token_step: int
    finished_step: int
    result: GenerationResult
    decode_batches: list[int] = field(default_factory=list)

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


class _Sequence:
    """A request's host state while it runs (plan, positions, chunk feed, tokens, timings)."""

    def __init__(self, number: int, request: EngineRequest, generator: SequenceRunner, plan: ChunkPlan):
        self.number = number
        self.request = request
        self.plan = plan
        self.input_ids = np.asarray(request.processed["input_ids"], dtype=np.int64).reshape(-1)
        self.positions = generator.host.prompt_positions(request.processed)
        self.chunks: Iterator[tuple[Chunk, dict[str, np.ndarray], int]] | None = None
        self.decode_extra = generator.decode_extra(request.processed)
        self.sampler = TokenSampler(request.sampling, self.input_ids)
        self.encode_timer = [0.0]
        self.slot = -1
        self.admitted_step = self.first_token_step = -1
        self.arrived_at = self.first_token_at = self.last_token_at = 0.0
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []
        self.records: list[ChunkRecord] = []
        self.encoder_calls = self.cache_hits = self.images_encoded = 0
        self.decode_batches: list[int] = []
        self.decode_base: np.ndarray | None = None
        self.affine = False

    def admit(self, generator: SequenceRunner, slot: int, step: int) -> None:
        """Take ``slot``; images are prepared now and encoded when a chunk first needs them."""
        self.slot, self.admitted_step = slot, step
        if generator.device_sampler is not None:  # the slot's sampling inputs
            generator.device_sampler.admit(slot, self.request.sampling)
        self.chunks = generator.request_chunks(
            self.plan, self.request.processed, self.input_ids, self.positions, self.encode_timer
        )

    def next_positions(self, host) -> np.ndarray:
        """Position ids of the token fed next (the last one generated)."""
        step = len(self.tokens) - 1
        if self.decode_base is None:
            self.decode_base = host.decode_positions(self.positions, 0)
            # Hosts advance every position row by one per generated token; checked once, so a host
            # that does not is asked every step.
            self.affine = np.array_equal(host.decode_positions(self.positions, 1), self.decode_base + 1)
        return self.decode_base + step if self.affine else host.decode_positions(self.positions, step)

    def emit(self, logits: np.ndarray, keep_logits: bool, eos: set[int]) -> bool:
        """Choose and record the next token from its logits row; True when the request is complete."""
        token = pick(self.sampler, logits)  # a 0-d row is the on-device sampler's token
        now = time.perf_counter()
        if not self.tokens:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens.append(token)
        if keep_logits and np.ndim(logits):
            self.logits.append(logits.copy())
        if self.request.on_token is not None:
            self.request.on_token(token)
        return token in eos or len(self.tokens) >= self.request.max_new_tokens


class BatchedEngine:
    """Runs requests arriving at different steps through shared KV slots (see the module docstring).

    Args:
        generator: The single-request host of the two programs; the engine uses its planning,
            image encoding, feeds and embedding cache, so every request is fed as it would be alone.
        full_batch_size: Slots. For a continuous-batching program, its ``full_batch_size`` (read
            from the compiled specializations when None); otherwise 1 unless given.
        protocol: Vision protocol of every request (``chunk`` or ``full``).
    """

    def __init__(
        self,
        generator: SequenceRunner,
        full_batch_size: int | None = None,
        protocol: str = VisionProtocol.CHUNK.value,
    ):
        self.generator = generator
        self.protocol = protocol
        batched = generator.io.has(Role.KV_SLOT)  # the program takes batch_index
        if full_batch_size is None:
            full_batch_size = compiled_full_batch_size(_decode_specializations(generator)) if batched else 1
        if full_batch_size < 1:
            raise UserError(f"full_batch_size must be at least 1, got {full_batch_size}")
        # Where the requests' state lives is the deployment's answer (qeff_vision.runtime.deployment).
        self.slots = deployment_of(generator.language).engine_slots(generator, full_batch_size)

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
        return self._serve(requests, keep_logits, on_finish, labelled=True)

    def generate(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int = 32,
        protocol: str | None = None,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """One request alone: a batch of one, in slot 0 (the lowest free slot).

        Its prefill chunks are batch-1 calls into slot 0 and its decode steps calls at batch
        ``full_batch_size`` with the other rows idle, as :meth:`run` serves any request.

        Args:
            processed: Processor outputs as numpy arrays.
            max_new_tokens: Upper bound of generated tokens.
            protocol: ``chunk`` or ``full`` (the engine's when None).
            on_token: Called with each token id as soon as it is known (streaming).
            keep_logits: Keep each step's logits row in the result.
            sampling: How tokens are chosen (greedy when None).

        Raises:
            UserError: The prompt does not fit ``ctx_len`` or the buckets, or a shape was not compiled.
        """
        request = EngineRequest(processed, max_new_tokens, 0, on_token, protocol, sampling)
        (done,) = self._serve([request], keep_logits, None, labelled=False).requests
        return done.result

    def _serve(
        self,
        requests: Sequence[EngineRequest],
        keep_logits: bool,
        on_finish: Callable[[RequestResult], None] | None,
        labelled: bool,
    ) -> EngineReport:
        """:meth:`run`; ``labelled``: a request's error names its number."""
        generator = self.generator
        sequences = []
        vision_calls = generator.vision.calls
        for number, request in enumerate(requests):
            try:
                # A pruning rate encodes the request's clips now: their kept rows shape its prompt.
                request = replace(request, processed=generator.prepare_prompt(request.processed))
                input_ids = np.asarray(request.processed["input_ids"], dtype=np.int64).reshape(-1)
                generator.check_fits(len(input_ids), request.max_new_tokens)
                plan = generator.plan(input_ids, request.processed, request.protocol or self.protocol)
            except UserError as exc:
                raise UserError(f"request {number}: {exc}" if labelled else str(exc)) from None
            sequences.append(_Sequence(number, request, generator, plan))
        scheduler = Scheduler([r.arrival_step for r in requests], self.full_batch_size)
        report = EngineReport([], self.full_batch_size, batched=self.slots.batched)
        results: dict[int, RequestResult] = {}
        while not scheduler.done:
            step = scheduler.plan_step()
            now = time.perf_counter()
            for sequence in sequences:
                if not sequence.arrived_at and sequence.request.arrival_step <= step.step:
                    sequence.arrived_at = now
            for number, slot in step.admitted:
                sequences[number].admit(generator, slot, step.step)
            finished = []
            if step.prefill is not None:
                complete = self._prefill(sequences[step.prefill], step, report, keep_logits)
                if complete is not None:  # the prompt's last chunk ran
                    scheduler.prefill_finished(step.prefill)
                if complete:
                    finished.append(step.prefill)
            if step.decode:
                finished += self._decode([sequences[n] for n in step.decode], step, report, keep_logits)
            if step.prefill is not None or step.decode:
                report.steps += 1
            for number in finished:
                scheduler.finish(number)
                results[number] = self._result(sequences[number], step.step)
                if on_finish:
                    on_finish(results[number])
            scheduler.advance()
        report.requests = [results[n] for n in range(len(requests))]
        report.encoder_calls = generator.vision.calls - vision_calls
        return report

    def _prefill(
        self, sequence: _Sequence, step: StepPlan, report: EngineReport, keep_logits: bool
    ) -> bool | None:
        """Run the sequence's next chunk: None when chunks remain, else whether the request is complete."""
        generator = self.generator
        calls, stats, encode_before = generator.vision.calls, generator.cache.stats, sequence.encode_timer[0]
        chunk, feeds, sent = next(sequence.chunks)
        after = generator.cache.stats
        sequence.encoder_calls += generator.vision.calls - calls
        sequence.cache_hits += after.hits - stats.hits
        sequence.images_encoded += after.images_encoded - stats.images_encoded
        started = time.perf_counter()
        if generator.device_sampler is not None:  # the chunk's sampling inputs are this request's
            generator.device_sampler.focus(sequence.slot)
        outputs = self.slots.prefill(sequence.slot, feeds)
        generator.check_chunk_outputs(chunk, outputs)
        sequence.records.append(
            ChunkRecord(
                tokens=chunk.tokens,
                seq_len=chunk.seq_len,
                vision_size=chunk.vision_size,
                rows=chunk.rows,
                vision_bytes=sent,
                seconds=time.perf_counter() - started,
                encode_seconds=sequence.encode_timer[0] - encode_before,
                images_encoded=after.images_encoded - stats.images_encoded,
                start=chunk.start,
            )
        )
        report.prefill_calls += 1
        report.vision_bytes += sent
        if chunk.index < len(sequence.plan.chunks) - 1:
            return None
        sequence.chunks.close()  # unpins the images the last chunk sent
        # Disaggregated: the prefill's KV moves to the decode program's slot (a no-op otherwise).
        self.slots.finish_prefill(sequence.slot)
        sequence.first_token_step = step.step
        logits = last_rows(outputs, self.generator.logits_name)[0]
        return sequence.emit(logits, keep_logits, self.generator.eos_token_ids)

    def _decode(
        self, running: list[_Sequence], step: StepPlan, report: EngineReport, keep_logits: bool
    ) -> list[int]:
        """One token for every running request; the numbers of those now complete."""
        started = time.perf_counter()
        host = self.generator.host
        tokens = {
            sequence.slot: (sequence.tokens[-1], sequence.next_positions(host), sequence.decode_extra)
            for sequence in running
        }
        logits, sent = self.slots.decode(tokens)
        report.decode_batches.append(len(running))
        report.vision_bytes += sent
        finished = []
        for sequence in running:
            sequence.decode_batches.append(len(running))
            row = logits[sequence.slot]
            if sequence.emit(row, keep_logits, self.generator.eos_token_ids):
                finished.append(sequence.number)
        elapsed = time.perf_counter() - started
        report.decode_seconds += elapsed
        report.decode_step_seconds.append(elapsed)
        return finished

    def _result(self, sequence: _Sequence, step: int) -> RequestResult:
        plan = sequence.plan
        result = GenerationResult(
            prompt_tokens=len(sequence.input_ids),
            tokens=sequence.tokens,
            chunks=sequence.records,
            ttft=sequence.first_token_at - sequence.arrived_at,
            decode_seconds=sequence.last_token_at - sequence.first_token_at,
            encoder_calls=sequence.encoder_calls,
            cache_hits=sequence.cache_hits,
            logits=sequence.logits,
            protocol=plan.protocol.value,
            images=self.generator.request_images(plan, sequence.request.processed),
            image_rows=plan.total_rows,
            images_encoded=sequence.images_encoded,
            vision_input=self.generator.vision_input,
        )
        return RequestResult(
            number=sequence.number,
            arrival_step=sequence.request.arrival_step,
            slot=sequence.slot,
            admitted_step=sequence.admitted_step,
            first_token_step=sequence.first_token_step,
            finished_step=step,
            result=result,
            decode_batches=sequence.decode_batches,
        )


def compiled_slots(generator: SequenceRunner) -> int:
    """Slots a lone sequence must run among: the compiled ``full_batch_size`` of the decoding program.

    1 for a program without ``batch_index`` or without a recorded ``full_batch_size`` (a bare
    export runs a sequence at batch 1). Above 1, the program decodes only at batch
    ``full_batch_size``: one request runs as a batch of one through :class:`BatchedEngine`.
    """
    if not generator.io.has(Role.KV_SLOT):
        return 1
    key = symbols.FULL_BATCH_SIZE
    values = {int(entry[key]) for entry in _decode_specializations(generator) or () if key in entry}
    return max(values, default=1)


def _decode_specializations(generator: SequenceRunner) -> Sequence[Mapping[str, Any]] | None:
    """The specializations of the program that decodes (a disaggregated pair's decode program)."""
    return deployment_of(generator.language).decode_specializations(generator.language)


def compiled_full_batch_size(specializations: Sequence[Mapping[str, int]] | None) -> int:
    """The ``full_batch_size`` of compiled language specializations.

    Raises:
        UserError: None is recorded (a bare export: pass it), or several differ.
    """
    key = symbols.FULL_BATCH_SIZE
    values = {int(s[key]) for s in specializations or () if key in s}
    if len(values) != 1:
        raise UserError(
            "the language program's specializations record "
            + ("no full_batch_size" if not values else f"several full_batch_size values {sorted(values)}")
        )
    return values.pop()
