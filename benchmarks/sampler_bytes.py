"""Bytes a decode step moves between host and device: logits out, or the on-device sampler's tokens.

    .venv/bin/python benchmarks/sampler_bytes.py [--full-batch-size 16] [--out DIR]

Counted, not timed, from the language program's IO table (the rows the exporter traces and the
sampler tests read back from the exported graphs) at each family's pinned config
(``specs/configs``: the real vocabulary), decode shapes (``seq_len`` 1) at batch 1 and at a
continuous-batching ``full_batch_size``. Returned bytes are every output that is not retained
state (retained state stays on the device): ``logits`` [batch, 1, vocab] float32 (the graph's
IO type; custom IO leaves logits alone) and ``image_idx_output``, or, with the sampler,
``next_tokens`` [batch, 1, 1] int64 (``probs`` [batch, 1, vocab] float32 too with
``return_pdfs``). Sent bytes are what the sampler adds to each call's inputs: six per-row
parameters, ``last_accepted_output_tokens`` and ``random_numbers`` [batch, max_top_k_ids] float32
(QEfficient's 512 by default). Prints a Markdown table and writes a PNG (``--out``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import plot_path, recording

from qeff_vision import symbols
from qeff_vision.contract.language_io import DType, LanguageIO
from qeff_vision.contract.sampler_io import SamplerOptions, sampler_dims, with_sampler
from qeff_vision.families import all_families, describe_checkpoint, family_for

CONFIGS = Path(__file__).resolve().parents[1] / "specs" / "configs"
# One pinned config per family (the first by name whose family is this one).
ITEM_BYTES = {DType.INT64: 8, DType.INT32: 4, DType.FLOAT32: 4, DType.BOOL: 1, DType.COMPUTE: 4}
SMOKE_FAMILIES = ("gemma3", "qwen2_5_vl")


def pinned_configs() -> dict[str, Path]:
    """Family name -> the directory of its first pinned config."""
    found: dict[str, Path] = {}
    for directory in sorted(p for p in CONFIGS.iterdir() if (p / "config.json").is_file()):
        family = family_for(describe_checkpoint(directory)).name
        found.setdefault(family, directory)
    return found


def _elements(shape) -> int:
    return math.prod(shape) if shape else 1


def returned_bytes(io: LanguageIO, values) -> int:
    """Bytes of every output that is not retained state, at ``values``' shapes."""
    return sum(
        _elements(row.concrete_shape(values)) * ITEM_BYTES[row.dtype]
        for row in io.outputs
        if row.retained is None
    )


def sent_bytes(io: LanguageIO, plain: LanguageIO, values) -> int:
    """Bytes of the inputs ``io`` feeds each call beyond ``plain``'s (retained state excluded)."""
    extra = [row for row in io.inputs if row.name not in plain.input_names and row.retained is None]
    return sum(_elements(row.concrete_shape(values)) * ITEM_BYTES[row.dtype] for row in extra)


def measure(directory: Path, full_batch_size: int, options: SamplerOptions) -> dict:
    """One family's row: vocabulary and bytes per decode step at batch 1 and ``full_batch_size``."""
    description = describe_checkpoint(directory)
    family = family_for(description)
    row = {"family": family.name, "config": directory.name, "vocab": family.text_dims(description).vocab_size}
    for label, batch, cb in (("b1", 1, False), ("cb", full_batch_size, True)):
        plain = family.language_table(description, continuous_batching=cb)
        sampled = with_sampler(plain, options)
        values = {
            **family.language_dims(description),
            **sampler_dims(options),
            symbols.BATCH_SIZE: batch,
            symbols.FULL_BATCH_SIZE: full_batch_size,
            symbols.SEQ_LEN: 1,
        }
        row[f"{label} logits"] = returned_bytes(plain, values)
        row[f"{label} tokens"] = returned_bytes(sampled, values)
        row[f"{label} sent"] = sent_bytes(sampled, plain, values)
    return row


def _size(count: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def table(rows: list[dict], full_batch_size: int) -> str:
    """The Markdown table: bytes returned per decode step with and without the sampler."""
    f = full_batch_size
    lines = [
        f"| family | config | vocab | batch 1: logits | batch 1: tokens | ratio | F={f}: logits "
        f"| F={f}: tokens | ratio | sampler inputs sent (b1 / F) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['config']} | {row['vocab']:,} | {_size(row['b1 logits'])} | "
            f"{_size(row['b1 tokens'])} | {row['b1 logits'] / row['b1 tokens']:,.0f}x | "
            f"{_size(row['cb logits'])} | {_size(row['cb tokens'])} | "
            f"{row['cb logits'] / row['cb tokens']:,.0f}x | "
            f"{_size(row['b1 sent'])} / {_size(row['cb sent'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], full_batch_size: int, path: Path) -> None:
    """Bars per family: bytes returned per decode step at ``full_batch_size``, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["family"] for row in rows]
    x = range(len(rows))
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    axes.bar([i - 0.2 for i in x], [row["cb logits"] for row in rows], width=0.4, label="logits")
    axes.bar([i + 0.2 for i in x], [row["cb tokens"] for row in rows], width=0.4, label="on-device sampler")
    axes.set_yscale("log")
    axes.set_xticks(list(x), names, rotation=45, ha="right")
    axes.set_ylabel("bytes returned per decode step")
    axes.set_title(f"Decode step at full_batch_size {full_batch_size}: logits vs sampled tokens")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-batch-size", type=int, default=16, help="Continuous-batching slots.")
    parser.add_argument("--max-top-k-ids", type=int, default=SamplerOptions().max_top_k_ids)
    parser.add_argument("--out", type=Path, default=None, help="Directory of the PNG (default: a temp dir).")
    parser.add_argument("--smoke", action="store_true", help=f"Only {', '.join(SMOKE_FAMILIES)}.")
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "sampler_bytes", argv):
        options = SamplerOptions(max_top_k_ids=args.max_top_k_ids)
        configs = pinned_configs()
        known = [family.name for family in all_families()]
        chosen = [name for name in known if name in configs and (not args.smoke or name in SMOKE_FAMILIES)]
        rows = [measure(configs[name], args.full_batch_size, options) for name in chosen]
        print(table(rows, args.full_batch_size))
        out = args.out or Path(tempfile.mkdtemp(prefix="sampler-bytes-"))
        out.mkdir(parents=True, exist_ok=True)
        png = plot_path(args, "sampler_bytes", out / "sampler_bytes.png")
        plot(rows, args.full_batch_size, png)
        print(f"\nplot: {png}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
