"""The host cost of `compile` at full depth: each stage's seconds, peak RSS and bytes on disk.

Usage:
    python benchmarks/full_depth.py --work /path/with/25GB     # Qwen2.5-VL-3B, 448x448 + 1080x1920
    python benchmarks/full_depth.py --images 448x448,720x1280  # other resolutions
    python benchmarks/full_depth.py --smoke                    # the tiny checkpoint (seconds)

A random checkpoint of the pinned config (specs/configs/Qwen2.5-VL-3B-Instruct) with every
dimension real (36 text and 32 vision layers, the 151,936-token vocabulary) is drawn in its
published dtype (bfloat16: 7.5 GB) and written like a real one (:mod:`qeff_vision.real_width`).
The plainest spec (batch 1, ``ctx_len`` 4096, prefill 128, the images) is then exported,
specialized and compiled through the SDK path against a compiler stand-in that only writes the
program (the real compiler's time is not the host's), each stage in a fresh subprocess whose own
peak RSS is its row's. Rows:

* ``build``, ``export``, ``specialize``: as the user runs them;
* ``compile (auto)``: the default precision plan: ``calibration`` (prompts through the runtime
  and every specialization's generated input, every node output recorded; timed inside the
  compile) and the rest (``compile other``: hashing, inputs, the compiler);
* ``recompile (plan reused)``: the same program into another OUT: the plan comes from the store
  and the log has no calibration stage;
* ``compile (none)``: ``node_precision: none`` for reference (the prompts still run to check
  that nothing overflows);
* ``plain fp32 run``: the calibration's own calls with nothing recorded (the same prompts, images,
  teacher-forced decode steps and generated inputs, one slice-major pass per program: each
  slice's session built once, every call run through it): what the inputs cost to run at all on
  this host. A whole-graph session is not used: at full depth the language graph's fp32 weights
  alone are 12.3 GB.

Targets (issue 48): calibration <= 1.5x the plain run; export + compile <= 5x export; every
stage's peak RSS <= 6 GB. Needs ~25 GB of disk under ``--work`` (deleted at the end unless
``--keep``) and an hour or more on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct"
FAMILY = "qwen2_5_vl"
GB = 1e9

# A compiler that only writes the program: the SDK layout the product looks for (exec/ and the
# version file), and an executable that writes programqpc.bin into -aic-binary-dir.
APPS_XML = """<?xml version="1.0" encoding="UTF-8"?>
<versions><ci_build><base_name>AIC_APPS_STAND_IN</base_name><base_version>1.20</base_version>
<build_id>2.0</build_id></ci_build></versions>
"""
COMPILER = """import json, pathlib, sys
values = dict(arg.partition("=")[::2] for arg in sys.argv[1:] if "=" in arg)
out = pathlib.Path(values["-aic-binary-dir"])
out.mkdir(parents=True, exist_ok=True)
(out / "programqpc.bin").write_bytes(json.dumps({"argv": sys.argv[1:], "stand_in": True}).encode())
print("stand-in: program written", flush=True)
"""


def stand_in_compiler(root: Path) -> Path:
    """Install the write-only compiler under ``root``; its path."""
    (root / "exec").mkdir(parents=True, exist_ok=True)
    (root / "versions").mkdir(exist_ok=True)
    (root / "versions" / "apps.xml").write_text(APPS_XML)
    script = root / "stand_in.py"
    script.write_text(COMPILER)
    wrapper = root / "exec" / "qaic-exec"
    wrapper.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{script}' \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _child(code: str, *args: str, cache: Path | None = None, live: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it sets ``result`` (we add seconds and its own peak RSS)."""
    wrapped = (
        "import json, resource, sys, time\n_start = time.perf_counter()\n"
        + code
        + "\nresult['seconds'] = time.perf_counter() - _start\n"
        "_usage = resource.getrusage(resource.RUSAGE_SELF)\n"
        "result['peak_rss'] = _usage.ru_maxrss * 1024\n"
        "result['cpu'] = _usage.ru_utime + _usage.ru_stime\n"
        "print(json.dumps(result))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QEFF_VISION_CACHE": str(cache) if cache else "off"}
    child = subprocess.Popen(
        [sys.executable, "-c", wrapped, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(child.stdout.read()), daemon=True)
    reader.start()
    # The host's load while the stage runs (a shared host stretches wall seconds, not CPU seconds).
    loads: list[float] = []
    ended = threading.Event()

    def sample() -> None:
        while not ended.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # Each stderr line with when it arrived: the longest silence is what a CI log shows.
    start, lines = time.monotonic(), []
    for line in child.stderr:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
        if live is not None:  # to follow a long stage while it runs
            with live.open("a") as stream:
                stream.write(f"[{lines[-1][0]:7.1f}s] {lines[-1][1]}\n")
    child.wait()
    reader.join()
    ended.set()
    log = "\n".join(f"[{at:7.1f}s] {line}" for at, line in lines)
    if child.returncode:
        raise SystemExit(f"step failed:\n{log[-4000:]}")
    result = json.loads(out[0].strip().splitlines()[-1])
    result["log"] = log
    result["load"] = sum(loads) / len(loads) if loads else os.getloadavg()[0]
    stamps = [0.0, *(at for at, _ in lines), time.monotonic() - start]
    result["longest_silence"] = max(b - a for a, b in zip(stamps, stamps[1:]))
    return result


BUILD = """
from pathlib import Path
family, out, config, smoke, text_layers, vision_layers = sys.argv[1:7]
if smoke == "1":
    from qeff_vision import api
    api.tiny(family, out)
else:
    import json
    from qeff_vision.real_width import build_real_width_checkpoint
    pinned = json.loads((Path(config) / "config.json").read_text())
    text, vision = pinned.get("text_config", pinned), pinned["vision_config"]
    build_real_width_checkpoint(
        family, out, config=config, text_layers=int(text_layers) or text["num_hidden_layers"],
        vision_layers=int(vision_layers) or vision.get("depth") or vision["num_hidden_layers"],
        vocab_size=text.get("vocab_size") or pinned["vocab_size"],
        dtype=pinned.get("torch_dtype") or text.get("torch_dtype") or "bfloat16",
    )
result = {}
"""

CLI = """
from qeff_vision.cli import main
code = main(sys.argv[1:])
if code:
    raise SystemExit(code)
result = {}
"""

# Counts the calls of the sliced graphs, the passes over their weights and the sessions built.
COUNTERS = """
from qeff_vision.numerics import recording
recorders = []
init = recording.SlicedRecorder.__init__
def counted(self, *args, **kwargs):
    init(self, *args, **kwargs)
    recorders.append(self)
recording.SlicedRecorder.__init__ = counted
def work():
    return {
        "calls": sum(r.calls_run for r in recorders),
        "passes": sum(r.passes for r in recorders),
        "sessions": sum(r.sessions_built for r in recorders),
    }
"""

COMPILE = (
    COUNTERS
    + """
from pathlib import Path
from qeff_vision.compile import precision
from qeff_vision.compile.driver import compile_spec
timed = {"calibration": 0.0, "calibration_cpu": 0.0}
resolve = precision.resolve_plans
def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
def resolve_plans(*args, **kwargs):
    start, cpu = time.perf_counter(), _cpu()
    try:
        return resolve(*args, **kwargs)
    finally:
        timed["calibration"] += time.perf_counter() - start
        timed["calibration_cpu"] += _cpu() - cpu
precision.resolve_plans = resolve_plans
import qeff_vision.compile.driver as driver
driver.resolve_plans = resolve_plans
spec, out, export, compiler = sys.argv[1:5]
compile_spec(Path(spec), Path(out), compiler=compiler, export_dir=Path(export))
result = {"calibration": timed["calibration"], "calibration_cpu": timed["calibration_cpu"], **work()}
"""
)

# The calibration's calls with nothing recorded: no node output is a recorded value.
PLAIN = (
    COUNTERS
    + """
from pathlib import Path
import qeff_vision.numerics.device as device
import qeff_vision.numerics.plan as plan
device.float_outputs = plan.float_outputs = lambda *args, **kwargs: []
from qeff_vision.compile.calibrate_only import calibrate
calibrate(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
result = work()
"""
)


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (hard links counted once)."""
    seen, total = set(), 0
    for item in Path(path).rglob("*"):
        if item.is_file() and not item.is_symlink():
            stat = item.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def write_spec(
    path: Path, checkpoint: Path, images, ctx_len: int, seq_len: int, precision: str, budget="default"
) -> Path:
    """The benchmark's spec; ``budget``: ``compile.calibration.max_prompt_tokens`` unless "default"."""
    import yaml

    spec = {
        "name": f"full-depth-{precision}",
        "model": str(checkpoint),
        "ctx_len": ctx_len,
        "prefill": {"seq_lens": [seq_len]},
        "vision": {"images": [{"height": h, "width": w} for h, w in images]},
        "compile": {"node_precision": precision},
    }
    if budget != "default":
        spec["compile"]["calibration"] = {"max_prompt_tokens": budget}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


STAGES = ("build", "export", "specialize", "compile", "recompile", "reference", "plain")


def measure(
    work: Path,
    images,
    ctx_len: int,
    seq_len: int,
    smoke: bool,
    stages=STAGES,
    layers=(0, 0),
    budget="default",
) -> list[dict]:
    """Every row, in order, each stage in its own subprocess under ``work``.

    ``layers`` (text, vision) cut the checkpoint's depth (0: the pinned config's); widths and the
    vocabulary stay real, so each layer costs what it costs at full depth. ``budget``: the
    calibration's ``max_prompt_tokens`` (None: every prompt whole; "default": the spec default).

    Results are saved in ``work/rows.json`` as stages finish: a later call with the same ``work``
    runs only the ``stages`` not measured yet (a long run split into several, one at a time).
    """
    saved = work / "rows.json"
    done: dict[str, list[dict]] = json.loads(saved.read_text()) if saved.is_file() else {}
    checkpoint, export = work / "checkpoint", work / "export"
    compiler = stand_in_compiler(work / "sdk")
    auto = write_spec(work / "auto.yaml", checkpoint, images, ctx_len, seq_len, "auto", budget)
    none = write_spec(work / "none.yaml", checkpoint, images, ctx_len, seq_len, "none", budget)
    store = work / "plan-store"

    def entry(stage: str, result: dict, disk: Path | None = None, seconds: float | None = None) -> dict:
        return {
            "stage": stage,
            "seconds": result["seconds"] if seconds is None else seconds,
            "peak_rss": result.get("peak_rss"),
            "disk": disk_bytes(disk) if disk is not None else None,
            "cpu": result.get("cpu"),
            "load": result.get("load"),
        }

    def compile_rows(spec: Path, out: str, label: str, cache: Path | None) -> list[dict]:
        live = work / f"{out}.live.log"
        live.unlink(missing_ok=True)
        result = _child(
            COMPILE, str(spec), str(work / out), str(export), str(compiler), cache=cache, live=live
        )
        rows = [entry(label, result, work / out)]
        for key in ("calibration", "calibration_cpu", "calls", "passes", "sessions"):
            rows[0][key] = result[key]
        rows[0]["calibration_in_log"] = "calibrating device precision" in result["log"]
        rows[0]["longest_silence"] = result["longest_silence"]
        (work / f"{out}.log").write_text(result["log"] + "\n")  # stderr lines, timed
        return rows

    def plain_row() -> dict:
        live = work / "out-plain.live.log"
        live.unlink(missing_ok=True)
        result = _child(PLAIN, str(auto), str(export), str(work / "out-plain"), live=live)
        return {**entry("plain fp32 run", result), **{k: result[k] for k in ("calls", "passes", "sessions")}}

    steps = {
        "build": lambda: [
            entry(
                "build",
                _child(
                    BUILD,
                    FAMILY,
                    str(checkpoint),
                    str(CONFIG),
                    "1" if smoke else "0",
                    *(str(n) for n in layers),
                ),
                checkpoint,
            )
        ],
        "export": lambda: [
            entry("export", _child(CLI, "export", str(checkpoint), "-o", str(export)), export)
        ],
        "specialize": lambda: [
            entry("specialize", _child(CLI, "specialize", str(auto), "-o", str(work / "specialized")))
        ],
        "compile": lambda: compile_rows(auto, "out-auto", "compile (auto)", store),
        "recompile": lambda: compile_rows(auto, "out-again", "recompile (plan reused)", store),
        "reference": lambda: compile_rows(none, "out-none", "compile (none)", None),
        "plain": lambda: [plain_row()],
    }
    for stage in STAGES:
        if stage in stages and stage not in done:
            done[stage] = steps[stage]()
            saved.write_text(json.dumps(done, indent=2))
            print(f"# {stage}: {done[stage][0]['seconds']:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for stage in STAGES:
        for row in done.get(stage, []):
            if stage == "compile":  # the calibration and the rest of the compile, apart
                apart = {"disk": None, "calls": None}  # the counts are the whole compile's
                cpu = row.get("calibration_cpu")
                rows.append(
                    {**row, **apart, "stage": "calibration", "seconds": row["calibration"], "cpu": cpu}
                )
                rows.append(
                    {
                        **row,
                        **apart,
                        "stage": "compile other",
                        "seconds": row["seconds"] - row["calibration"],
                        "cpu": row["cpu"] - cpu if row.get("cpu") and cpu is not None else None,
                    }
                )
            rows.append(row)
    rows.append({"summary": _summary(done)})
    return rows


def _summary(done: dict[str, list[dict]]) -> dict:
    """The ratios the issue bounds, from the stages measured."""
    first = {stage: rows[0] for stage, rows in done.items()}
    summary = {}
    if "compile" in first and "plain" in first:
        summary["calibration / plain run"] = first["compile"]["calibration"] / first["plain"]["seconds"]
        if first["compile"].get("calibration_cpu") and first["plain"].get("cpu"):
            summary["calibration / plain run (CPU seconds)"] = (
                first["compile"]["calibration_cpu"] / first["plain"]["cpu"]
            )
    if "compile" in first and "export" in first:
        export = first["export"]["seconds"]
        summary["(export + compile) / export"] = (export + first["compile"]["seconds"]) / export
    peaks = [row["peak_rss"] or 0 for stage, row in first.items() if stage != "build"]
    if peaks:
        summary["largest peak RSS (GB)"] = max(peaks) / GB
    if "recompile" in first:
        summary["recompile ran a calibration"] = first["recompile"]["calibration_in_log"]
    if "compile" in first and "longest_silence" in first["compile"]:
        summary["longest silence in the compile's log (s)"] = first["compile"]["longest_silence"]
    return summary


def table(rows: list[dict]) -> str:
    """Markdown table of the stages, then the ratios the issue bounds."""
    lines = [
        "| stage | seconds | CPU seconds | host load | peak RSS (GB) | on disk (GB) "
        "| sliced calls / passes / sessions |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for entry in rows:
        if "summary" in entry:
            summary = entry["summary"]
            continue
        rss = f"{entry['peak_rss'] / GB:.2f}" if entry.get("peak_rss") else ""
        disk = f"{entry['disk'] / GB:.2f}" if entry.get("disk") is not None else ""
        work = f"{entry['calls']} / {entry['passes']} / {entry['sessions']}" if entry.get("calls") else ""
        cpu = f"{entry['cpu']:.0f}" if entry.get("cpu") else ""
        load = f"{entry['load']:.1f}" if entry.get("load") else ""
        lines.append(
            f"| {entry['stage']} | {entry['seconds']:.1f} | {cpu} | {load} | {rss} | {disk} | {work} |"
        )
    lines += ["", "| measure | value | target |", "|---|---:|---:|"]
    targets = {
        "calibration / plain run": "<= 1.5",
        "calibration / plain run (CPU seconds)": "<= 1.5",
        "(export + compile) / export": "<= 5",
        "largest peak RSS (GB)": "<= 6",
        "recompile ran a calibration": "False",
        "longest silence in the compile's log (s)": "<= 30",
    }
    for name, value in summary.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {shown} | {targets[name]} |")
    return "\n".join(lines)


def _resolutions(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (~25 GB at full depth)")
    parser.add_argument("--images", default="448x448,1080x1920", help="HxW[,HxW...]")
    parser.add_argument("--ctx-len", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint, small images")
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny checkpoint with the given shapes (call counts)"
    )
    parser.add_argument(
        "--text-layers", type=int, default=0, help="decoder layers (default: all 36; widths stay real)"
    )
    parser.add_argument(
        "--vision-layers", type=int, default=0, help="vision layers (default: all 32; widths stay real)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and artifacts")
    parser.add_argument(
        "--resume", type=Path, help="a work directory of an earlier --keep run: measure only what it lacks"
    )
    parser.add_argument("--stages", default=",".join(STAGES), help=f"which of {','.join(STAGES)} to run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--max-prompt-tokens",
        default="default",
        help="compile.calibration.max_prompt_tokens of the spec (N, or none: every prompt whole)",
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "full_depth", argv):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Measure the stages ``args`` asks for and print the table."""
    images = [(56, 84), (112, 112)] if args.smoke else _resolutions(args.images)
    ctx_len = 512 if args.smoke else args.ctx_len
    seq_len = 32 if args.smoke else args.seq_len
    # A smoke run is small: the temporary directory, not a --work meant for the full-depth run.
    scratch = None if args.smoke else args.work
    work = args.resume or Path(tempfile.mkdtemp(prefix="full-depth-", dir=scratch))
    stages = [stage for stage in args.stages.split(",") if stage]
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown:
        print(f"full_depth.py: unknown stage {unknown[0]!r} (one of {', '.join(STAGES)})", file=sys.stderr)
        return 2
    try:
        layers = (args.text_layers, args.vision_layers)
        budget = args.max_prompt_tokens
        budget = None if budget == "none" else (budget if budget == "default" else int(budget))
        rows = measure(work, images, ctx_len, seq_len, args.smoke or args.tiny, stages, layers, budget)
    finally:
        if not (args.keep or args.resume):
            shutil.rmtree(work, ignore_errors=True)
    label = "tiny qwen2_5_vl" if args.smoke or args.tiny else f"Qwen2.5-VL-3B full depth, {CONFIG.name}"
    if not (args.smoke or args.tiny) and (args.text_layers or args.vision_layers):
        label = (
            f"Qwen2.5-VL-3B at real widths, {args.text_layers or 'all'} text / "
            f"{args.vision_layers or 'all'} vision layers, {CONFIG.name}"
        )
    if args.max_prompt_tokens != "default":
        label += f", calibration max_prompt_tokens {args.max_prompt_tokens}"
    print(f"{label}: images {', '.join(f'{h}x{w}' for h, w in images)}, ctx_len {ctx_len}, prefill {seq_len}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"# {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(code)
