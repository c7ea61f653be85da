"""Decoder layers inline vs as ONNX functions: export seconds, graph bytes and nodes, side by side.

Usage:
    python benchmarks/subfunctions.py                      # Qwen2.5-VL-3B widths, 2 and 8 text layers
    python benchmarks/subfunctions.py --layers 2,8,36      # up to 36 text layers (2 vision layers)
    python benchmarks/subfunctions.py --full-depth --lock /work/heavy.lock   # the whole checkpoint
    python benchmarks/subfunctions.py --smoke              # the tiny checkpoint (seconds)

Each depth is a random checkpoint of the pinned Qwen2.5-VL-3B-Instruct config
(specs/configs) with every width real and the text depth cut to ``--layers``
(:mod:`qeff_vision.real_width`; 2 vision layers and the tiny tokenizer's vocabulary, which the
language graph's structure does not depend on), drawn in bfloat16. It is exported twice, inline
and with ``subfunctions`` (each in a fresh subprocess, float16-stored weights so the disk holds
one copy), and the language graph measured: export seconds (all, and the language trace alone),
graph proto bytes without the weights (initializers dropped: what the compiler parses besides
them), nodes of the main graph and of the layer function bodies, functions and calls. The last
column is the largest logit difference of the two forms on one prefill chunk (onnxruntime, fp32),
up to ``--parity-layers`` layers.

``--full-depth`` measures the checkpoint as published instead: every layer (36 text, 32 vision),
the 151,936-token vocabulary, bfloat16 (7.5 GB; built as ``benchmarks/full_depth.py`` builds it).
It needs ~15 GB of disk under ``--work`` (the checkpoint and one export at a time) and ~9 GB of
memory while the checkpoint is drawn; ``--lock FILE`` runs each step (build, each export) under
``flock FILE`` so that a shared machine's heavy runs do not overlap and no hold is longer than
one step.
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
CONFIG = ROOT / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct"


LOCK: Path | None = None  # --lock: every step runs under ``flock LOCK``


def _child(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line (we add its peak RSS)."""
    wrapped = (
        "import json, resource, sys\n"
        + code
        + "\nresult['peak_rss'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(json.dumps(result))\n"
    )
    command = [sys.executable, "-c", wrapped, *args]
    if LOCK is not None:
        command = ["flock", str(LOCK), *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


BUILD = """
from qeff_vision import api
from qeff_vision.real_width import build_real_width_checkpoint
if sys.argv[2] == "tiny":
    api.tiny("qwen2_5_vl", sys.argv[1], force=True)
elif sys.argv[2] == "full":
    from pathlib import Path
    pinned = json.loads((Path(sys.argv[3]) / "config.json").read_text())
    text, vision = pinned.get("text_config", pinned), pinned["vision_config"]
    build_real_width_checkpoint(
        "qwen2_5_vl", sys.argv[1], config=sys.argv[3], text_layers=text["num_hidden_layers"],
        vision_layers=vision.get("depth") or vision["num_hidden_layers"],
        vocab_size=text.get("vocab_size") or pinned["vocab_size"],
        dtype=pinned.get("torch_dtype") or text.get("torch_dtype") or "bfloat16",
    )
else:
    build_real_width_checkpoint(
        "qwen2_5_vl", sys.argv[1], config=sys.argv[3], text_layers=int(sys.argv[2]), vision_layers=2,
        dtype="bfloat16",
    )
result = {}
"""

EXPORT = """
import time
import onnx
from qeff_vision.exporter import export_model
from qeff_vision.numerics.layer_functions import layer_functions
start = time.perf_counter()
functions = sys.argv[3] == "1"
exported = export_model(
    sys.argv[1], sys.argv[2], force=True, progress=None, subfunctions=functions, weight_dtype=sys.argv[4]
)
seconds = time.perf_counter() - start
model = onnx.load(str(exported.program_path("lang")), load_external_data=False)
del model.graph.initializer[:]
functions = layer_functions(model)
calls = sum(1 for node in model.graph.node if (node.domain, node.op_type) in functions)
result = {
    "seconds": seconds,
    "trace": exported.timings["trace_language"],
    "graph_bytes": model.ByteSize(),
    "main_nodes": len(model.graph.node),
    "body_nodes": sum(len(f.node) for f in functions.values()),
    "functions": len(functions),
    "calls": calls,
}
"""

PARITY = """
import numpy as np
from qeff_vision.export_record import read_export
from qeff_vision.numerics.ort_graph import prepared_for_onnxruntime
from qeff_vision.numerics.device import session_for
from pathlib import Path

outputs = []
for directory in sys.argv[1:3]:
    directory = Path(directory)
    lang = read_export(directory)["programs"]["lang"]
    sizes = {"batch_size": 1, "seq_len": 8, "vision_batch_size": 1, "vision_size": 4, "ctx_len": 32}
    rng = np.random.RandomState(0)
    feeds = {}
    for name, spec in lang["inputs"].items():
        shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
        if spec["dtype"].startswith("float"):
            feeds[name] = (rng.randn(*shape) * 0.1).astype(spec["dtype"])
        else:
            feeds[name] = np.zeros(shape, spec["dtype"])
    feeds["input_ids"] = rng.randint(0, 100, feeds["input_ids"].shape).astype(np.int64)
    feeds["position_ids"] = np.broadcast_to(np.arange(8), feeds["position_ids"].shape).astype(np.int64).copy()
    path = directory / lang["path"]
    session = session_for(prepared_for_onnxruntime(path), path.parent, 0)
    outputs.append(session.run(["logits"], feeds)[0])
    del session
result = {"max_diff": float(np.abs(outputs[0] - outputs[1]).max())}
"""


def measure(layers: str, work: Path, parity: bool, weight_dtype: str) -> list[dict]:
    """Both forms of one depth (``tiny``, ``full`` or a number of text layers): one row each."""
    checkpoint = work / f"checkpoint-{layers}"
    _child(BUILD, str(checkpoint), layers, str(CONFIG))
    if layers == "full":  # the label the table shows
        pinned = json.loads((CONFIG / "config.json").read_text())
        layers = f"{pinned.get('text_config', pinned)['num_hidden_layers']} (full)"
    rows, exports = [], []
    for functions in (False, True):
        out = work / f"export-{layers}-{int(functions)}"
        row = _child(EXPORT, str(checkpoint), str(out), "1" if functions else "0", weight_dtype)
        rows.append({"layers": layers, "form": "functions" if functions else "inline", **row})
        exports.append(out)
        if not parity:
            shutil.rmtree(out)
    shutil.rmtree(checkpoint)
    if parity:
        rows[1]["max_diff"] = _child(PARITY, *map(str, exports))["max_diff"]
        for out in exports:
            shutil.rmtree(out)
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'text layers':>11}  {'form':>9}  {'export s':>8}  {'lang trace s':>12}  {'graph bytes':>11}  "
        f"{'main nodes':>10}  {'body nodes':>10}  {'functions':>9}  {'calls':>5}  {'peak RSS GB':>11}  "
        f"{'max |dlogits|':>13}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        diff = f"{row['max_diff']:.1e}" if "max_diff" in row else "-"
        print(
            f"{row['layers']:>11}  {row['form']:>9}  {row['seconds']:>8.1f}  {row['trace']:>12.1f}  "
            f"{row['graph_bytes']:>11,}  {row['main_nodes']:>10,}  {row['body_nodes']:>10,}  "
            f"{row['functions']:>9}  {row['calls']:>5}  {row['peak_rss'] / 2**30:>11.2f}  {diff:>13}"
        )


def ratios(rows: list[dict]) -> None:
    """Per depth: the function form's graph bytes and nodes as a fraction of the inline form's."""
    print()
    print(f"{'text layers':>11}  {'graph bytes ratio':>17}  {'nodes ratio':>11}  {'export s ratio':>14}")
    for inline, functions in zip(rows[::2], rows[1::2]):
        nodes = (functions["main_nodes"] + functions["body_nodes"]) / inline["main_nodes"]
        print(
            f"{inline['layers']:>11}  {functions['graph_bytes'] / inline['graph_bytes']:>17.3f}  "
            f"{nodes:>11.3f}  {functions['seconds'] / inline['seconds']:>14.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8", help="Text layers per run, comma-separated (36: full).")
    parser.add_argument("--parity-layers", type=int, default=8, help="Check parity up to this depth.")
    parser.add_argument(
        "--work", type=Path, default=None, help="Scratch directory (a temporary one by default)."
    )
    parser.add_argument("--smoke", action="store_true", help="The tiny checkpoint only (a quick check).")
    parser.add_argument(
        "--full-depth",
        action="store_true",
        help="The whole checkpoint (every layer, the real vocabulary, bfloat16) instead of --layers.",
    )
    parser.add_argument("--lock", type=Path, help="Run each step under `flock LOCK` (a shared machine).")
    add_docs_arguments(parser)
    args = parser.parse_args()
    global LOCK
    LOCK = args.lock
    if args.smoke:
        depths = ["tiny"]
    elif args.full_depth:
        depths = ["full"]
    else:
        depths = [layers.strip() for layers in args.layers.split(",")]
    with recording(args, "subfunctions", None):
        work = Path(tempfile.mkdtemp(prefix="subfunctions-", dir=args.work))
        try:
            rows = []
            for layers in depths:
                parity = layers == "tiny" or (layers != "full" and int(layers) <= args.parity_layers)
                rows += measure(layers, work, parity, "float32" if layers == "tiny" else "float16")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print_table(rows)
        ratios(rows)


if __name__ == "__main__":
    main()
