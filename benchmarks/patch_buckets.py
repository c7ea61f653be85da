"""Qwen2.5-VL vision program: resolution list (5 compiled resolutions) vs patch buckets (3).

    .venv/bin/python benchmarks/patch_buckets.py [--plot PNG] [--reps N]

Fifty common photo, screenshot and document sizes arrive as ten prompts of five images. A random
tower with the published block pattern (8 blocks, full attention at 3 and 7, 112-px windows) but
small widths is exported to ONNX in both forms and run with onnxruntime (one thread):

- ``resolutions``: five compiled resolutions (1:1, 4:3, 3:4, 16:9, 9:16); an image that is not
  one of them is resized to the one with the closest aspect ratio, then pixel count (what
  ``runtime/artifacts.py`` does), and each image is one call (batch-1 programs);
- ``buckets``: patch buckets of 1,024, 2,048 and 4,096 patches; each image at its own resolution,
  a prompt's images packed into as few calls as fit (``runtime/packing.py``).

The processor's pixel bound is 4,096 patches (1,024 merged tokens, the tiny checkpoint's) so the
two full-attention blocks stay in memory on a shared machine; the largest bucket holds it. Columns:
encoder calls, patches computed (padding included), padded-patch fraction, onnxruntime vision
time (best of ``--reps`` per call), images resized away from their own grid, and images whose
aspect ratio changed by more than 5% (distorted).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import plot_path, recording

# A sibling benchmark (the script's directory is on sys.path): the published block pattern.
from window_attention import VISION

# (width, height) as people quote them.
PHOTOS = [
    (4032, 3024), (3024, 4032), (4000, 3000), (6000, 4000), (4000, 6000), (3264, 2448), (2048, 1536),
    (1600, 1200), (1280, 960), (1024, 768), (800, 600), (640, 480), (1200, 1200), (1080, 1080),
    (1080, 1350), (1920, 1080), (1080, 1920), (2560, 1440), (720, 1280), (3000, 2000),
]  # fmt: skip
SCREENSHOTS = [
    (1920, 1080), (2560, 1600), (1366, 768), (1440, 900), (1536, 864), (2880, 1800), (1170, 2532),
    (1284, 2778), (750, 1334), (1080, 2400), (828, 1792), (3840, 2160), (1280, 800), (1600, 900),
    (390, 844),
]  # fmt: skip
DOCUMENTS = [
    (2550, 3300), (1275, 1650), (2480, 3508), (1240, 1754), (612, 792), (595, 842), (1700, 2200),
    (850, 1100), (3508, 2480), (600, 2000), (400, 1600), (1500, 500), (1200, 628), (2000, 600),
    (300, 1200),
]  # fmt: skip
SIZES = [(h, w) for w, h in PHOTOS + SCREENSHOTS + DOCUMENTS]
PER_PROMPT = 5
RESOLUTIONS = ((672, 672), (672, 896), (896, 672), (504, 896), (896, 504))  # (height, width)
BUCKETS = (1024, 2048, 4096)
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 1024 * 28 * 28
DISTORTION = math.log(1.05)


@dataclass
class ModeResult:
    """Totals of one mode over all prompts."""

    calls: int = 0
    computed: int = 0
    padded: int = 0
    seconds: float = 0.0
    resized: int = 0
    distorted: int = 0
    call_patches: list[int] = field(default_factory=list)


def _model():
    from qeff_vision.families.base import ModelDescription

    vision = {**VISION, "in_channels": 3}
    config = {"model_type": "qwen2_5_vl", "vision_config": vision}
    return ModelDescription(config, {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS})


def _export(work: Path):
    """Both vision graphs of one random tower: (resolution graph, bucket graph)."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from qeff_vision.exporter import load_adapter
    from qeff_vision.families import get_family
    from qeff_vision.families.qwen2_5_vl.export import PatchBucketEncoder, VisionEncoder

    torch.manual_seed(0)
    visual = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**VISION)).eval()
    family = get_family("qwen2_5_vl")
    adapter = load_adapter(family)
    model = type("Model", (), {})()
    model.config = type("Config", (), {"vision_config": visual.config})()
    paths = {}
    forms = (
        ("resolutions", VisionEncoder(visual), adapter.vision_example_inputs, family.vision_input_axes),
        (
            "buckets",
            PatchBucketEncoder(visual),
            adapter.patch_bucket_example_inputs,
            family.patch_buckets.input_axes,
        ),
    )
    for name, encoder, example_of, axes in forms:
        example = example_of(model)
        path = work / f"{name}.onnx"
        with torch.no_grad():
            torch.onnx.export(
                encoder.eval(),
                tuple(example.values()),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=list(example),
                output_names=["vision_embeds"],
                dynamic_axes={**{k: dict(v) for k, v in axes.items()}, "vision_embeds": {1: "vision_size"}},
            )
        paths[name] = path
    return paths


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _timed(session, feeds: dict, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return best


def _aspect_change(seen: tuple[int, int], image: tuple[int, int]) -> float:
    return abs(math.log((seen[0] / seen[1]) / (image[0] / image[1])))


def _closest(height: int, width: int, compiled) -> tuple[int, int]:
    """The compiled resolution an image is resized to (runtime/artifacts.py, compiled_size_for)."""

    def distance(size):
        aspect = abs(math.log((size[0] / size[1]) / (height / width)))
        return aspect, abs(math.log((size[0] * size[1]) / (height * width)))

    return min(compiled, key=distance)


def _pixels(patches: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((patches, 3 * 2 * 14 * 14)).astype(np.float32)


def run_resolutions(session, family, model, reps: int, sizes=SIZES) -> ModeResult:
    """One call per image at the compiled resolution closest to it."""
    from qeff_vision.families.base import ImageSize

    result = ModeResult()
    compiled = {family.resized(model, ImageSize(*size)) for size in RESOLUTIONS}
    for seed, (height, width) in enumerate(sizes):
        own = family.resized(model, ImageSize(height, width))
        # A grid the programs were compiled for runs as it is; any other is resized.
        seen = (
            own
            if own in compiled
            else family.resized(model, ImageSize(*_closest(height, width, RESOLUTIONS)))
        )
        grid_h, grid_w = seen[0] // 14, seen[1] // 14
        feeds = {
            "pixel_values": _pixels(grid_h * grid_w, seed),
            "image_grid_thw": np.zeros((1, 1, grid_h, grid_w), dtype=np.int64),
        }
        result.calls += 1
        result.computed += grid_h * grid_w
        result.call_patches.append(grid_h * grid_w)
        result.seconds += _timed(session, feeds, reps)
        result.resized += seen != own
        result.distorted += _aspect_change(seen, (height, width)) > DISTORTION
    return result


def run_buckets(session, family, model, reps: int, sizes=SIZES) -> ModeResult:
    """Each prompt's images at their own resolution, packed into patch-bucket calls."""
    from qeff_vision.families.base import ImageSize
    from qeff_vision.runtime.packing import plan_packed_calls

    host = family.host(model)
    buckets = [family.patch_buckets.bucket_symbols(model, patches) for patches in BUCKETS]
    result = ModeResult()
    for start in range(0, len(sizes), PER_PROMPT):
        items, patch_counts = [], []
        for seed, (height, width) in enumerate(sizes[start : start + PER_PROMPT], start=start):
            own = family.resized(model, ImageSize(height, width))
            grid_h, grid_w = own[0] // 14, own[1] // 14
            items.append(
                {
                    "pixel_values": _pixels(grid_h * grid_w, seed),
                    "image_grid_thw": np.zeros((1, 1, grid_h, grid_w), dtype=np.int64),
                }
            )
            patch_counts.append(grid_h * grid_w)
            result.distorted += _aspect_change(own, (height, width)) > DISTORTION

        for call in plan_packed_calls(
            items, patch_counts, buckets, host.patch_layout, host.pack_vision_inputs
        ):
            patches = call.bucket["grid_height"]
            result.calls += 1
            result.computed += patches
            result.call_patches.append(patches)
            result.padded += patches - sum(patch_counts[i] for i in call.images)
            result.seconds += _timed(session, call.feeds, reps)
    return result


def table(results: dict[str, ModeResult]) -> list[str]:
    """The comparison table."""
    header = (
        f"{'mode':<26} | {'calls':>5} | {'patches computed':>16} | {'padded':>6} | "
        f"{'ORT vision s':>12} | {'resized':>7} | {'distorted':>9}"
    )
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        padded = result.padded / result.computed if result.computed else 0.0
        lines.append(
            f"{name:<26} | {result.calls:>5} | {result.computed:>16,} | {padded:>6.1%} | "
            f"{result.seconds:>12.2f} | {result.resized:>7} | {result.distorted:>9}"
        )
    return lines


def plot(results: dict[str, ModeResult], path: Path, sizes=SIZES) -> None:
    """Four bars per mode: calls, padded fraction, vision time, distorted images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    metrics = (
        ("encoder calls", lambda r: r.calls),
        ("padded-patch fraction", lambda r: r.padded / r.computed),
        ("onnxruntime vision s", lambda r: r.seconds),
        ("distorted images (>5% aspect)", lambda r: r.distorted),
    )
    figure, axes = plt.subplots(1, len(metrics), figsize=(16, 4))
    for axis, (title, value) in zip(axes, metrics):
        axis.bar(names, [value(results[n]) for n in names], color=["tab:gray", "tab:blue"])
        axis.set_title(title)
        axis.tick_params(axis="x", labelsize=8)
    figure.suptitle(f"{len(sizes)} photo / screenshot / document sizes, {PER_PROMPT} images per prompt")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Print the table (and write the PNG)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default patch_buckets.png)")
    parser.add_argument("--reps", type=int, default=2, help="timed runs per call (best of)")
    parser.add_argument(
        "--smoke", action="store_true", help="Seven sizes (a full prompt and a partial one), one run each."
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "patch_buckets", argv):
        sizes = SIZES[: PER_PROMPT + 2] if args.smoke else SIZES
        if args.smoke:
            args.reps = 1
        if args.plot is None:  # a smoke run leaves nothing in the working directory
            args.plot = (
                Path(tempfile.mkdtemp(prefix="patch-buckets-")) / "patch_buckets.png"
                if args.smoke
                else Path("patch_buckets.png")
            )
        from qeff_vision.families import get_family

        family, model = get_family("qwen2_5_vl"), _model()
        with tempfile.TemporaryDirectory() as work:
            paths = _export(Path(work))
            results = {
                f"resolution list ({len(RESOLUTIONS)})": run_resolutions(
                    _session(paths["resolutions"]), family, model, args.reps, sizes
                ),
                f"patch buckets ({len(BUCKETS)})": run_buckets(
                    _session(paths["buckets"]), family, model, args.reps, sizes
                ),
            }
        print("\n".join(table(results)))
        args.plot = plot_path(args, "patch_buckets", args.plot)
        plot(results, args.plot, sizes)
        print(f"\nplot: {args.plot}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
