"""Chunk-local vs full vision rows per prefill chunk (Qwen2.5-VL); the embedding cache over a conversation.

    .venv/bin/python benchmarks/chunked_vision.py [--work DIR] [--plot PNG]

Part 1 runs the real chunk-aware :class:`~qeff_vision.runtime.generate.Generator` (planner, cache,
chunk feeder, onnxruntime language program) on prompts holding one image of 64, 299, 2691 or 3577
tokens -- the real Qwen2.5-VL token counts of 224x224, 640x360, 1080x1920 and 1365x2048 images --
at chunk sizes S = 128 and 512, with the ``chunk`` protocol (V = min(S, image tokens), what
``vision_size: chunk`` compiles) and the ``full`` protocol (V = image tokens, ``vision_size: max``).
The image rows are synthetic: a stand-in vision program returns random rows of the right shape, so
a 3577-token image needs no 14,308-patch vision tower on the CPU; the language program is the
real export. It reports vision bytes per chunk and in total, and the language-program prefill time.

Part 2 runs a five-turn conversation through the real vision and language programs, adding one
new 224x224 image per turn, with the per-image embedding cache and without it (a zero-byte cache),
and counts encoder calls and images encoded.

The model is the tiny random Qwen2.5-VL checkpoint of ``qeff-vision tiny qwen2_5_vl`` (text hidden
64, 2 layers; vision hidden 32, depth 2); bytes scale linearly with the hidden size, so a column
also gives the bytes per chunk at Qwen2.5-VL-7B's hidden size (3584) in float16.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import plot_path, recording

from qeff_vision import symbols

RESOLUTIONS = ((224, 224), (640, 360), (1080, 1920), (1365, 2048))
SEQ_LENS = (128, 512)
HIDDEN_7B = 3584
FP16_BYTES = 2
TARGET_RATIO = 20.0


@dataclass
class PrefillRow:
    resolution: str
    image_tokens: int
    seq_len: int
    protocol: str
    vision_size: int
    chunks: int
    rows_used: int
    bytes_per_chunk: int
    total_bytes: int
    prefill_ms: float
    first_token: int


@dataclass
class TurnRow:
    turn: int
    images: int
    cached_calls: int
    cached_encoded: int
    cached_hits: int
    uncached_calls: int
    uncached_encoded: int


class SyntheticVision:
    """A vision program returning deterministic random rows [batch, tokens, hidden] (no tower)."""

    specializations = None

    def __init__(self, hidden: int, merge: int = 2):
        self.hidden = hidden
        self.merge = merge
        self.calls = 0

    def accepts(self, feeds) -> bool:
        return True

    def run(self, feeds):
        self.calls += 1
        grid = feeds["image_grid_thw"]
        batch, tokens = grid.shape[0], grid.shape[1] * grid.shape[2] * grid.shape[3] // self.merge**2
        seed = int(np.asarray(feeds[symbols.PIXEL_VALUES]).ravel()[0] * 1000) % 2**31
        rows = np.random.default_rng(seed).standard_normal((batch, tokens, self.hidden), dtype=np.float32)
        return {symbols.VISION_EMBEDS: rows * 0.02}


def ensure_export(work: Path, export: Path | None) -> Path:
    """The export to benchmark: ``export`` if given, else a tiny checkpoint exported under ``work``."""
    from qeff_vision import api

    if export is not None:
        return export
    checkpoint, out = work / "tiny-qwen2_5_vl", work / "export"
    if not (checkpoint / "config.json").is_file():
        print(f"writing the tiny Qwen2.5-VL checkpoint to {checkpoint}", file=sys.stderr)
        api.tiny("qwen2_5_vl", checkpoint, force=True)
    if not (out / "export.json").is_file():
        print(f"exporting it to {out}", file=sys.stderr)
        api.export(checkpoint, out, force=True, quiet=True)
    return out


class Bench:
    """The export's programs, adapter and processor, and generator construction."""

    def __init__(self, export_dir: Path, threads: int = 1):
        from qeff_vision.checkpoint import Checkpoint
        from qeff_vision.export_record import read_export
        from qeff_vision.families.base import ModelDescription
        from qeff_vision.runtime.session import OnnxProgram

        manifest = read_export(export_dir)
        self.checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
        self.family, self.config = self.checkpoint.family, self.checkpoint.config
        self.processor = self.checkpoint.processor
        self.vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
        # One intra-op thread: steadier timings on a shared machine (both protocols alike).
        self.language = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"], threads=threads)
        self.hidden = self.family.text_dims(ModelDescription(self.config)).hidden_size
        # Token math with the published processor's pixel bounds (the tiny one caps images smaller).
        self.published = ModelDescription(self.config, {}, "published Qwen2.5-VL processor defaults")

    def generator(self, buckets, ctx_len: int, vision=None, cache=None):
        from qeff_vision.runtime.embedding_cache import EmbeddingCache
        from qeff_vision.runtime.generate import Generator
        from qeff_vision.runtime.language_shape import LanguageShape
        from qeff_vision.runtime.planner import PrefillBucket

        buckets = tuple(PrefillBucket(s, v) for s, v in buckets)
        shape = LanguageShape(buckets, max(b.vision_size for b in buckets), ctx_len)
        cache = cache if cache is not None else EmbeddingCache(1 << 30)
        return Generator(self.checkpoint, vision or self.vision, self.language, shape, cache)

    def synthetic_prompt(self, height: int, width: int, seed: int) -> dict:
        """A chat prompt with one image of the real Qwen2.5-VL grid of ``height`` x ``width``."""
        from qeff_vision.families.base import ImageSize

        values = self.family.vision_symbols(self.published, ImageSize(height, width))
        grid_h, grid_w = values["grid_h"], values["grid_w"]
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}
        ]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.processor.tokenizer(text)["input_ids"]
        image_token = self.config["image_token_id"]
        at = ids.index(image_token)
        tokens = values[symbols.VISION_SIZE]
        ids = ids[:at] + [image_token] * tokens + ids[at + 1 :]
        patches = np.full((grid_h * grid_w, values["grid_width"]), seed / 1000.0, dtype=np.float32)
        return {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "pixel_values": patches,
            "image_grid_thw": np.asarray([[1, grid_h, grid_w]], dtype=np.int64),
        }


def prefill_sweep(bench: Bench, resolutions, seq_lens, repeats: int) -> list[PrefillRow]:
    """Both protocols per (image, S); runs alternate between them and the minimum time is kept.

    Alternating and taking the minimum keeps a busy machine from favouring either protocol.
    """
    rows = []
    vision = SyntheticVision(bench.hidden)
    for number, (height, width) in enumerate(resolutions):
        processed = bench.synthetic_prompt(height, width, number + 1)
        length = processed["input_ids"].shape[1]
        image_tokens = int((processed["input_ids"] == bench.config["image_token_id"]).sum())
        ctx_len = 1 << max(length + 8, 64).bit_length()
        for seq_len in seq_lens:
            protocols = {"chunk": min(seq_len, image_tokens), "full": image_tokens}
            generators = {p: bench.generator([(seq_len, v)], ctx_len, vision) for p, v in protocols.items()}
            times: dict[str, list[float]] = {p: [] for p in protocols}
            results = {}
            for run in range(repeats + 1):  # run 0 warms onnxruntime up
                for protocol, generator in generators.items():
                    results[protocol] = generator.generate(processed, max_new_tokens=1, protocol=protocol)
                    if run:
                        times[protocol].append(results[protocol].prefill_seconds)
            for protocol, result in results.items():
                rows.append(
                    PrefillRow(
                        resolution=f"{height}x{width}",
                        image_tokens=image_tokens,
                        seq_len=seq_len,
                        protocol=protocol,
                        vision_size=protocols[protocol],
                        chunks=len(result.chunks),
                        rows_used=sum(c.rows for c in result.chunks),
                        bytes_per_chunk=result.chunks[0].vision_bytes,
                        total_bytes=result.vision_bytes,
                        prefill_ms=min(times[protocol]) * 1e3,
                        first_token=result.tokens[0],
                    )
                )
    return rows


def conversation_turns(bench: Bench, turns: int, seq_len: int) -> list[TurnRow]:
    from qeff_vision.runtime.conversation import Conversation
    from qeff_vision.runtime.embedding_cache import EmbeddingCache

    images = [_image(224, 224, seed) for seed in range(turns)]
    results = {}
    for name, cache_bytes in (("cached", 256 << 20), ("uncached", 0)):
        chat = Conversation(
            bench.generator([(seq_len, seq_len)], 4096, cache=EmbeddingCache(cache_bytes)),
            bench.processor,
            max_new_tokens=2,
        )
        results[name] = [chat.ask([images[t]], f"Turn {t + 1}: what is new?") for t in range(turns)]
    return [
        TurnRow(
            turn=t + 1,
            images=results["cached"][t].images,
            cached_calls=results["cached"][t].encoder_calls,
            cached_encoded=results["cached"][t].images_encoded,
            cached_hits=results["cached"][t].cache_hits,
            uncached_calls=results["uncached"][t].encoder_calls,
            uncached_encoded=results["uncached"][t].images_encoded,
        )
        for t in range(turns)
    ]


def _image(height: int, width: int, seed: int):
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def _table(header, rows) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def prefill_table(rows: list[PrefillRow], hidden: int) -> str:
    header = [
        "image",
        "tokens",
        "S",
        "protocol",
        "V",
        "chunks",
        "real rows sent",
        "bytes/chunk",
        "total bytes",
        "bytes/chunk @7B fp16",
        "prefill ms (min)",
    ]
    body = [
        [
            r.resolution,
            r.image_tokens,
            r.seq_len,
            r.protocol,
            r.vision_size,
            r.chunks,
            r.rows_used,
            f"{r.bytes_per_chunk:,}",
            f"{r.total_bytes:,}",
            f"{r.vision_size * HIDDEN_7B * FP16_BYTES:,}",
            f"{r.prefill_ms:.1f}",
        ]
        for r in rows
    ]
    return _table(header, body)


def turns_table(rows: list[TurnRow]) -> str:
    header = [
        "turn",
        "images in prompt",
        "cache: encoder calls",
        "images encoded",
        "cache hits",
        "no cache: encoder calls",
        "images encoded",
    ]
    body = [
        [
            r.turn,
            r.images,
            r.cached_calls,
            r.cached_encoded,
            r.cached_hits,
            r.uncached_calls,
            r.uncached_encoded,
        ]
        for r in rows
    ]
    total = [
        "total",
        "",
        *[
            sum(getattr(r, f) for r in rows)
            for f in ("cached_calls", "cached_encoded", "cached_hits", "uncached_calls", "uncached_encoded")
        ],
    ]
    return _table(header, [*body, total])


def verdicts(prefill: list[PrefillRow], turns: list[TurnRow]) -> list[str]:
    lines = []
    by_key = {(r.resolution, r.seq_len, r.protocol): r for r in prefill}
    for row in sorted(prefill, key=lambda r: (r.image_tokens, r.seq_len)):
        resolution, seq_len = row.resolution, row.seq_len
        if row.protocol != "chunk":
            continue
        full = by_key[(resolution, seq_len, "full")]
        ratio = full.bytes_per_chunk / row.bytes_per_chunk
        same = "same first token" if row.first_token == full.first_token else "FIRST TOKENS DIFFER"
        lines.append(
            f"{resolution} ({row.image_tokens} tokens), S={seq_len}: full sends {ratio:.1f}x the bytes per "
            f"chunk ({full.total_bytes / row.total_bytes:.1f}x in total); chunk sends each of the "
            f"{row.image_tokens} rows once ({row.rows_used} real rows), full {full.rows_used}; {same}"
        )
    target = by_key.get(("1080x1920", 128, "chunk"))
    if target is not None:
        ratio = by_key[("1080x1920", 128, "full")].bytes_per_chunk / target.bytes_per_chunk
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        lines.append(
            f"target >= {TARGET_RATIO:.0f}x fewer bytes than full for 1080p at S=128: {ratio:.1f}x, {verdict}"
        )
    if turns:
        encoded = sum(r.cached_encoded for r in turns)
        verdict = "yes" if encoded == len(turns) else "NO"
        lines.append(
            f"encoder runs once per distinct image with the cache: {encoded} encodings "
            f"for {len(turns)} images, {verdict}"
        )
    return lines


def plot(prefill: list[PrefillRow], turns: list[TurnRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    seq_lens = sorted({r.seq_len for r in prefill})
    for seq_len in seq_lens:
        for protocol, style in (("chunk", "-o"), ("full", "--s")):
            rows = sorted(
                (r for r in prefill if r.seq_len == seq_len and r.protocol == protocol),
                key=lambda r: r.image_tokens,
            )
            tokens = [r.image_tokens for r in rows]
            label = f"{protocol}, S={seq_len}"
            axes[0].plot(tokens, [r.bytes_per_chunk for r in rows], style, label=label)
            axes[1].plot(tokens, [r.prefill_ms for r in rows], style, label=label)
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="image tokens",
        ylabel="vision_embeds bytes per chunk",
        title="Vision bytes per prefill chunk (full: both S coincide)",
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="image tokens",
        ylabel="ms (min of runs)",
        title="onnxruntime prefill time (language program)",
    )
    if turns:
        x = [r.turn for r in turns]
        axes[2].plot(x, np.cumsum([r.cached_encoded for r in turns]), "-o", label="with cache")
        axes[2].plot(x, np.cumsum([r.uncached_encoded for r in turns]), "--s", label="without cache")
        axes[2].set(
            xlabel="turn (one new image each)",
            ylabel="images encoded (cumulative)",
            title="Encoder work over a conversation",
        )
        axes[2].set_xticks(x)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _resolution(text: str) -> tuple[int, int]:
    height, width = text.lower().split("x")
    return int(height), int(width)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", type=Path, help="Scratch directory (checkpoint, export, plot); default a temp dir."
    )
    parser.add_argument("--export", type=Path, help="Use this export of a Qwen2.5-VL checkpoint instead.")
    parser.add_argument("--plot", type=Path, help="PNG path (default WORK/chunked_vision.png).")
    parser.add_argument(
        "--images",
        type=_resolution,
        nargs="+",
        default=list(RESOLUTIONS),
        help="Resolutions HxW (default: the four real ones).",
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--turns", type=int, default=5, help="Conversation turns (0 skips part 2).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs per configuration (minimum kept).")
    parser.add_argument(
        "--threads", type=int, default=1, help="onnxruntime intra-op threads (0: its choice)."
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="224x224 and 1080p at S=128, two turns, one run (a quick check of every path).",
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "chunked_vision", argv):
        if args.smoke:
            args.images, args.seq_lens, args.turns, args.repeats = [(224, 224), (1080, 1920)], [128], 2, 1
        work = args.work or Path(tempfile.mkdtemp(prefix="qeff-vision-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(ensure_export(work, args.export), args.threads)

        print(
            "Part 1: vision rows per prefill chunk, chunk vs full (tiny random Qwen2.5-VL, text hidden "
            f"{bench.hidden}; image rows SYNTHETIC: a stand-in vision program returns random rows, the "
            "language program is the real onnxruntime export)"
        )
        prefill = prefill_sweep(bench, args.images, args.seq_lens, args.repeats)
        print(prefill_table(prefill, bench.hidden))
        print(
            "prefill ms is the language program alone on this CPU; the vision rows are a memcpy here, so it "
            "shows the compute, not the host-to-device transfer the bytes columns measure"
        )
        print()
        turns: list[TurnRow] = []
        if args.turns:
            print(
                f"Part 2: {args.turns}-turn conversation, one new 224x224 image per turn (64 tokens; "
                "real vision and language programs), with the per-image embedding cache and without it"
            )
            turns = conversation_turns(bench, args.turns, min(args.seq_lens))
            print(turns_table(turns))
            print()
        for line in verdicts(prefill, turns):
            print(line)
        path = plot_path(args, "chunked_vision", args.plot or work / "chunked_vision.png")
        plot(prefill, turns, path)
        print(f"plot: {path}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
