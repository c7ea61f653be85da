"""Mixture-of-experts: weight bytes read per decode step and prefill chunk, and decode time vs experts.

Usage:
    python benchmarks/moe_decode.py [--out /tmp/moe-decode]   # five pinned checkpoints (~10 min)
    python benchmarks/moe_decode.py --smoke                   # Qwen3-VL-30B-A3B only, short timing

1. Bytes, counted from the exported graph (``qeff_vision.compile.weight_reads``: each
   initializer is read whole, or only the rows its ``Gather`` nodes return, at the
   specialization's shapes after the shape arithmetic is folded as a compiler does). For each
   pinned MoE checkpoint (``specs/configs``) a random-weight checkpoint at the real widths is
   written in float16, its config cut by the real-width tier's rule (``qeff_vision.real_width``):
   the text depth cut to one period of its layer pattern, the experts cut to ``F x top_k + 4`` (so
   a CB decode at F rows still takes the routed form), the vocabulary cut to 1,000 (the tiny
   checkpoint's special token ids, all below it) and the vision tower cut to two layers (or its
   deepstack count);
   it is exported in float16 and each specialization of the pinned spec (its prefill buckets and
   decode at batch 1) plus a decode at batch ``--full-batch-size`` is counted. Scaling to the full
   checkpoint: the layers' bytes times (layers / period); the expert slices read per sparse layer
   are the graph's count where it is below the cut expert count, else the full count (a dense
   read of every expert: ``min(tokens x top_k, experts)``, which the graph's own count matches on
   the cut model); a weight with a vocabulary-sized axis read whole (the LM head) times
   (vocabulary / 1,000); gathered embedding rows as counted. Columns: ours, the dense form (every
   expert of every sparse layer read), and the routed limit (every non-expert weight the step
   reads plus min(tokens x top_k, experts) slices per sparse layer, tokens = batch x seq_len).
2. Time: onnxruntime (one thread) median of a decode call of each family's tiny checkpoint made
   heavy in experts (every layer sparse, ``moe_intermediate`` 2048) with 64 experts against the same
   widths with 4, in one run: the ratio (before issue 35 it was 10-14x, every expert read).

Prints both tables and writes ``moe_decode.png`` (bytes per decode step, log scale) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import plot_path, recording

ROOT = Path(__file__).resolve().parents[1]
CUT_VOCAB = 1000


@dataclass(frozen=True)
class Pinned:
    """A pinned MoE checkpoint and how its cut copy keeps the layer pattern.

    Attributes:
        config: Directory under ``specs/configs``.
        spec: Its spec under ``specs``.
        period: Text layers in one period of the pattern of (attention weights, feed-forward kind).
    """

    config: str
    spec: str
    period: int


PINNED = [
    # Every layer full attention and sparse.
    Pinned("Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_moe/qwen3_vl_moe-30b-a3b-instruct.yaml", 1),
    # Three Gated DeltaNet layers then one full-attention layer, every layer sparse + shared expert.
    Pinned("Qwen3.5-122B-A10B", "qwen3_5_moe/qwen3_5_moe-122b-a10b.yaml", 4),
    # Five sliding layers then one full layer (other head dims), experts beside the dense MLP.
    Pinned("gemma-4-26B-A4B-it", "gemma4/gemma-4-26b-a4b-it.yaml", 6),
    # Every layer sparse + shared expert (NoPE layers have the same weights as RoPE ones).
    Pinned("Llama-4-Scout-17B-16E-Instruct", "llama4/llama-4-scout-17b-16e-instruct.yaml", 1),
    # A dense layer then a sparse one.
    Pinned("Llama-4-Maverick-17B-128E-Instruct", "llama4/llama-4-maverick-17b-128e-instruct.yaml", 2),
]
EXPERT_KEYS = ("num_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts")


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _get(config: dict, keys) -> int:
    return next(_text(config)[key] for key in keys if _text(config).get(key))


def cut_config(pinned: Pinned, experts: int) -> dict:
    """The pinned config cut as the real-width tier cuts it (``real_width.cut_pinned_config``): every
    width kept, one period of text layers, ``experts`` experts, the cut vocabulary (the tiny
    checkpoint's token ids, all below it), the tier's short vision tower."""
    from qeff_vision.families import describe_checkpoint, family_for
    from qeff_vision.real_width import cut_pinned_config

    source = ROOT / "specs" / "configs" / pinned.config
    family = family_for(describe_checkpoint(source)).name
    return cut_pinned_config(
        family, source, text_layers=pinned.period, num_experts=experts, vocab_size=CUT_VOCAB
    )


# Runs in a fresh interpreter per checkpoint: writes the cut checkpoint tensor by tensor (float16,
# one tensor in memory at a time), exports it in float16, prints its own exported graph path.
WRITE_AND_EXPORT = """
import json, struct, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from qeff_vision.export.weights import parameters_on_meta
from qeff_vision.exporter import export_model
from qeff_vision.families import family_for
from qeff_vision.families.base import describe_checkpoint

source, out, export_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
config = AutoConfig.from_pretrained(str(out))
with parameters_on_meta():
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float16)
tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
# Qwen3-VL-MoE checkpoints store experts [experts, in, out]; transformers swaps axes 1 and 2 on load.
swap = family_for(describe_checkpoint(out)).name == "qwen3_vl_moe"
params = []
for key, value in model.state_dict().items():
    if key in tied:
        continue
    shape = list(value.shape)
    if swap and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        shape[1], shape[2] = shape[2], shape[1]
    params.append((key, shape, value.dim()))
entries, offset = {}, 0
for key, shape, _ in params:
    size = 2 * int(torch.tensor(shape).prod()) if shape else 2
    entries[key] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + size]}
    offset += size
header = json.dumps(entries).encode()
header += b" " * (-len(header) % 8)
generator = torch.Generator().manual_seed(0)
with open(out / "model.safetensors", "wb") as data:
    data.write(struct.pack("<Q", len(header)))
    data.write(header)
    for key, shape, dim in params:
        if dim <= 1:
            tensor = torch.ones(shape, dtype=torch.float16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).half()
        data.write(tensor.numpy().tobytes())
        del tensor
del model
export_model(out, export_dir, force=True, dtype="float16", progress=None)
"""


def _export_cut(pinned: Pinned, experts: int, work: Path) -> Path:
    source = ROOT / "specs" / "configs" / pinned.config
    out = work / f"{pinned.config}-cut"
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (out / path.name).write_bytes(path.read_bytes())
    config = cut_config(pinned, experts)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    export_dir = work / f"{pinned.config}-export"
    done = subprocess.run(
        [sys.executable, "-c", WRITE_AND_EXPORT, str(source), str(out), str(export_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode:
        raise SystemExit(f"{pinned.config}: export failed:\n{done.stderr[-3000:]}")
    return export_dir


def _specializations(pinned: Pinned, full_batch_size: int) -> list[tuple[str, dict]]:
    from qeff_vision import symbols
    from qeff_vision.spec import build_specializations, load_spec

    result = build_specializations(load_spec(ROOT / "specs" / pinned.spec))
    entries = [(entry.name, dict(entry.symbols)) for entry in result.language.specializations]
    decode = next(values for name, values in entries if name.startswith("Decode"))
    batched = dict(decode, **{symbols.BATCH_SIZE: str(full_batch_size)})
    return entries + [(f"Decode x{full_batch_size}", batched)]


def count_bytes(pinned: Pinned, full_batch_size: int, work: Path) -> list[dict]:
    """Rows of the bytes table for one pinned checkpoint (see the module docstring)."""
    from qeff_vision import symbols
    from qeff_vision.compile.weight_reads import weight_reads
    from qeff_vision.export_record import read_export

    config = json.loads((ROOT / "specs" / "configs" / pinned.config / "config.json").read_text())
    layers, vocab = _text(config)["num_hidden_layers"], _text(config)["vocab_size"]
    experts, top_k = _get(config, EXPERT_KEYS), _get(config, TOP_K_KEYS)
    cut_experts = full_batch_size * top_k + 4
    export_dir = _export_cut(pinned, cut_experts, work)
    graph = export_dir / read_export(export_dir)["programs"]["lang"]["path"]
    depth = layers / pinned.period
    rows = []
    for name, values in _specializations(pinned, full_batch_size):
        tokens = int(values[symbols.BATCH_SIZE]) * int(values[symbols.SEQ_LEN])
        reads = weight_reads(graph, values)
        expert_reads = [r for r in reads if r.rows_read is not None and r.shape[:1] == (cut_experts,)]
        expert_reads = [r for r in expert_reads if len(r.shape) == 3]
        counted = {r.rows_read for r in expert_reads}
        expected = min(tokens * top_k, cut_experts)
        if counted != {expected}:
            raise SystemExit(f"{pinned.config} {name}: the graph reads {counted} slices, not {expected}")
        slice_bytes = sum(r.read_bytes for r in expert_reads) / expected  # every sparse layer, one slice
        vocab_bytes = sum(
            r.read_bytes * (vocab / CUT_VOCAB if r.rows_read is None else 1)
            for r in reads
            if CUT_VOCAB in r.shape
        )
        layer_bytes = sum(r.read_bytes for r in reads if r not in expert_reads and CUT_VOCAB not in r.shape)
        others = vocab_bytes + depth * layer_bytes
        slices = expected if expected < cut_experts else min(tokens * top_k, experts)
        rows.append(
            {
                "checkpoint": pinned.config,
                "call": name,
                "tokens": tokens,
                "slices": slices,
                "experts": experts,
                "ours": others + depth * slice_bytes * slices,
                "dense": others + depth * slice_bytes * experts,
                "limit": others + depth * slice_bytes * min(tokens * top_k, experts),
            }
        )
    # The cut checkpoint and its export are several GB each (Qwen3.5-122B-A10B's: 2.7 GB): gone
    # before the next checkpoint is written.
    shutil.rmtree(export_dir.parent / f"{pinned.config}-cut")
    shutil.rmtree(export_dir)
    return rows


# ---- decode time, 64 experts against 4 ----

TIMED = {
    # family: (tiny module, its dict of text keys, layout key, overrides making every layer sparse)
    "qwen3_vl_moe": (
        "qeff_vision.families.qwen3_vl_moe.tiny",
        "MOE_TEXT",
        None,
        {"mlp_only_layers": [], "moe_intermediate_size": 2048},
    ),
    "qwen3_5_moe": (
        "qeff_vision.families.qwen3_5_moe.tiny",
        "MOE_TEXT",
        None,
        {"moe_intermediate_size": 2048},
    ),
    "gemma4": ("qeff_vision.families.gemma4.tiny", "LAYOUTS", "moe", {"moe_intermediate_size": 2048}),
    "llama4": (
        "qeff_vision.families.llama4.tiny",
        "TEXT",
        None,
        {"interleave_moe_layer_step": 1, "intermediate_size": 2048},
    ),
}
EXPERT_COUNT_KEYS = {"qwen3_vl_moe": "num_experts", "qwen3_5_moe": "num_experts", "gemma4": "num_experts"}


def _tiny_export(family: str, experts: int, intermediate: int, work: Path) -> Path:
    import importlib
    from unittest import mock

    from qeff_vision.exporter import export_model

    module, table, key, overrides = TIMED[family]
    tiny = importlib.import_module(module)
    target = getattr(tiny, table)[key] if key else getattr(tiny, table)
    size_key = next(k for k in overrides if k.endswith("intermediate_size"))
    patch = dict(
        overrides, **{size_key: intermediate, EXPERT_COUNT_KEYS.get(family, "num_local_experts"): experts}
    )
    out = work / f"{family}-{experts}"
    with mock.patch.dict(target, patch):
        checkpoint = tiny.write_tiny_checkpoint(out / "model", 0, *([key] if key else []))
    export_model(checkpoint, out / "export", progress=None)
    return out / "export"


def _decode_feeds(export_dir: Path, ctx_len: int = 128) -> tuple[Path, dict]:
    import numpy as np
    import onnx

    from qeff_vision import symbols
    from qeff_vision.export_record import read_export
    from qeff_vision.families import family_for
    from qeff_vision.families.base import describe_checkpoint

    manifest = read_export(export_dir)
    description = describe_checkpoint(Path(manifest["model"]))
    family = family_for(description)
    values = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: 1,
        "ctx_len": ctx_len,
        symbols.VISION_SIZE: 1,
        "vision_batch_size": 1,
        **family.language_dims(description),
        **family.kv_cache_lengths(description, ctx_len),
        **family.request_symbols(description, 1),
    }
    path = export_dir / manifest["programs"]["lang"]["path"]
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    feeds = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else int(values[d.dim_param]) for d in tensor.shape.dim
        ]
        feeds[value.name] = np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    return path, feeds


def decode_seconds(export_dir: Path, repeats: int) -> float:
    """Median seconds of one decode call (onnxruntime, one thread, zero caches)."""
    import onnxruntime as ort

    path, feeds = _decode_feeds(export_dir)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_rows(families, intermediate: int, repeats: int, work: Path) -> list[dict]:
    rows = []
    for family in families:
        few = decode_seconds(_tiny_export(family, 4, intermediate, work), repeats)
        many = decode_seconds(_tiny_export(family, 64, intermediate, work), repeats)
        rows.append({"family": family, "few": few, "many": many, "ratio": many / few})
    return rows


# ---- output ----


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f}"


def bytes_table(rows: list[dict]) -> str:
    lines = [
        "| checkpoint | call | tokens | slices / sparse layer | ours GB | dense GB | routed limit GB "
        "| ours / limit | dense / ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['checkpoint']} | {r['call']} | {r['tokens']} | {r['slices']} of {r['experts']} "
            f"| {_gb(r['ours'])} | {_gb(r['dense'])} | {_gb(r['limit'])} | {r['ours'] / r['limit']:.3f} "
            f"| {r['dense'] / r['ours']:.1f}x |"
        )
    return "\n".join(lines)


def time_table(rows: list[dict]) -> str:
    lines = ["| family | 4 experts ms | 64 experts ms | 64 / 4 |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['few'] * 1e3:.2f} | {r['many'] * 1e3:.2f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # Bytes per decode step against the expert count: dense grows with the experts, ours stays at
    # the routed limit (top_k slices per sparse layer) whatever the count.
    decode = sorted((r for r in rows if r["call"] == "Decode"), key=lambda r: (r["experts"], r["checkpoint"]))
    names = [f"{r['checkpoint']}\n{r['experts']} experts, {r['slices']} read" for r in decode]
    positions = range(len(decode))
    figure, axes = plt.subplots(figsize=(9, 4))
    for offset, key, label in (
        (-0.25, "dense", "dense (before)"),
        (0, "ours", "ours"),
        (0.25, "limit", "routed limit"),
    ):
        axes.bar([p + offset for p in positions], [r[key] / 1e9 for r in decode], 0.25, label=label)
    axes.set_xticks(list(positions), names, rotation=15, fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("GB read per decode step")
    axes.set_title("Language weights read per decode step (batch 1), log scale")
    axes.set_xlabel("checkpoint, by routed experts per sparse layer")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "moe-decode")
    parser.add_argument("--full-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="Qwen3-VL-30B-A3B bytes; timing at width 256")
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "moe_decode", None):
        args.out.mkdir(parents=True, exist_ok=True)
        pinned = PINNED[:1] if args.smoke else PINNED
        families = list(TIMED)[:2] if args.smoke else list(TIMED)
        with tempfile.TemporaryDirectory(dir=args.out) as work:
            rows = []
            for checkpoint in pinned:  # each checkpoint's rows as soon as they are counted
                counted = count_bytes(checkpoint, args.full_batch_size, Path(work))
                print(bytes_table(counted), file=sys.stderr, flush=True)  # progress; the whole table below
                rows += counted
            print(bytes_table(rows), flush=True)
            timed = time_rows(
                families, 256 if args.smoke else 2048, 3 if args.smoke else args.repeats, Path(work)
            )
        print()
        print(time_table(timed))
        png = plot_path(args, "moe_decode", args.out / "moe_decode.png")
        if plot(rows, png):
            print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
