"""Calibration peak RSS against depth and width: the default precision plan (``node_precision: auto``).

Usage:
    python benchmarks/calibration_memory.py            # Llama 3.2 Vision and Mistral 3, tiny and real widths
    python benchmarks/calibration_memory.py --smoke    # the tiny mllama checkpoint only (seconds)
    python benchmarks/calibration_memory.py --case mistral3-real-1L   # one row

Real widths are the pinned configs (specs/configs/Llama-3.2-11B-Vision-Instruct,
specs/configs/Mistral-Small-3.1-24B-Instruct-2503) with every width kept and only depth,
vocabulary and experts cut (:mod:`qeff_vision.real_width`), at N and 2N text layers (the vision
tower as the builder cuts it). Each checkpoint is built, exported and calibrated in its own fresh
subprocess, one after the other, and the calibration's own ``ru_maxrss`` is its row's peak: the
fp32 runs of both programs on the calibration prompt (one image at the spec's resolution, chunked,
three decode steps) and on the generated input of every specialization, every float node output's
peak recorded (:mod:`qeff_vision.numerics.recording`). The acceptance: 2N layers within 1.15x of
N's peak. Real widths need ~30 GB of disk while they run (each checkpoint's weights are deleted
after its export, each export after its calibration) and ~10 GB of memory for the largest
checkpoint build.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import plot_path, recording

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "specs" / "configs"
GB = 1e9


@dataclass(frozen=True)
class Case:
    """One checkpoint: a family at tiny width or at a pinned config's real widths with ``text_layers``."""

    family: str
    config: str | None = None  # a pinned config directory; None for the family's tiny checkpoint
    text_layers: int | None = None
    image: tuple[int, int] = (560, 560)
    ctx_len: int = 1024
    seq_len: int = 128

    @property
    def label(self) -> str:
        width = "tiny" if self.config is None else "real"
        return f"{self.family}-{width}" + (f"-{self.text_layers}L" if self.text_layers else "")


LLAMA = "Llama-3.2-11B-Vision-Instruct"
MISTRAL = "Mistral-Small-3.1-24B-Instruct-2503"
SMOKE = [Case("mllama", image=(100, 150), ctx_len=256, seq_len=32)]
FULL = [
    *SMOKE,
    Case("mistral3", image=(100, 150), ctx_len=256, seq_len=32),
    # mllama: one self- and one cross-attention layer, then twice that (560 px: one tile).
    Case("mllama", LLAMA, 2),
    Case("mllama", LLAMA, 4),
    # Mistral 3: 555 M parameters per text layer (2.2 GB in fp32); 448 px: 16 x 16 image tokens.
    Case("mistral3", MISTRAL, 1, image=(448, 448)),
    Case("mistral3", MISTRAL, 2, image=(448, 448)),
]


def _child(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; it sets ``result`` (we add its own peak RSS)."""
    wrapped = (
        "import json, resource, sys\n"
        + code
        + "\nresult['peak_rss'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(json.dumps(result))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapped, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    if done.returncode:
        raise SystemExit(f"step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


BUILD_AND_EXPORT = """
from pathlib import Path
from qeff_vision.exporter import export_model
family, checkpoint, export, config, layers = sys.argv[1:6]
if config:
    from qeff_vision.real_width import build_real_width_checkpoint
    build_real_width_checkpoint(family, checkpoint, config=config, text_layers=int(layers) or None)
else:
    from qeff_vision import api
    api.tiny(family, checkpoint)
export_model(Path(checkpoint), Path(export), progress=None)
result = {"weight_bytes": sum(p.stat().st_size for p in Path(export).rglob("*.onnx.data"))}
"""

CALIBRATE = """
import time
from pathlib import Path
from qeff_vision.compile.calibrate_only import calibrate
start = time.perf_counter()
plans = calibrate(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
result = {
    "seconds": time.perf_counter() - start,
    "fp32_nodes": {name: len(plan.names or []) for name, plan in plans.items()},
}
"""


def _layers(checkpoint: Path) -> tuple[int, int]:
    """(text layers, vision layers) of a checkpoint's config."""
    config = json.loads((checkpoint / "config.json").read_text())
    text, vision = config.get("text_config", config), config.get("vision_config", {})
    tower = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    return int(text["num_hidden_layers"]), tower + int(vision.get("num_global_layers") or 0)


def _spec(case: Case, checkpoint: Path, path: Path) -> Path:
    import yaml

    height, width = case.image
    spec = {
        "name": f"calibration-{case.label}",
        "model": str(checkpoint),
        "ctx_len": case.ctx_len,
        "prefill": {"seq_lens": [case.seq_len]},
        "vision": {"images": [{"height": height, "width": width}]},
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def measure(case: Case, work: Path) -> dict:
    """Build, export and calibrate ``case`` under ``work``, each in a fresh subprocess."""
    directory = work / case.label
    shutil.rmtree(directory, ignore_errors=True)
    checkpoint, export = directory / "checkpoint", directory / "export"
    config = str(CONFIGS / case.config) if case.config else ""
    exported = _child(
        BUILD_AND_EXPORT, case.family, str(checkpoint), str(export), config, str(case.text_layers or 0)
    )
    for weights in checkpoint.glob("*.safetensors"):  # calibration reads config and processor only
        weights.unlink()
    text_layers, vision_layers = _layers(checkpoint)
    spec = _spec(case, checkpoint, directory / "spec.yaml")
    calibrated = _child(CALIBRATE, str(spec), str(export), str(directory / "out"))
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "case": case.label,
        "family": case.family,
        "width": "tiny" if case.config is None else "real",
        "text_layers": text_layers,
        "vision_layers": vision_layers,
        "weight_bytes": exported["weight_bytes"],
        "peak_rss": calibrated["peak_rss"],
        "seconds": calibrated["seconds"],
        "fp32_nodes": calibrated["fp32_nodes"],
    }


def table(rows: list[dict]) -> str:
    """The measured rows, with each real-width row's peak relative to the family's fewest layers."""
    base = {}
    for row in rows:
        if row["width"] == "real":
            key = row["family"]
            base.setdefault(key, row)
            if row["text_layers"] < base[key]["text_layers"]:
                base[key] = row
    lines = [
        "| checkpoint | text layers | vision layers | fp32 weights GB | calibration peak RSS GB "
        "| peak / weights | peak vs fewest layers | seconds | fp32 nodes (vision, lang) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        reference = base.get(row["family"]) if row["width"] == "real" else None
        ratio = f"{row['peak_rss'] / reference['peak_rss']:.2f}x" if reference else "-"
        nodes = row["fp32_nodes"]
        lines.append(
            f"| {row['case']} | {row['text_layers']} | {row['vision_layers']} "
            f"| {row['weight_bytes'] / GB:.2f} | {row['peak_rss'] / GB:.2f} "
            f"| {row['peak_rss'] / max(row['weight_bytes'], 1):.2f} | {ratio} | {row['seconds']:.0f} "
            f"| {nodes.get('vision', 0)}, {nodes.get('lang', 0)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Against text layers, per family (real widths): peak RSS and fp32 weights; calibration seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, timing) = plt.subplots(1, 2, figsize=(11, 4))
    for family in sorted({row["family"] for row in rows}):
        real = sorted(
            (r for r in rows if r["family"] == family and r["width"] == "real"),
            key=lambda r: r["text_layers"],
        )
        chosen = real or [r for r in rows if r["family"] == family]
        layers = [r["text_layers"] for r in chosen]
        (line,) = axis.plot(
            layers, [r["peak_rss"] / GB for r in chosen], marker="o", label=f"{family}: calibration peak RSS"
        )
        axis.plot(
            layers,
            [r["weight_bytes"] / GB for r in chosen],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{family}: fp32 weights",
        )
        timing.plot(layers, [r["seconds"] for r in chosen], marker="o", color=line.get_color(), label=family)
    timing.set_xlabel("text layers")
    timing.set_ylabel("calibration seconds")
    timing.set_title("Calibration time vs depth")
    timing.legend(fontsize=7)
    axis.set_xlabel("text layers")
    axis.set_ylabel("GB")
    axis.set_title("Calibration memory vs depth (real widths)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints only")
    parser.add_argument("--work", type=Path, help="scratch directory (a temporary one by default)")
    parser.add_argument("--png", type=Path, default=Path("calibration_memory.png"), help="plot file")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--case", action="append", help="only the case(s) with this label (repeatable)")
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "calibration_memory", argv):
        cases = SMOKE if args.smoke else FULL
        if args.case:
            cases = [case for case in FULL if case.label in args.case]
        with tempfile.TemporaryDirectory(prefix="calibration-memory-", dir=args.work) as scratch:
            rows = []
            for case in cases:
                rows.append(measure(case, Path(scratch)))
                print(
                    f"measured {case.label}: {rows[-1]['peak_rss'] / GB:.2f} GB", file=sys.stderr, flush=True
                )
        print(table(rows))
        png = plot_path(args, "calibration_memory", args.png)
        plot(rows, png)
        print(f"plot: {png}")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
