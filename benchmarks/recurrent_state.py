"""Qwen3.5 recurrent state: 512 device-precision decode steps, decode time vs position, prefill vs length.

Usage: python benchmarks/recurrent_state.py [--steps 512] [--out /tmp/recurrent-state] [--smoke]

On the tiny Qwen3.5 checkpoint (3 Gated DeltaNet layers, 1 full-attention layer), exported once:

1. Precision: one image prompt, then ``--steps`` greedy decode steps with end-of-sequence ignored,
   through onnxruntime in fp32, at device precision (fp16 emulation with the automatic plan) with
   the recurrent state computed and stored in fp16 (``state_dtype: float16``), and with it
   computed and stored in fp32 (``state_dtype: float32`` plus the nodes producing it in the
   precision plan). Each run is compared with the fp32 run of our graph: the first step whose
   greedy token differs, the worst |logit difference| / logit range over the steps before it, and
   the recurrent states' max |difference| / max |value| after the last step.
2. Decode step time against position: median seconds of a decode call at positions 64 .. 2048
   (one call per position, fresh zero states; the linear layers' cost does not depend on it).
3. Prefill time against chunk length: median seconds of one text chunk of S tokens.
4. A decode call of our graph (one 1x1 chunk of the gated delta rule) against one that, like
   QEfficient's decode, computes the 64-token chunked form (here: the same token padded to a
   64-token chunk, 63 padding tokens).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

from qeff_vision import symbols

FAMILY = "qwen3_5"
LENGTHS = (64, 128, 256, 512, 1024)  # prefill chunk lengths timed


def _precision_rows(export: Path, processed, steps: int) -> list[tuple[str, ...]]:
    # A sibling benchmark: the script's directory is on sys.path when it runs.
    from device_numerics import auto_plans

    from qeff_vision.numerics.device import MxEmulation
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    length = processed["input_ids"].shape[1]
    plans, candidates = auto_plans(export, length + 3)
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + steps + 8)

    def run(plan, mx):
        generator = generator_for_export(export, shape, fp32_values=plan, mx=mx)
        generator.eos_token_ids = set()
        return generator.generate(processed, max_new_tokens=steps, keep_logits=True)

    reference = run(None, None)
    kept = sum(len(v) for v in plans.values())
    # A state kept in fp32 on the device means the values that produce it are fp32 too (in the
    # plan): the GatedDeltaRule calls' outputs and the nodes between them and the retained outputs.
    state_plan = {**plans, "lang": [*plans["lang"], *_state_values(export)]}
    rows = []
    for label, plan, mx in (
        ("state fp16 (computed and stored)", plans, MxEmulation(state_fp16=True)),
        ("state fp32 (computed and stored)", state_plan, MxEmulation()),
    ):
        result = run(plan, mx)
        differ = next(
            (i for i, (a, b) in enumerate(zip(result.tokens, reference.tokens)) if a != b), len(result.tokens)
        )
        worst = max(
            float(np.abs(ours - ref).max() / (ref.max() - ref.min()))
            for ours, ref in zip(result.logits[: max(differ, 1)], reference.logits)
        )
        same = "all" if differ == len(result.tokens) else str(differ)
        states = [n for n in reference.continuation.past if n.startswith("recurrent_state")]
        error = max(
            float(np.abs(result.continuation.past[n] - reference.continuation.past[n]).max())
            / float(np.abs(reference.continuation.past[n]).max())
            for n in states
        )
        rows.append(
            (
                f"fp16 (auto), {label}",
                f"{kept}/{candidates}",
                f"{worst:.2e}",
                same,
                f"{error:.2e}",
                str(steps),
            )
        )
    return rows


def _state_values(export: Path) -> list[str]:
    """Values from each GatedDeltaRule call or conv-state gather up to the retained state outputs."""
    import onnx

    from qeff_vision.contract.slot_names import is_state_name

    graph = onnx.load(str(export / "lang" / "model.onnx"), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}
    values, stack = set(), [o.name for o in graph.output if is_state_name(o.name)]
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if node is None or name in values:
            continue
        values.add(name)
        if node.op_type != "GatedDeltaRule" and node.op_type != "GatherElements":
            stack += [i for i in node.input if i in producer]
    for node in graph.node:
        if node.op_type == "GatedDeltaRule":
            values.update(node.output)
    return sorted(values)


def _timed(session, feeds, repeats: int = 7) -> float:
    session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _feeds(generator, tokens: int, first: int, valid: int | None = None) -> dict:
    """Inputs of one text call of ``tokens`` tokens from position ``first`` (padding after ``valid``)."""
    valid = tokens if valid is None else valid
    positions = np.full((tokens,), -1, np.int64)
    positions[:valid] = np.arange(first, first + valid)
    rows = 4
    feeds = {
        symbols.INPUT_IDS: np.full((1, tokens), 65, np.int64),
        symbols.POSITION_IDS: np.broadcast_to(positions, (rows, 1, tokens)).copy(),
        symbols.IMAGE_IDX: np.zeros((1, 1), np.int64),
        symbols.VISION_EMBEDS: np.zeros((1, 1, generator.dims.hidden_size), np.float32),
    }
    return {**feeds, **generator.empty_cache()}


def _timing_rows(export: Path, smoke: bool = False):
    import onnxruntime as ort

    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    ctx = 4096
    generator = generator_for_export(export, LanguageShape((PrefillBucket(64, 1),), 1, ctx))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(export / "lang" / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )
    _timed(session, _feeds(generator, 1, 0))  # first-call allocations out of the figures
    repeats, positions, lengths = (
        (1, (64, 2048), (64, 128)) if smoke else (15, (64, 256, 1024, 2048), LENGTHS)
    )
    decode = [(p, _timed(session, _feeds(generator, 1, p), repeats)) for p in positions]
    prefill = [(s, _timed(session, _feeds(generator, s, 0), min(repeats, 5))) for s in lengths]
    chunked = _timed(session, _feeds(generator, 64, 100, valid=1), repeats)
    single = _timed(session, _feeds(generator, 1, 100), repeats)
    return decode, prefill, (single, chunked)


def main() -> None:
    """Print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="Keep the checkpoint and export here.")
    parser.add_argument(
        "--smoke", action="store_true", help="8 steps, two positions and lengths timed once (a quick check)."
    )
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "recurrent_state", None):
        if args.smoke:
            args.steps = 8
        from qeff_vision import api
        from qeff_vision.checkpoint import Checkpoint
        from qeff_vision.exporter import export_model
        from qeff_vision.inputs.prompt import process_turn
        from qeff_vision.verify import synthetic_image

        root = args.out or Path(tempfile.mkdtemp(prefix="recurrent-state-"))
        checkpoint = root / "checkpoint"
        if not checkpoint.exists():
            api.tiny(FAMILY, checkpoint)
        export = root / "export"
        if not export.exists():
            export_model(checkpoint, export, progress=None)
        processor = Checkpoint.open(checkpoint).processor
        processed = process_turn(processor, [synthetic_image(100, 150)], "Tell me a long story.")
        header = (
            "emulation",
            "fp32 nodes",
            "max |dlogit| / range",
            "first differing step",
            "state rel. error",
            "steps",
        )
        rows = _precision_rows(export, processed, args.steps)
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        decode, prefill, (ours, chunked) = _timing_rows(export, args.smoke)
        print("\ndecode position  ms/call")
        for position, seconds in decode:
            print(f"{position:>15}  {seconds * 1e3:.2f}")
        print("\nprefill tokens  ms/call  us/token")
        for tokens, seconds in prefill:
            print(f"{tokens:>14}  {seconds * 1e3:7.2f}  {seconds * 1e6 / tokens:8.1f}")
        print(f"\ndecode call: 1x1 chunk {ours * 1e3:.2f} ms, padded 64-token chunk {chunked * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
