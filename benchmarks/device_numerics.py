"""Device numerics per family: how far fp16, MXFP6 weights and an MXINT8 KV cache move the logits.

Usage: python benchmarks/device_numerics.py [--families gemma3 llava ...] [--tokens 9]
                                            [--out /tmp/device-numerics]

For each family's tiny checkpoint (plus "gemma3-scaled", the tiny Gemma 3 whose layer-0
post-feedforward norm weight is 50,000 so its residual stream leaves fp16's range, and
"gemma4-scaled", the tiny Gemma 4 whose residual leaves it the same way and whose vision tower's
last post-feedforward norm weight is 20,000, so the pooler's sqrt(hidden) scaling takes the soft
tokens past 65,504 while the tower's own output stays inside), the parity
prompt (one image, "Describe this image.") runs through the chunk-aware runtime on onnxruntime in
each emulation and is compared with transformers' fp32 generate:

* fp32: the exported graphs as they are.
* fp16 (none): device precision without a precision plan.
* fp16 (auto): device precision with the automatic plan (calibration prompts, as ``compile``).
* + mxfp6 E2M3 / E3M2: matmul weights as OCP MXFP6 (the element the compiler uses is not public).
* + mxint8 KV: the KV cache stored as OCP MXINT8.
* bf16 (ai200): device precision as an ``aic_hw_version: ai200`` program computes, every float value
  (weights included) rounded to bf16, nearest even, no node kept fp32, on the bf16-weight export
  (rotary cos/sin from bf16 position tables; issue 49).
* transformers bf16: transformers itself with the checkpoint and inputs cast to bf16 (what a bf16
  GPU deployment computes), for scale.

Columns: plan size (of every non-matmul output), QEfficient's rule for Gemma 4 on the same graphs
(ref: QEfficient transformers/models/gemma4/modeling_gemma4.py, ``generate_npi_file`` and
``generate_vision_npi_file``: every language node output except data movement, shapes, constants
and CustomRMSNorm; every vision Add and CustomRMSNorm output), the worst step's max |logit difference| divided
by transformers' logit range, and greedy tokens identical to transformers out of those generated
("inf/NaN" when the emulation overflowed); then the same deviation teacher-forced (transformers fp32
forced to the emulation's own tokens, so every step compares one history) and the first step
where the emulation's greedy token differs from transformers' fp32 one ("-": none). Random tiny
weights are far from a trained model's distribution: read the MX and bf16 rows as the size of the
effect, not as a model's accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

from qeff_vision import symbols
from qeff_vision.families import all_families

# Scaled variant -> (family, {weight-name suffix: value}).
SCALED = {
    "gemma3-scaled": ("gemma3", {"layers.0.post_feedforward_layernorm.weight": 5e4}),
    "gemma4-scaled": (
        "gemma4",
        {
            "language_model.layers.0.post_feedforward_layernorm.weight": 5e4,
            "vision_tower.encoder.layers.1.post_feedforward_layernorm.weight": 2e4,
        },
    ),
}
# QEfficient's Gemma 4 node-precision rule (generate_npi_file / generate_vision_npi_file).
QEFF_GEMMA4_EXCLUDED = {
    "Constant", "ConstantOfShape", "Concat", "CustomRMSNorm", "Equal", "Gather", "MatMul", "Range",
    "Reshape", "Shape", "Slice", "Transpose", "Unsqueeze",
}  # fmt: skip
QEFF_GEMMA4_VISION = {"Add", "CustomRMSNorm"}


def write_checkpoint(name: str, directory: Path) -> Path:
    """A family's tiny checkpoint, or a scaled variant of one (weights overwritten in place)."""
    from qeff_vision import api

    family, scales = SCALED.get(name, (name, {}))
    directory = api.tiny(family, directory)
    if scales:
        import torch
        from safetensors.torch import load_file, save_file

        weights = next(directory.glob("*.safetensors"))
        tensors = load_file(str(weights))
        for suffix, value in scales.items():
            keys = [k for k in tensors if k.endswith(suffix)]
            assert keys, suffix
            for key in keys:
                tensors[key] = torch.full_like(tensors[key], value)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return directory


def _checkpoint(name: str, root: Path) -> Path:
    return write_checkpoint(name, root / name / "checkpoint")


def qefficient_gemma4_rule(export: Path) -> int:
    """Outputs QEfficient's Gemma 4 rule keeps in fp32 on our two graphs (vision + language)."""
    import onnx

    kept = 0
    for program in ("vision", "lang"):
        graph = onnx.load(str(export / program / "model.onnx"), load_external_data=False).graph
        for node in graph.node:
            if program == "vision" and node.op_type not in QEFF_GEMMA4_VISION:
                continue
            if program == "lang" and node.op_type in QEFF_GEMMA4_EXCLUDED:
                continue
            kept += sum(
                1 for o in node.output if o and not o.endswith(symbols.RETAINED_SUFFIX) and "MatMul" not in o
            )
    return kept


def auto_plans(export: Path, length: int) -> tuple[dict[str, list[str]], int]:
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
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.exporter import export_model
    from qeff_vision.inputs.prompt import process_turn
    from qeff_vision.numerics.device import Bf16Values, MxEmulation
    from qeff_vision.reference import reference_generate, reference_teacher_forced
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import DeviceOverflow
    from qeff_vision.verify import synthetic_image

    checkpoint = _checkpoint(name, root)
    export = root / name / "export"
    export_model(checkpoint, export, progress=None)
    opened = Checkpoint.open(checkpoint)
    inputs = process_turn(opened.processor, [synthetic_image(100, 150)], "Describe this image.")
    reference = opened.reference_model()
    hf_tokens, hf_logits = reference_generate(reference, inputs, max_new_tokens=tokens)
    length = inputs["input_ids"].shape[1]
    plans, candidates = auto_plans(export, length + 3)
    kept = sum(len(v) for v in plans.values())
    family = SCALED.get(name, (name, {}))[0]
    rule = str(qefficient_gemma4_rule(export)) if family == "gemma4" else "-"
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)
    emulations = [
        ("fp32", None, None, "-"),
        ("fp16 (none)", {}, None, "0"),
        ("fp16 (auto)", plans, None, f"{kept}/{candidates}"),
        ("+ mxfp6 E2M3", plans, MxEmulation("fp6_e2m3"), f"{kept}/{candidates}"),
        ("+ mxfp6 E3M2", plans, MxEmulation("fp6_e3m2"), f"{kept}/{candidates}"),
        ("+ mxint8 KV", plans, MxEmulation(None, kv_mxint8=True), f"{kept}/{candidates}"),
        ("bf16 (ai200)", {"vision": Bf16Values(), "lang": Bf16Values()}, None, "0"),
    ]

    def _compared(own_tokens, own_logits) -> tuple[str, ...]:
        """Free-running deviation, tokens = HF, teacher-forced deviation, first divergence."""
        same = sum(1 for a, b in zip(own_tokens, hf_tokens) if a == b)
        forced = reference_teacher_forced(reference, inputs, own_tokens)
        differ = next((step for step, (a, b) in enumerate(zip(own_tokens, hf_tokens)) if a != b), None)
        return (
            f"{_deviation(own_logits, hf_logits):.2e}",
            f"{same}/{len(hf_tokens)}",
            f"{_deviation(own_logits, forced):.2e}",
            "-" if differ is None else str(differ),
        )

    # An ai200 program is exported with bf16 weights, its rotary cos/sin read from bf16 tables.
    bf16_export = root / name / "export-bf16"
    export_model(checkpoint, bf16_export, progress=None, force=True, weight_dtype="bfloat16")
    rows = []
    for label, plan, mx, plan_cell in emulations:
        source = bf16_export if label == "bf16 (ai200)" else export
        generator = generator_for_export(source, shape, fp32_values=plan, mx=mx)
        try:
            result = generator.generate(inputs, max_new_tokens=tokens, keep_logits=True)
        except DeviceOverflow:
            rows.append((name, label, plan_cell, rule, "inf/NaN", "-", "-", "-"))
            continue
        rows.append((name, label, plan_cell, rule, *_compared(result.tokens, result.logits)))
    bf16_tokens, bf16_logits = _bf16_generate(reference, inputs, tokens)
    rows.append((name, "transformers bf16", "-", rule, *_compared(bf16_tokens, bf16_logits)))
    return rows


def _bf16_generate(model, inputs, tokens: int):
    """transformers' greedy generate in bf16 (rotary frequencies fp32, as from_pretrained keeps them)."""
    import torch

    from qeff_vision.reference import model_in_dtype, reference_generate

    half = model_in_dtype(model, torch.bfloat16)
    cast = {
        n: torch.as_tensor(v).to(torch.bfloat16) if torch.as_tensor(v).is_floating_point() else v
        for n, v in inputs.items()
    }
    return reference_generate(half, cast, max_new_tokens=tokens)


def _deviation(logits, references) -> float:
    return max(
        float(np.abs(ours - ref).max() / (ref.max() - ref.min())) for ours, ref in zip(logits, references)
    )


SMOKE_HELP = "Smallest run that still takes every code path (a quick check; figures not meaningful)."


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [family.name for family in all_families()] + list(SCALED)
    parser.add_argument("--families", nargs="+", default=names, choices=names)
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="Keep checkpoints and exports here.")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "device_numerics", None):
        if args.smoke:  # one plain and one scaled checkpoint (the QEfficient Gemma 4 rule column too)
            args.families, args.tokens = ["llava", "gemma4-scaled"], 2
        root = args.out or Path(tempfile.mkdtemp(prefix="device-numerics-"))
        header = (
            "checkpoint",
            "emulation",
            "fp32 nodes",
            "QEff Gemma 4 rule",
            "max |dlogit| / range",
            "tokens = HF",
            "teacher-forced |dlogit| / range",
            "first divergence",
        )
        rows = [row for name in args.families for row in measure(name, root, args.tokens)]
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
