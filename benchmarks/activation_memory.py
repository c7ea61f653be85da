"""Activation memory before and after attention blocking, per family and image size.

    flock /work/heavy.lock python benchmarks/activation_memory.py [--families qwen2_5_vl,...] [--rss]
    python benchmarks/activation_memory.py --smoke

For every family with a full-attention vision tower (and the per-tile ones, for comparison) the
script builds a real-width checkpoint with its depth cut (``qeff_vision.real_width``: the largest
intermediate does not depend on depth), exports it twice, with attention blocking off
(``UNBLOCKED``: one block per attention, the graphs before issue 54) and on (the default policy),
and measures both graphs side by side (``qeff_vision.compile.activation_memory``, fp16 device
bytes) at 448x448, 1280x720, 1920x1080 and 2560x1440 images as the family's own processor sizes
them, and the language program at seq_len 512 / ctx_len 32768. ``--rss`` adds the host peak RSS
of a plain fp32 onnxruntime run of the blocked vision program (a child process per image, its
``ru_maxrss``); the unblocked one only where its predicted peak is under ``--rss-limit`` GB.

``--smoke`` runs two tiny families at small images: every code path, seconds. On a shared host the
families can be measured in separate runs (``--families ... --json rows-N.json``, each family's
graphs before and after still measured side by side in one run) and printed as one table with
``--merge rows-*.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

IMAGES = ((448, 448), (720, 1280), (1080, 1920), (1440, 2560))
SMOKE_IMAGES = ((64, 64), (96, 128))
LANGUAGE = {"batch_size": 1, "seq_len": 512, "ctx_len": 32768, "vision_size": 512, "vision_batch_size": 1}
SMOKE_LANGUAGE = {**LANGUAGE, "ctx_len": 256, "seq_len": 32, "vision_size": 32}
MIB = 1 << 20


def _checkpoint(family: str, work: Path, smoke: bool) -> Path:
    from qeff_vision import api
    from qeff_vision.real_width import build_real_width_checkpoint

    out = work / f"{family}-checkpoint"
    if (out / "config.json").is_file():  # built by an earlier run (--checkpoints); written atomically
        return out
    if smoke:
        return api.tiny(family, out)
    return build_real_width_checkpoint(family, out)


def _export(checkpoint: Path, out: Path, policy) -> Path:
    from qeff_vision.exporter import export_model

    export_model(checkpoint, out, progress=None, attention_blocking=policy)
    return out


def _vision_feeds(family: str, checkpoint: Path, height: int, width: int) -> dict | None:
    """The vision program's inputs for one random image, as the family's processor and host make them."""
    import numpy as np
    from PIL import Image

    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.families import get_family
    from qeff_vision.families.base import ImageSize, ModelDescription
    from qeff_vision.inputs.prompt import as_arrays

    opened = Checkpoint.open(checkpoint)
    model = ModelDescription(json.loads((checkpoint / "config.json").read_text()))
    family_obj = get_family(family)
    if family_obj.validate_image(model, ImageSize(height, width)):
        return None  # the family does not take this size
    pixels = (np.random.RandomState(0).rand(height, width, 3) * 255).astype("uint8")
    # As the host runs the processor: torch tensors, bfloat16 widened (Llama 4 normalizes in bf16).
    processed = opened.processor.image_processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    arrays = {}
    for name, value in as_arrays(dict(processed)).items():
        value = np.asarray(value)
        arrays[name] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return family_obj.host(model).vision_inputs(arrays)[0]


def _bound_symbols(graph: Path, feeds: dict) -> dict[str, int]:
    """Symbol values read off the feeds' shapes (what a specialization of this image binds)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    values = {}
    for value in model.graph.input:
        if value.name not in feeds:
            continue
        for dim, size in zip(value.type.tensor_type.shape.dim, feeds[value.name].shape):
            if dim.dim_param:
                values[dim.dim_param] = int(size)
    return values


def _rss_child(graph: Path, feeds: dict, work: Path) -> float:
    """Peak RSS (GB) of a child process that runs ``graph`` once on ``feeds`` with onnxruntime, fp32."""
    import numpy as np

    path = work / "feeds.npz"
    np.savez(path, **feeds)
    code = (
        "import numpy as np, onnxruntime as ort, sys\n"
        "feeds = dict(np.load(sys.argv[2]))\n"
        "options = ort.SessionOptions(); options.intra_op_num_threads = 1\n"
        "session = ort.InferenceSession(sys.argv[1], options, providers=['CPUExecutionProvider'])\n"
        "names = {i.name for i in session.get_inputs()}\n"
        "session.run(None, {k: v for k, v in feeds.items() if k in names})\n"
        # VmHWM: this process image's own peak (ru_maxrss would keep the forking parent's).
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(graph), str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        return float("nan")
    return int(done.stdout.split()[-1]) / (1 << 20)  # KiB -> GiB


def _language_extras(family: str, checkpoint: Path, ctx_len: int) -> dict[str, int]:
    """Language symbols beyond seq_len/ctx_len, as the family declares them for ``checkpoint``.

    Its cache lengths (rings, Kimi-K2.5's latent widths), its own symbols (Qwen3-VL's deepstack
    rows) and one image slot's (mllama's cross-attention states), as ``specialize`` binds them.
    """
    from qeff_vision.families import get_family
    from qeff_vision.families.base import ModelDescription

    model = ModelDescription(json.loads((checkpoint / "config.json").read_text()))
    family_obj = get_family(family)
    return {
        **family_obj.kv_cache_lengths(model, ctx_len),
        **family_obj.language_symbols(model),
        **family_obj.request_symbols(model, 1),
    }


def measure(
    family: str,
    work: Path,
    smoke: bool,
    rss: bool,
    rss_limit: float,
    forms: tuple[str, ...] = ("off", "on"),
    checkpoints: Path | None = None,
) -> list[dict]:
    """Rows of one family: its images (vision program) and the language prefill, ``forms`` of each."""
    from qeff_vision.compile.activation_memory import graph_activation_memory
    from qeff_vision.export.blocked_attention import UNBLOCKED, AttentionBlocking

    checkpoint = _checkpoint(family, checkpoints or work, smoke)
    policies = {"off": UNBLOCKED, "on": AttentionBlocking()}
    graphs = {form: _export(checkpoint, work / f"{family}-{form}", policies[form]) for form in forms}
    rows = []
    for height, width in SMOKE_IMAGES if smoke else IMAGES:
        feeds = _vision_feeds(family, checkpoint, height, width)
        row = {"family": family, "program": "vision", "shape": f"{width}x{height}"}
        if feeds is None:
            rows.append({**row, "note": "size not accepted"})
            continue
        for form, directory in graphs.items():
            graph = directory / "vision" / "model.onnx"
            figures = graph_activation_memory(graph, _bound_symbols(graph, feeds))
            row[f"largest_{form}"], row[f"peak_{form}"] = figures.largest_bytes, figures.peak_bytes
            row["unresolved"] = row.get("unresolved", 0) + figures.unresolved
            if rss and (form == "on" or figures.peak_bytes * 2 / (1 << 30) < rss_limit):
                row[f"rss_{form}"] = _rss_child(graph, feeds, work)  # fp32 on the host: 2x the fp16 figures
        rows.append(row)
    language = dict(SMOKE_LANGUAGE if smoke else LANGUAGE)
    language.update(_language_extras(family, checkpoint, language["ctx_len"]))
    row = {"family": family, "program": "lang", "shape": f"S{language['seq_len']}/ctx{language['ctx_len']}"}
    for form, directory in graphs.items():
        figures = graph_activation_memory(directory / "lang" / "model.onnx", language)
        row[f"largest_{form}"], row[f"peak_{form}"] = figures.largest_bytes, figures.peak_bytes
        row["unresolved"] = row.get("unresolved", 0) + figures.unresolved
    rows.append(row)
    return rows


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _gb(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    """Markdown table: largest intermediate and peak live bytes (fp16 MiB) off/on, host RSS (GB)."""
    header = (
        "| family | program | image / shape | largest off | largest on | peak off | peak on "
        "| RSS fp32 off (GB) | RSS fp32 on (GB) | unresolved |"
    )
    lines = [header, "|" + "---|" * 10]
    for row in rows:
        if "note" in row:
            # as wide as the header (a ragged row is not a Markdown table row)
            cells = [row["family"], row["program"], row["shape"], row["note"], *["-"] * 6]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [
            row["family"],
            row["program"],
            row["shape"],
            _mib(row.get("largest_off")),
            _mib(row.get("largest_on")),
            _mib(row.get("peak_off")),
            _mib(row.get("peak_on")),
            _gb(row.get("rss_off")),
            _gb(row.get("rss_on")),
            str(row.get("unresolved", 0)),  # values whose shape did not resolve: not in the figures
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated families (default: every vision family)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints, two families, small images")
    parser.add_argument("--rss", action="store_true", help="measure the host peak RSS of an fp32 run")
    parser.add_argument("--rss-limit", type=float, default=6.0, help="skip unblocked runs predicted above GB")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="print one table from the --json rows of earlier runs (rows of one family, program and "
        "shape from runs of different --forms become one row)",
    )
    parser.add_argument("--forms", default="off,on", help="which exports to measure: off, on or both")
    parser.add_argument(
        "--checkpoints", type=Path, help="build the real-width checkpoints here and reuse them if present"
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "activation_memory", argv):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Measure what ``args`` asks for and print the table."""
    if args.merge:
        merged: dict[tuple, dict] = {}
        for path in args.merge:
            for row in json.loads(path.read_text()):
                key = (row["family"], row["program"], row["shape"])
                merged.setdefault(key, {}).update(row)
        print(table(list(merged.values())))
        return 0
    forms = tuple(form for form in args.forms.split(",") if form)
    if not forms or set(forms) - {"off", "on"}:
        print(f"activation_memory.py: --forms takes off, on or off,on, not {args.forms!r}", file=sys.stderr)
        return 2
    if args.smoke:
        families = ["qwen2_5_vl", "mistral3"]
    elif args.families:
        families = args.families.split(",")
    else:
        from qeff_vision.families import all_families
        from qeff_vision.spec.activation_estimate import blocked_towers

        blocked = blocked_towers()  # the towers the export blocks first, then the per-tile ones
        names = [family.name for family in all_families()]
        families = [*blocked, *(name for name in names if name not in blocked)]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        for family in families:
            work = Path(scratch) / family
            work.mkdir()
            rows += measure(
                family, work, args.smoke, args.rss or args.smoke, args.rss_limit, forms, args.checkpoints
            )
            print(f"done: {family}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
