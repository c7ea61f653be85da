"""Device numerics per family: how far fp16, MXFP6 weights and an MXINT8 KV cache move the logits.

Usage: python benchmarks/device_numerics.py [--families gemma3 llava ...] [--tokens 9]
                                            [--out /tmp/device-numerics]

For each family's tiny checkpoint (plus "gemma3-scaled", the tiny Gemma 3 whose layer-0
post-feedforward norm weight is 50,000 so its residual stream leaves fp16's range), the parity
prompt (one image, "Describe this image.") runs through the chunk-aware runtime on onnxruntime in
each emulation and is compared with transformers' fp32 generate:

* fp32: the exported graphs as they are.
* fp16 (none): device precision without a precision plan.
* fp16 (auto): device precision with the automatic plan (calibration prompts, as ``compile``).
* + mxfp6 E2M3 / E3M2: matmul weights as OCP MXFP6 (the element the compiler uses is not public).
* + mxint8 KV: the KV cache stored as OCP MXINT8.

Columns: plan size (of every non-matmul output), the worst step's max |logit difference| divided
by transformers' logit range, and greedy tokens identical to transformers out of those generated
("inf/NaN" when the emulation overflowed). Random tiny weights are far from a trained model's
distribution: read the MX rows as the size of the effect, not as a model's accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from qeff_vision import symbols
from qeff_vision.families import all_families

SCALED = "gemma3-scaled"
SCALE = 5e4


def _checkpoint(name: str, root: Path) -> Path:
    from qeff_vision import api

    family = "gemma3" if name == SCALED else name
    directory = api.tiny(family, root / name / "checkpoint")
    if name == SCALED:
        import torch
        from safetensors.torch import load_file, save_file

        weights = next(directory.glob("*.safetensors"))
        tensors = load_file(str(weights))
        for key in [k for k in tensors if k.endswith("layers.0.post_feedforward_layernorm.weight")]:
            tensors[key] = torch.full_like(tensors[key], SCALE)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return directory


def _plans(export: Path, length: int) -> tuple[dict[str, list[str]], int]:
    import onnx

    from qeff_vision.compile.calibration import prompt_ranges
    from qeff_vision.numerics.plan import auto_plan, non_matmul_outputs

    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: length,
        symbols.VISION_SIZE: length,
        symbols.CTX_LEN: 512,
    }
    ranges = prompt_ranges(export, None, [bucket, {**bucket, symbols.SEQ_LEN: 1}], [(100, 150)])
    plans, candidates = {}, 0
    for program in ("vision", "lang"):
        model = onnx.load(str(export / program / "model.onnx"), load_external_data=False)
        plans[program] = auto_plan(model, ranges[program])
        candidates += non_matmul_outputs(model)
    return plans, candidates


def measure(name: str, root: Path, tokens: int) -> list[tuple[str, ...]]:
    """Table rows of one checkpoint."""
    from qeff_vision.exporter import export_model
    from qeff_vision.numerics.device import MxEmulation
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import DeviceOverflow
    from tests import helpers

    checkpoint = _checkpoint(name, root)
    export = root / name / "export"
    export_model(checkpoint, export, progress=None)
    model, processor = helpers.load_hf(checkpoint)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=tokens)
    length = inputs["input_ids"].shape[1]
    plans, candidates = _plans(export, length + 3)
    kept = sum(len(v) for v in plans.values())
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)
    emulations = [
        ("fp32", None, None, "-"),
        ("fp16 (none)", {}, None, "0"),
        ("fp16 (auto)", plans, None, f"{kept}/{candidates}"),
        ("+ mxfp6 E2M3", plans, MxEmulation("fp6_e2m3"), f"{kept}/{candidates}"),
        ("+ mxfp6 E3M2", plans, MxEmulation("fp6_e3m2"), f"{kept}/{candidates}"),
        ("+ mxint8 KV", plans, MxEmulation(None, kv_mxint8=True), f"{kept}/{candidates}"),
    ]
    rows = []
    for label, plan, mx, plan_cell in emulations:
        generator = generator_for_export(export, shape, fp32_values=plan, mx=mx)
        try:
            result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=tokens, keep_logits=True)
        except DeviceOverflow:
            rows.append((name, label, plan_cell, "inf/NaN", "-"))
            continue
        worst = max(
            float(np.abs(ours - ref).max() / (ref.max() - ref.min()))
            for ours, ref in zip(result.logits, hf_logits)
        )
        same = sum(1 for a, b in zip(result.tokens, hf_tokens) if a == b)
        rows.append((name, label, plan_cell, f"{worst:.2e}", f"{same}/{len(hf_tokens)}"))
    return rows


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [family.name for family in all_families()] + [SCALED]
    parser.add_argument("--families", nargs="+", default=names, choices=names)
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="Keep checkpoints and exports here.")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="device-numerics-"))
    header = ("checkpoint", "emulation", "fp32 nodes", "max |dlogit| / range", "tokens = HF")
    rows = [row for name in args.families for row in measure(name, root, args.tokens)]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
