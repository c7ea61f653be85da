"""bf16 (Cloud AI 200) beside fp16 (AI 100) per family: teacher-forced logit deviation, first divergence.

Usage: python benchmarks/ai200_numerics.py [--families gemma3 llava ...] [--tokens 9]
                                           [--real-width qwen2_5_vl ...] [--out DIR]

Each checkpoint is drawn in bfloat16 (a tiny one per family, or with ``--real-width`` the family's
smallest pinned config at its real widths, depth and vocabulary cut as the real-width tests cut
them). transformers runs it in fp32; that is the yardstick every row is compared with. Rows:

* fp16 (AI 100): the fp32-weight export at device precision with its automatic plan (calibration
  on the prompt, as ``compile`` does), as ``aic_hw_version: ai100`` computes.
* bf16 (AI 200): the bf16-weight export (rotary cos/sin read from bf16 position tables) at device
  precision, every float value rounded to bf16, as ``aic_hw_version: ai200`` computes.
* transformers bf16: transformers with the checkpoint loaded in bf16 (rotary frequencies fp32, as
  ``from_pretrained(dtype=torch.bfloat16)`` keeps them) and its float inputs in bf16.

Columns: each row's worst teacher-forced step (transformers fp32 forced to the row's own greedy
tokens) as max |logit difference| over transformers' logit range, and the first step whose greedy
token differs from transformers fp32's own greedy run ("-": none in ``--tokens``). Then the bf16
emulation against transformers bf16 (teacher-forced on the emulation's tokens), and that over
transformers bf16's own deviation from fp32: the ratio tests/test_ai200_parity.py bounds.
Random tiny weights are far from a trained model's: read the figures as the size of the rounding,
not as a model's accuracy.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from pathlib import Path

import numpy as np
from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording
from device_numerics import auto_plans

from qeff_vision.families import all_families

HEADER = (
    "checkpoint",
    "prompt",
    "fp16 (AI 100)",
    "fp16 diverges",
    "bf16 (AI 200)",
    "bf16 diverges",
    "transformers bf16",
    "tf bf16 diverges",
    "bf16 vs tf bf16",
    "ratio",
)


def bf16_copy(source: Path, target: Path) -> Path:
    """A copy of checkpoint ``source`` with every float tensor stored in bfloat16."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, dirs_exist_ok=True)
    for path in target.glob("*.safetensors"):
        tensors = {
            key: value.to(torch.bfloat16) if value.is_floating_point() else value
            for key, value in load_file(path).items()
        }
        save_file(tensors, path, metadata={"format": "pt"})
    return target


def checkpoint_for(name: str, real_width: bool, root: Path) -> Path:
    """The bf16 checkpoint of a row: tiny, or real-width (smallest pinned config, cut)."""
    if real_width:
        from qeff_vision.real_width import build_real_width_checkpoint, smallest_pinned_config

        config = smallest_pinned_config(name)
        return build_real_width_checkpoint(name, root / "checkpoint", config=config, dtype="bfloat16")
    from qeff_vision import api

    return bf16_copy(api.tiny(name, root / "tiny", force=True), root / "checkpoint")


def _relative(logits, references) -> float:
    return max(float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(logits, references))


def _diverges(tokens, reference_tokens) -> str:
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), None)
    return "-" if step is None else str(step)


def measure(name: str, real_width: bool, root: Path, tokens: int) -> tuple[str, ...]:
    """One table row."""
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.exporter import export_model
    from qeff_vision.inputs.prompt import process_turn
    from qeff_vision.numerics.device import Bf16Values
    from qeff_vision.reference import reference_generate, reference_teacher_forced
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.verify import synthetic_image

    checkpoint = checkpoint_for(name, real_width, root)
    opened = Checkpoint.open(checkpoint)
    inputs = process_turn(opened.processor, [synthetic_image(100, 150)], "Describe this image.")
    reference = opened.reference_model()  # fp32
    hf_tokens, _ = reference_generate(reference, inputs, max_new_tokens=tokens)
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)

    def emulated(export: Path, plans):
        generator = generator_for_export(export, shape, fp32_values=plans)
        result = generator.generate(inputs, max_new_tokens=tokens, keep_logits=True)
        del generator
        gc.collect()
        return result

    fp16_export = export_model(checkpoint, root / "export-fp16", progress=None, force=True).out_dir
    plans, _ = auto_plans(fp16_export, length + 3)
    fp16 = emulated(fp16_export, plans)
    shutil.rmtree(fp16_export)
    bf16_export = export_model(
        checkpoint, root / "export-bf16", progress=None, force=True, weight_dtype="bfloat16"
    ).out_dir
    bf16 = emulated(bf16_export, {"vision": Bf16Values(), "lang": Bf16Values()})
    shutil.rmtree(bf16_export)
    forced = {
        "fp16": reference_teacher_forced(reference, inputs, fp16.tokens),
        "bf16": reference_teacher_forced(reference, inputs, bf16.tokens),
    }
    tf_bf16_tokens, tf_bf16_logits = _transformers_bf16(reference, inputs, tokens)
    tf_forced = reference_teacher_forced(reference, inputs, tf_bf16_tokens)
    bf16_vs_tf = reference_teacher_forced(reference, inputs, bf16.tokens, "bfloat16")
    yardstick = _relative(tf_bf16_logits, tf_forced)
    against = _relative(bf16.logits, bf16_vs_tf)
    label = f"{name} (real width)" if real_width else name
    return (
        label,
        str(length),
        f"{_relative(fp16.logits, forced['fp16']):.1e}",
        _diverges(fp16.tokens, hf_tokens),
        f"{_relative(bf16.logits, forced['bf16']):.1e}",
        _diverges(bf16.tokens, hf_tokens),
        f"{yardstick:.1e}",
        _diverges(tf_bf16_tokens, hf_tokens),
        f"{against:.1e}",
        f"{against / yardstick:.2f}",
    )


def _transformers_bf16(model, inputs, tokens: int):
    """transformers' greedy generate in bf16 (as ``from_pretrained(dtype=bfloat16)`` computes)."""
    import torch

    from qeff_vision.reference import model_in_dtype, reference_generate

    half = model_in_dtype(model, torch.bfloat16)
    cast = {
        n: torch.as_tensor(v).to(torch.bfloat16) if torch.as_tensor(v).is_floating_point() else v
        for n, v in inputs.items()
    }
    return reference_generate(half, cast, max_new_tokens=tokens)


SMOKE_HELP = "Smallest run that still takes every code path (a quick check; figures not meaningful)."


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [family.name for family in all_families()]
    parser.add_argument("--families", nargs="*", default=names, choices=names)
    parser.add_argument("--real-width", nargs="*", default=[], choices=names, help="Real-width rows.")
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="Keep checkpoints here.")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "ai200_numerics", None):
        if args.smoke:
            args.families, args.real_width, args.tokens = ["qwen2_5_vl"], [], 2
        root = args.out or Path(tempfile.mkdtemp(prefix="ai200-numerics-"))
        rows = [measure(name, False, root / name, args.tokens) for name in args.families]
        rows += [measure(name, True, root / f"{name}-real", args.tokens) for name in args.real_width]
        widths = [max(len(r[i]) for r in (HEADER, *rows)) for i in range(len(HEADER))]
        for row in (HEADER, *rows):
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
