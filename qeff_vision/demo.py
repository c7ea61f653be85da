"""``make demo``: tiny checkpoint -> export -> parity check against transformers, with a short report.

Run as ``python -m qeff_vision.demo --out DIR``. Everything is built locally (no downloads).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from qeff_vision import api
from qeff_vision.errors import UserError

FAMILY = "qwen2_5_vl"
# Three aspect ratios through ONE vision graph (tiny checkpoint: max 1024*28^2 pixels).
IMAGE_SIZES = ((100, 150), (224, 224), (300, 120))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(out: Path, family: str) -> int:
    """Build, export and check; print the report. Returns the process exit code."""
    from qeff_vision.verify import check_parity

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    checkpoint = api.tiny(family, out / "tiny", force=True)
    tiny_seconds = time.perf_counter() - started

    started = time.perf_counter()
    result = api.export(checkpoint, out / "export", force=True)
    export_seconds = time.perf_counter() - started

    started = time.perf_counter()
    report = check_parity(result.out_dir, image_sizes=IMAGE_SIZES, max_new_tokens=8, chunk_size=32)
    parity_seconds = time.perf_counter() - started

    print(f"\nqeff-vision demo: {family} (tiny random weights) in {out}")
    print("\nGraphs")
    for program in ("vision", "lang"):
        info = result.manifest["programs"][program]
        symbolic = sorted({axis for io in info["inputs"].values() for axis in io["axes"].values()})
        print(f"  {program:<6} {result.program_path(program)}")
        counts = f"{len(info['inputs'])} inputs, {len(info['outputs'])} outputs"
        print(f"         {counts}; symbolic: {', '.join(symbolic)}")
    lang_inputs = result.manifest["programs"]["lang"]["inputs"]
    print(f"  vision_embeds input shape: {lang_inputs['vision_embeds']['shape']}  (vision_size is dynamic)")
    print("\nTiming")
    print(f"  tiny checkpoint {tiny_seconds:6.1f} s")
    print(
        f"  export          {export_seconds:6.1f} s   "
        + ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    )
    print(f"  parity check    {parity_seconds:6.1f} s")
    print(f"  peak RSS        {_peak_rss_mb():6.0f} MB")
    print("\nParity (onnxruntime vs transformers, fp32)")
    for size, diff in report.vision_max_diff.items():
        print(f"  vision {size:>9}: max abs diff {diff:.2e}")
    print(
        f"  generation: {report.chunks} prefill chunks of 32 + {len(report.onnx_tokens) - 1} decode steps, "
        f"max logit diff {report.max_logit_diff:.2e}"
    )
    print(f"  transformers tokens: {report.hf_tokens}")
    print(f"  qeff-vision tokens:  {report.onnx_tokens}")
    print(f"  identical: {'yes' if report.tokens_identical else 'NO'}  (text: {report.text!r})")
    ok = (
        report.tokens_identical
        and max(report.vision_max_diff.values()) <= 1e-4
        and report.max_logit_diff <= 1e-3
    )
    print("\nresult: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the demo."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--family", default=FAMILY)
    args = parser.parse_args(argv)
    try:
        return run(args.out, args.family)
    except UserError as exc:
        print(f"qeff-vision demo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
