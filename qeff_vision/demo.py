"""``make demo``: tiny checkpoint -> export -> parity -> specialize -> compile -> chunk-aware run.

Compilation uses the onnxruntime backend (the SDK compiler is not needed): it proves every
specialization against the exported graphs, and ``run`` executes the result chunk by chunk with
the same shape checks a device applies, then compares the tokens with transformers generate.

Run as ``python -m qeff_vision.demo --out DIR``. Everything is built locally (no downloads).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from qeff_vision import api
from qeff_vision.errors import UserError
from qeff_vision.families import get_family

FAMILY = "qwen2_5_vl"
# The demo spec: two chunk buckets, two resolutions, vision_size per chunk.
SEQ_LENS = (32, 64)
DEMO_IMAGES = ((112, 112), (140, 196))
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
    if "vision_embeds" in lang_inputs:
        print(
            f"  vision_embeds input shape: {lang_inputs['vision_embeds']['shape']}  (vision_size is dynamic)"
        )
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
    ok = compile_and_run(out, checkpoint, result.out_dir, get_family(family)) and ok
    print("\nresult: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def compile_and_run(out: Path, checkpoint: Path, export_dir: Path, family) -> bool:
    """Specialize and compile a demo spec on the onnxruntime backend, then run it chunk-aware.

    True when the run's tokens equal transformers generate (the compile-and-run test harness
    calls this for every registered family).
    """
    import yaml

    from qeff_vision.verify import synthetic_image

    spec_path = out / "demo-spec.yaml"
    spec = {
        "name": "demo",
        # Spec paths resolve relative to the spec file, so name the checkpoint from there.
        "model": os.path.relpath(checkpoint, spec_path.parent),
        "ctx_len": 512,
        "prefill": {"seq_lens": list(SEQ_LENS)},
        "vision": {
            "images": [{"height": h, "width": w} for h, w in DEMO_IMAGES],
            "max_images": 2,
        },
    }
    if family.features.dynamic_vision_size.supported:  # a cross-attention family has none
        spec["vision"]["vision_size"] = "chunk"
    header = "# qeff-vision compile demo-spec.yaml -o compiled --backend onnxruntime\n"
    spec_path.write_text(header + yaml.safe_dump(spec, sort_keys=False))
    print(f"\nSpecializations of {spec_path.name}")
    specialized = api.specialize(spec_path, out / "specialized")
    for program in (specialized.vision, specialized.language):
        for entry in program.specializations:
            symbols = ", ".join(f"{k}={v}" for k, v in entry.symbols.items())
            print(f"  {program.program:<8} {entry.name:<12} {symbols}")

    print("\nCompile (backend onnxruntime: every specialization runs once on the exported graphs)")
    started = time.perf_counter()
    api.compile(
        spec_path,
        out / "compiled",
        backend="onnxruntime",
        export_dir=export_dir,
        force=True,
        progress=None,
        status_stream=None,
    )
    print(f"  {out / 'compiled'} in {time.perf_counter() - started:.1f} s")

    images = [synthetic_image(h, w, seed) for seed, (h, w) in enumerate(DEMO_IMAGES, start=7)]
    prompt = "Compare the two pictures in detail, please."
    turn = api.run(out / "compiled", images, [prompt], max_new_tokens=8, compare_hf=True)[0]
    result = turn.result
    print(f"\nChunk-aware run: prompt of {result.prompt_tokens} tokens, {len(result.chunks)} prefill chunks")
    print("  chunk  tokens/S   rows/V   vision_embeds bytes")
    for index, chunk in enumerate(result.chunks):
        print(
            f"  {index:>5}  {chunk.tokens:>3}/{chunk.seq_len:<4}  {chunk.rows:>3}/{chunk.vision_size:<4}"
            f"  {chunk.vision_bytes:>10,}"
        )
    print(f"  encoder calls: {result.encoder_calls}; {turn.comparison.describe()}")
    return turn.comparison.identical


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
