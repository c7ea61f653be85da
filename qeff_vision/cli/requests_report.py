"""What ``qeff-vision run ART --requests FILE`` prints: the per-request table and the ``--json`` document.

The presentation of a :class:`~qeff_vision.runtime.batch_run.BatchRun`, next to the one-turn
report of :mod:`qeff_vision.cli.run` (whose ``--json`` turns share :func:`result_json`); the
runtime computes the numbers, this module only lays them out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qeff_vision.runtime.batch_run import BatchRun
    from qeff_vision.runtime.results import GenerationResult


def result_json(result: GenerationResult) -> dict:
    """A generation's reply, token ids and the counts ``run`` reports, as JSON values (``--json``)."""
    return {
        "text": result.text,
        "token_ids": [int(token) for token in result.tokens],
        "prompt_tokens": result.prompt_tokens,
        "prefilled_tokens": result.prefilled_tokens,
        "images": result.images,
        "image_rows": result.image_rows,
        "protocol": result.protocol,
        "chunks": [
            {
                "tokens": chunk.tokens,
                "seq_len": chunk.seq_len,
                "rows": chunk.rows,
                "vision_size": chunk.vision_size,
                "vision_bytes": chunk.vision_bytes,
                "images_encoded": chunk.images_encoded,
                "encode_ms": chunk.encode_seconds * 1e3,
                "prefill_ms": chunk.seconds * 1e3,
            }
            for chunk in result.chunks
        ],
        "encoder_calls": result.encoder_calls,
        "images_encoded": result.images_encoded,
        "cache_hits": result.cache_hits,
        "vision_bytes": result.vision_bytes,
        "vision_input": result.vision_input,
        "ttft_ms": result.ttft * 1e3,
        "decode_ms": result.decode_seconds * 1e3,
        "decode_tokens_per_second": result.decode_tokens_per_second,
        "notes": list(result.notes),
        "served": list(result.served),
    }


def report_json(run: BatchRun) -> dict:
    """Per request its reply, token ids, schedule and counts, and the engine's totals (``--json``)."""
    report = run.report
    requests = []
    for request, done in zip(run.requests, report.requests):
        entry = {
            "request": request.index,
            "slot": done.slot,
            "arrival_step": done.arrival_step,
            "admitted_step": done.admitted_step,
            "first_token_step": done.first_token_step,
            "finished_step": done.finished_step,
            "mean_occupancy": done.mean_occupancy,
            "failed": done.failed,
            **result_json(done.result),
        }
        if done.failed:
            entry["error"] = done.error
        if done.number < len(run.comparisons):
            comparison = run.comparisons[done.number]
            entry["compare_hf"] = {"identical": comparison.identical, "verdict": comparison.describe()}
        requests.append(entry)
    engine = {
        "full_batch_size": report.full_batch_size,
        "batched": report.batched,
        "steps": report.steps,
        "prefill_calls": report.prefill_calls,
        "decode_calls": len(report.decode_batches),
        "mean_occupancy": report.mean_occupancy,
        "decode_tokens_per_second": report.decode_tokens_per_second,
        "vision_bytes": report.vision_bytes,
        "encoder_calls": report.encoder_calls,
        "failed_requests": sum(done.failed for done in report.requests),
    }
    if run.handoffs is not None:
        engine["handoffs"], engine["handoff_bytes"] = run.handoffs
    return {"requests": requests, "engine": engine}


def report_table(run: BatchRun) -> list[str]:
    """The per-request table and the engine summary ``run --requests`` prints."""
    header = (
        "request",
        "slot",
        "arrive",
        "admit",
        "first",
        "done",
        "prompt",
        "images",
        "chunks",
        "vision rows",
        "encoder calls",
        "cache hits",
        "TTFT ms",
        "decode tok/s",
        "occupancy",
        "tokens",
    )
    rows = [header]
    for done in run.report.requests:
        result = done.result
        rows.append(
            (
                str(done.number),
                str(done.slot),
                str(done.arrival_step),
                str(done.admitted_step),
                str(done.first_token_step),
                str(done.finished_step),
                str(result.prompt_tokens),
                str(result.images),
                str(len(result.chunks)),
                str(sum(chunk.rows for chunk in result.chunks)),
                str(result.encoder_calls),
                str(result.cache_hits),
                f"{result.ttft * 1e3:.1f}",
                f"{result.decode_tokens_per_second:.1f}",
                f"{done.mean_occupancy:.2f}",
                str(len(result.tokens)),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    report = run.report
    kind = "one batched call per decode step" if report.batched else "one call per request per decode step"
    lines.append(
        f"engine: full_batch_size {report.full_batch_size} ({kind}); {report.steps} step(s), "
        f"{report.prefill_calls} prefill chunk(s), {len(report.decode_batches)} decode call(s) at mean "
        f"occupancy {report.mean_occupancy:.2f}, {report.decode_tokens_per_second:.1f} decode tokens/s"
    )
    lines.append(
        f"vision: {report.vision_bytes:,} bytes of vision inputs sent; "
        f"{report.encoder_calls} encoder call(s) (the embedding cache is shared by all requests)"
    )
    if run.handoffs is not None:
        count, size = run.handoffs
        lines.append(
            f"disaggregated: prefill on lang_prefill, decode on lang_decode; {count} KV hand-off(s) "
            f"into decode slots, {size:,} bytes copied"
        )
    return lines
