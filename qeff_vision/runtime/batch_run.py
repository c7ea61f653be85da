"""``qeff-vision run ART --requests FILE.jsonl``: a request file through the batched engine.

Each request is rendered with the checkpoint's chat template and processor exactly as a one-turn
:class:`~qeff_vision.runtime.conversation.Conversation` would render it (images resized to a
compiled resolution when needed), then the engine serves all of them through the program's KV
slots. With ``compare_hf`` each request is also run alone through transformers generate on the
same processed inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeff_vision.errors import UserError
from qeff_vision.inputs.requests import Request, read_requests
from qeff_vision.inputs.sampling_params import GREEDY, SamplingParams
from qeff_vision.runtime.engine import BatchedEngine, EngineReport, EngineRequest, RequestResult
from qeff_vision.runtime.planner import VisionProtocol


@dataclass
class BatchRun:
    """What :func:`run_requests` returns.

    Attributes:
        requests: The parsed request file.
        report: The engine's report (per-request results in file order).
        notes: Per request, things worth telling the user (e.g. an image resized).
        comparisons: Per request, tokens against transformers alone (with ``compare_hf``).
        handoffs: Disaggregated artifacts: (prefill KV hand-offs to a decode slot, their bytes).
        engine: The engine that served them (its slots and generator, for inspection after the run).
    """

    requests: list[Request]
    report: EngineReport
    notes: list[list[str]] = field(default_factory=list)
    comparisons: list[Any] = field(default_factory=list)
    handoffs: tuple[int, int] | None = None
    engine: BatchedEngine | None = None

    @property
    def identical(self) -> bool:
        """Every compared request matched transformers."""
        return all(comparison.identical for comparison in self.comparisons)


def run_requests(
    artifacts_dir: str | Path,
    requests_file: str | Path,
    *,
    max_new_tokens: int = 32,
    protocol: str = VisionProtocol.CHUNK.value,
    compare_hf: bool = False,
    precision: str | None = None,
    on_finish: Callable[[Request, RequestResult], None] | None = None,
    sampling: SamplingParams = GREEDY,
) -> BatchRun:
    """Serve a request file on compiled artifacts.

    Args:
        artifacts_dir: OUT of ``qeff-vision compile``.
        requests_file: The JSON-lines request file (see :mod:`qeff_vision.inputs.requests`).
        max_new_tokens: ``max_new_tokens`` of requests that do not set it.
        protocol: ``chunk`` or ``full``.
        compare_hf: Also run transformers generate alone on each request and compare tokens.
        precision: ``fp32`` or ``device`` (see :func:`~qeff_vision.runtime.artifacts.open_programs`).
        on_finish: Called with (request, result) as each request frees its slot; ``result.result.text``
            holds the reply.
        sampling: The sampling parameters of requests whose line sets none (a line's keys
            override them one by one).

    Raises:
        UserError: A bad request file or image (checked before the programs are loaded), a
            request that does not fit the compiled shapes, no manifest.
    """
    from qeff_vision.media import load_image
    from qeff_vision.runtime.conversation import open_conversation

    requests = read_requests(requests_file, max_new_tokens, sampling)
    sampled = [request.index for request in requests if not request.sampling.greedy]
    if compare_hf and sampled:
        raise UserError(
            f"--compare-hf compares greedy tokens with transformers; request {sampled[0]} samples "
            "(drop its temperature / top_k or --compare-hf)"
        )
    for request in requests:
        for image in request.images:
            load_image(image)  # a bad image fails before anything heavy loads
    chat = open_conversation(artifacts_dir, protocol=protocol, precision=precision)
    if not chat.generator.deployment.batching:
        raise UserError(
            f"{artifacts_dir}: deployment single serves one sequence at a time (batch 1, its image "
            "rows retained in the program); serve --requests from a dual or disaggregated compile, "
            "or run each prompt with --prompt"
        )
    prepared = [chat.prepare(list(request.images), request.prompt) for request in requests]
    tokenizer = chat.processor.tokenizer

    def finished(result: RequestResult) -> None:
        result.result.text = tokenizer.decode(result.result.tokens, skip_special_tokens=True)
        result.result.notes = list(prepared[result.number].notes)
        if on_finish:
            on_finish(requests[result.number], result)

    engine = BatchedEngine(chat.generator, protocol=protocol)
    report = engine.run(
        [
            EngineRequest(p.processed, r.max_new_tokens, r.arrival_step, sampling=r.sampling)
            for p, r in zip(prepared, requests)
        ],
        on_finish=finished,
    )
    run = BatchRun(requests, report, [p.notes for p in prepared], engine=engine)
    run.handoffs = chat.generator.deployment.handoffs(chat.generator.language)
    if compare_hf:
        from qeff_vision.reference import TokenComparison, load_reference_model, reference_generate

        reference = load_reference_model(chat.model_dir)
        eos = sorted(chat.generator.eos_token_ids)
        for inputs, request, done in zip(prepared, requests, report.requests):
            theirs, _ = reference_generate(reference, inputs.processed, request.max_new_tokens, eos)
            run.comparisons.append(TokenComparison(tuple(done.result.tokens), tuple(theirs)))
    return run
