"""Video token pruning (EVS): vision rows, prompt tokens and prefill time per clip at rates 0, 0.5, 0.75.

    .venv/bin/python benchmarks/video_pruning.py [--work DIR] [--families qwen2_5_vl qwen3_vl]

Two synthetic 16-frame clips go through the real chunk-aware generator (vision program, EVS on the
host, planner, embedding cache, onnxruntime language program) of each family's tiny random
checkpoint (``qeff-vision tiny``):

- ``static``: one random frame repeated: every later temporal patch equals the first;
- ``motion``: a fixed random background with a bright square moving across it (one merged patch
  per frame), so few rows change between temporal patches.

EVS keeps a number of rows that depends only on the grid and the rate (the first temporal patch
always), so ``rows`` and ``prompt`` are the same for both clips; what differs is which rows: the
``on motion`` column counts, among the kept rows after the first temporal patch, those whose
patch the square covered in that temporal patch or the previous one (the rows that changed),
over how many such rows the clip has. ``encode ms`` is the vision program (it always encodes every
row), ``prefill ms`` the language program's prefill chunks, ``ttft ms`` both plus the host
(median of ``--repeats`` runs, a fresh embedding cache each). Chunks of 64 or 256 tokens, one
onnxruntime thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

RATES = (0.0, 0.5, 0.75)
FRAMES = 16
SEQ_LENS = (64, 256)
CTX_LEN = 2048
# Frame sizes each family's tiny video processor keeps as they are (multiples of patch x merge,
# inside its pixel bounds), so the square moves by exactly one merged patch per frame.
FRAME_SIZE = {"qwen2_5_vl": (336, 336), "qwen3_vl": (96, 128)}
UNIT = {"qwen2_5_vl": 28, "qwen3_vl": 32}


@dataclass
class Row:
    family: str
    clip: str
    rate: float
    grid: tuple[int, int, int]
    rows: int
    prompt_tokens: int
    chunks: int
    on_motion: str
    encode_ms: float
    prefill_ms: float
    ttft_ms: float
    first_token: int


def clips(family: str) -> dict[str, list]:
    """The static and the motion clip of ``family``'s frame size, and the square's cell per frame."""
    from PIL import Image

    height, width = FRAME_SIZE[family]
    unit = UNIT[family]
    rng = np.random.default_rng(0)
    background = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    moving = []
    for frame in range(FRAMES):
        pixels = background.copy()
        row, col = (frame // 4) % (height // unit), frame % (width // unit)
        pixels[row * unit : (row + 1) * unit, col * unit : (col + 1) * unit] = 255
        moving.append(Image.fromarray(pixels))
    return {"static": [Image.fromarray(background)] * FRAMES, "motion": moving}


def square_cells(family: str, temporal: int, rows: int, cols: int) -> list[set[tuple[int, int]]]:
    """Per temporal patch: the merged cells (of a ``rows`` x ``cols`` grid) the square's centre visits."""
    height, width = FRAME_SIZE[family]
    unit = UNIT[family]
    cells = []
    for patch in range(FRAMES // temporal):
        visited = set()
        for frame in range(patch * temporal, (patch + 1) * temporal):
            row, col = (frame // 4) % (height // unit), frame % (width // unit)
            # The processor may resize the frames: scale the square's centre onto the merged grid.
            visited.add((int((row + 0.5) * unit * rows / height), int((col + 0.5) * unit * cols / width)))
        cells.append(visited)
    return cells


def motion_hits(family: str, mask: np.ndarray, grid: tuple[int, int, int], temporal: int) -> str:
    """``kept/changed``: kept later rows the square touched now or one temporal patch earlier."""
    frames, rows, cols = grid
    kept = mask.reshape(frames, rows, cols)
    cells = square_cells(family, temporal, rows, cols)
    changed = hits = 0
    for patch in range(1, frames):
        for row, col in cells[patch] | cells[patch - 1]:
            changed += 1
            hits += int(kept[patch, row, col])
    return f"{hits}/{changed}"


class Bench:
    """One family's exported programs and processor."""

    def __init__(self, family: str, work: Path):
        from qeff_vision import api
        from qeff_vision.checkpoint import Checkpoint
        from qeff_vision.export_record import read_export
        from qeff_vision.runtime.session import OnnxProgram

        checkpoint, export = work / f"tiny-{family}", work / f"export-{family}"
        if not (checkpoint / "config.json").is_file():
            print(f"writing the tiny {family} checkpoint to {checkpoint}", file=sys.stderr)
            api.tiny(family, checkpoint, force=True)
        if not (export / "export.json").is_file():
            print(f"exporting it to {export}", file=sys.stderr)
            api.export(checkpoint, export, force=True, quiet=True)
        manifest = read_export(export)
        self.family = family
        self.checkpoint = Checkpoint.open(manifest["model"], family)
        self.vision = OnnxProgram(export / manifest["programs"]["vision"]["path"], threads=1)
        self.language = OnnxProgram(export / manifest["programs"]["lang"]["path"], threads=1)
        self.processor = self.checkpoint.processor

    def generator(self, rate: float):
        from qeff_vision.runtime.embedding_cache import EmbeddingCache
        from qeff_vision.runtime.generate import make_generator
        from qeff_vision.runtime.language_shape import LanguageShape
        from qeff_vision.runtime.planner import PrefillBucket

        shape = LanguageShape(tuple(PrefillBucket(s, s) for s in SEQ_LENS), max(SEQ_LENS), CTX_LEN)
        cache = EmbeddingCache(256 * 2**20)
        generator = make_generator(self.checkpoint, self.vision, self.language, shape, cache)
        generator.set_video_pruning_rate(rate)
        return generator

    def processed(self, frames) -> dict:
        from qeff_vision.media import Clip
        from qeff_vision.runtime.conversation import Conversation

        chat = Conversation(self.generator(0.0), self.processor)
        return chat.prepare([], "What happens in the video?", [Clip(frames, 2.0, "clip")]).processed


def measure(bench: Bench, name: str, frames, rate: float, repeats: int) -> Row:
    from qeff_vision.contract.video_pruning import RETENTION

    processed = bench.processed(frames)
    merge = bench.checkpoint.family.vision(bench.checkpoint.description).merge
    temporal = bench.checkpoint.family.vision(bench.checkpoint.description).temporal
    t, h, w = (int(x) for x in processed["video_grid_thw"][0])
    grid = (t, h // merge, w // merge)
    times, result, generator = [], None, None
    for _ in range(repeats):
        generator = bench.generator(rate)  # a fresh cache: the clip is encoded every run
        vision_before = bench.vision.seconds
        started = time.perf_counter()
        result = generator.generate(processed, max_new_tokens=1)
        ttft = time.perf_counter() - started
        encode = bench.vision.seconds - vision_before
        prefill = sum(chunk.seconds for chunk in result.chunks)
        times.append((encode, prefill, ttft))
    pruned = generator.prepare_prompt(processed)
    on_motion = (
        "-" if rate == 0 or name == "static" else motion_hits(bench.family, pruned[RETENTION], grid, temporal)
    )
    encode, prefill, ttft = (statistics.median(values) * 1e3 for values in zip(*times))
    return Row(
        bench.family, name, rate, grid, result.image_rows, result.prompt_tokens, len(result.chunks),
        on_motion, encode, prefill, ttft, result.tokens[0],
    )  # fmt: skip


def table(rows: list[Row]) -> str:
    header = ("family", "clip", "rate", "grid t x h x w", "rows", "prompt", "chunks", "on motion",
              "encode ms", "prefill ms", "ttft ms", "1st token")  # fmt: skip
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.family,
                r.clip,
                f"{r.rate:g}",
                "x".join(map(str, r.grid)),
                str(r.rows),
                str(r.prompt_tokens),
                str(r.chunks),
                r.on_motion,
                f"{r.encode_ms:.1f}",
                f"{r.prefill_ms:.1f}",
                f"{r.ttft_ms:.1f}",
                str(r.first_token),
            )  # fmt: skip
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |" for line in lines
    ]
    text.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", type=Path, help="Scratch directory (checkpoints, exports); default a temp dir."
    )
    parser.add_argument("--families", nargs="+", default=list(FRAME_SIZE), choices=list(FRAME_SIZE))
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs per configuration (median kept).")
    parser.add_argument(
        "--smoke", action="store_true", help="Qwen2.5-VL, rates 0 and 0.5, one run (a quick check)."
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "video_pruning", argv):
        if args.smoke:
            args.families, args.rates, args.repeats = ["qwen2_5_vl"], [0.0, 0.5], 1
        work = args.work or Path(tempfile.mkdtemp(prefix="qeff-vision-evs-"))
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for family in args.families:
            bench = Bench(family, work)
            for name, frames in clips(family).items():
                for rate in args.rates:
                    rows.append(measure(bench, name, frames, rate, args.repeats))
        print(
            f"EVS video pruning, tiny random checkpoints, {FRAMES}-frame synthetic clips, chunks of "
            f"{'/'.join(map(str, SEQ_LENS))} tokens, onnxruntime 1 thread, median of {args.repeats}"
        )
        print(table(rows))
        return 0


if __name__ == "__main__":
    sys.exit(main())
