"""Export peak RSS against the exported weight bytes, per dtype, with stage timings and parity.

Usage:
    python benchmarks/export_memory.py                              # tiny Qwen2.5-VL (seconds)
    python benchmarks/export_memory.py --config qwen2_5_vl-3b-full  # every layer of the 3B config

``qwen2_5_vl-3b-full`` is the pinned Qwen2.5-VL-3B-Instruct config (specs/configs; 36 text + 32
vision layers, 3.75 B parameters) with random weights, written tensor by tensor so the writer never
holds more than one tensor either. It needs ~15 GB of disk for the checkpoint plus the exports, and
the fp32 parity step maps ~15 GB of files (file-backed pages the kernel may drop; no anonymous copy).

Every step runs in a fresh subprocess that reports its own ``ru_maxrss``, so each row's peak is
its own. Parity: the exported language graph (onnxruntime) against transformers' own forward on a
short text prompt (last-position logits), with the reference model's weights memory-mapped from
the checkpoint; and the vision graph against the traced torch module on its example inputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"qwen2_5_vl-3b-full": ROOT / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct"}
PROMPT_TOKENS = 12


def _child(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line (we add its peak RSS)."""
    wrapped = (
        "import json, resource, sys\n"
        + code
        + "\nresult['peak_rss'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(json.dumps(result))\n"
    )
    done = subprocess.run([sys.executable, "-c", wrapped, *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


WRITE_RANDOM = """
import json, struct
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from qeff_vision.export.weights import parameters_on_meta

source, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for name in ("config.json", "preprocessor_config.json"):
    if (source / name).exists():
        (out / name).write_bytes((source / name).read_bytes())
config = AutoConfig.from_pretrained(str(out))
with parameters_on_meta():
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
entries, offset = {}, 0
params = [(k, v) for k, v in model.state_dict().items() if k not in tied]
for key, value in params:
    size = value.numel() * 4
    entries[key] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + size]}
    offset += size
header = json.dumps(entries).encode()
header += b" " * (-len(header) % 8)
generator = torch.Generator().manual_seed(0)
std = float(getattr(config.get_text_config(), "initializer_range", 0.02))
with open(out / "model.safetensors", "wb") as data:
    data.write(struct.pack("<Q", len(header)))
    data.write(header)
    for key, value in params:  # one tensor in memory at a time
        if value.dim() == 1:
            tensor = torch.ones(value.shape) if key.endswith("weight") else torch.zeros(value.shape)
        else:
            tensor = torch.randn(value.shape, generator=generator) * std
        data.write(tensor.numpy().tobytes())
        del tensor
result = {"weight_params": offset // 4, "tensors": len(params)}
"""

EXPORT = """
from qeff_vision.exporter import export_model
exported = export_model(sys.argv[1], sys.argv[2], force=True, dtype=sys.argv[3], progress=None)
result = {"timings": exported.timings}
"""

PARITY = """
from pathlib import Path
import numpy as np, torch
import onnxruntime as ort
from transformers import AutoConfig, AutoModelForImageTextToText
from qeff_vision.export_record import read_export
from qeff_vision.export.weights import assign_mapped_weights, parameters_on_meta

model_dir, export_dir, tokens = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
manifest = read_export(export_dir)
config = AutoConfig.from_pretrained(str(model_dir))
with parameters_on_meta():
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="eager")
model = assign_mapped_weights(model_dir, model).eval()
vocab = min(1000, config.get_text_config().vocab_size)
ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    reference = model(input_ids=ids).logits[0, -1].numpy()
del model
lang = manifest["programs"]["lang"]
options = ort.SessionOptions()
session = ort.InferenceSession(str(export_dir / lang["path"]), options, providers=["CPUExecutionProvider"])
feeds = {}
for name, spec in lang["inputs"].items():
    dtype = np.dtype(spec["dtype"])
    sizes = {"batch_size": 1, "seq_len": tokens, "vision_batch_size": 1, "vision_size": 1, "ctx_len": 32}
    shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
    feeds[name] = np.zeros(shape, dtype)
positions = np.arange(tokens, dtype=np.int64)
feeds["input_ids"] = ids.numpy()
feeds["position_ids"] = np.broadcast_to(positions, feeds["position_ids"].shape).copy()
logits = session.run(["logits"], feeds)[0].reshape(-1).astype(np.float32)
spread = float(reference.max() - reference.min())
result = {
    "max_abs": float(np.abs(logits - reference).max()),
    "relative": float(np.abs(logits - reference).max() / spread),
    "top1_same": bool(int(logits.argmax()) == int(reference.argmax())),
}
"""


def weight_bytes(header_params: int, dtype: str) -> int:
    """Bytes of every weight in the export dtype."""
    return header_params * (4 if dtype == "float32" else 2)


def measure(config: str, dtypes, work: Path, keep: bool = False) -> tuple[dict, list[dict]]:
    """Write the checkpoint of ``config`` under ``work``, then export and check it once per dtype.

    Returns:
        The checkpoint writer's report (``weight_params``, ``peak_rss``) and one dict per dtype:
        ``dtype``, ``weight_bytes``, ``peak_rss``, ``timings`` (seconds per export stage) and
        ``parity`` (``max_abs``, ``relative``, ``top1_same``).
    """
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    if config == "tiny":
        import math

        from safetensors import safe_open

        from qeff_vision import api

        api.tiny("qwen2_5_vl", checkpoint, force=True)
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
            params = sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys())
        writer = {"weight_params": params, "peak_rss": 0}
    else:
        writer = _child(WRITE_RANDOM, str(CONFIGS[config]), str(checkpoint))
    rows = []
    for dtype in dtypes:
        out = work / f"export-{dtype}"
        exported = _child(EXPORT, str(checkpoint), str(out), dtype)
        parity = _child(PARITY, str(checkpoint), str(out), str(PROMPT_TOKENS))
        rows.append(
            {
                "dtype": dtype,
                "weight_bytes": weight_bytes(writer["weight_params"], dtype),
                "peak_rss": exported["peak_rss"],
                "timings": exported["timings"],
                "parity": parity,
            }
        )
        if not keep:
            shutil.rmtree(out)
    return writer, rows


def table(rows: list[dict]) -> str:
    """The printed table: one line per dtype."""
    lines = [
        f"{'dtype':<8}  {'weights GiB':>11}  {'peak RSS GiB':>12}  {'RSS/weights':>11}  "
        f"{'stage seconds':<72}  {'lang logits vs transformers'}"
    ]
    for row in rows:
        stages = " ".join(f"{k} {v:.1f}" for k, v in row["timings"].items())
        parity = row["parity"]
        check = (
            f"max |d| {parity['max_abs']:.2e} ({parity['relative']:.1e} of range), "
            f"top-1 {'same' if parity['top1_same'] else 'DIFFERS'}"
        )
        lines.append(
            f"{row['dtype']:<8}  {row['weight_bytes'] / 2**30:>11.2f}  {row['peak_rss'] / 2**30:>12.2f}  "
            f"{row['peak_rss'] / row['weight_bytes']:>11.2f}  {stages:<72}  {check}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", choices=["tiny", *CONFIGS])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and exports")
    parser.add_argument(
        "--smoke", action="store_true", help="The tiny config in float32 only (a quick check of every path)."
    )
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "export_memory", None):
        if args.smoke:
            args.config, args.dtypes = "tiny", ["float32"]
        work = args.work or Path(tempfile.mkdtemp(prefix="qeff-export-bench-"))
        writer, rows = measure(args.config, args.dtypes, work, args.keep)
        print(
            f"{args.config}: {writer['weight_params'] / 1e9:.3f} B parameters; random checkpoint writer "
            f"peak RSS {writer['peak_rss'] / 2**30:.2f} GiB"
        )
        print(table(rows))
        if not args.keep and args.work is None:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
