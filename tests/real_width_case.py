"""One family at real widths, end to end, in its own process: ``python -m tests.real_width_case FAMILY WORK``.

Builds the family's real-width checkpoint (:mod:`qeff_vision.real_width`), writes a spec for it,
compiles with ``--backend onnxruntime`` and the default precision plan (export, calibration, every
specialization verified), runs one image prompt on the artifacts at fp32 and at device precision,
and transformers' greedy ``generate`` on the same processed inputs. Prints one JSON object: the
tokens and logits deviations of both runs, each stage's seconds and the process's peak RSS.

The fp32 run decodes freely; the device-precision run is teacher-forced on transformers' tokens.
A process per family keeps one family's memory from the next and makes its peak RSS its own
(tests/test_real_width.py runs it; docs/guide/testing.md quotes its figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

# A 224 px photo-sized image: every processor resizes it to its own geometry (Gemma 3 896 px,
# LLaVA 336 px, one 560 px mllama tile, Qwen's minimum pixels), so the prompt stays short.
IMAGE_SIDE = 224
PROMPT = "Describe this image in detail."
CTX_LEN = 2048
# 128-token chunks split long prompts; the 512 bucket holds a whole image of the families whose
# image tokens attend both ways (Gemma 3: 256 tokens and markers).
SEQ_LENS = [128, 512]
# Cuts beyond the defaults: Kimi-K2.5 keeps one MoonViT layer (its decoder already cuts to one dense
# and one MoE layer of 10 experts: 1.1B parameters, 4.4 GB in fp32) and is drawn and saved in its
# published dtype, bfloat16 (2.2 GB), as the real checkpoint is; export and transformers read fp32.
CUTS = {"kimi_k25": {"vision_layers": 1, "dtype": "bfloat16"}}
# ``--stored``: the family drawn as its release stores it (tests/quantized_fixtures.py): Kimi-K2.5's
# published layout with int4 pack-quantized routed experts (compressed-tensors, group 32, bf16 rest);
# Qwen3-VL's FP8 releases (128 x 128 blocks). transformers runs the dequantized copy.
STORED = {"kimi_k25": ("ct-int4", r"\.experts\.\d+\."), "qwen3_vl": ("fp8-block", None)}


def write_spec(path: Path, checkpoint: Path, name: str, family: str, ai200: bool = False) -> Path:
    """A dual-program spec for ``checkpoint``: 128- and 512-token chunks, one image size, compile defaults.

    ``vision_size: chunk`` where the family has a dynamic vision size (the cross-attention kind
    has none: its images never take rows of the token sequence).
    """
    from qeff_vision.families import get_family

    vision = {"images": [{"height": IMAGE_SIDE, "width": IMAGE_SIDE}]}
    if get_family(family).features.dynamic_vision_size.supported:
        vision["vision_size"] = "chunk"
    spec = {
        "name": name,
        "model": str(checkpoint),
        "ctx_len": CTX_LEN,
        "prefill": {"seq_lens": SEQ_LENS},
        "vision": vision,
    }
    if ai200:  # issue 49: bfloat16 compute, bf16 weights and custom IO, no calibration
        spec["compile"] = {"aic_hw_version": "ai200"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def compare(ours, theirs) -> dict:
    """Tokens of both and, per step, the logits' max deviation relative to transformers' logit range."""
    relative = [
        float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(ours.logits, theirs[1], strict=False)
    ]
    margins = [float(np.diff(np.sort(b)[-2:])[0]) for b in theirs[1]]
    deviations = [float(np.abs(a - b).max()) for a, b in zip(ours.logits, theirs[1], strict=False)]
    return {
        "tokens": list(ours.tokens),
        "reference": list(theirs[0]),
        "relative_deviation": relative,
        "deviation": deviations,
        "margin": margins,
    }


_PEAK_SINCE_LAST_LINE = [0]


def _sample_rss() -> None:
    import psutil

    process = psutil.Process()
    while True:
        _PEAK_SINCE_LAST_LINE[0] = max(_PEAK_SINCE_LAST_LINE[0], process.memory_info().rss)
        time.sleep(0.2)


def _say(message: str) -> None:
    """A progress line on stderr: resident memory now and its peak since the previous line."""
    import psutil

    rss = psutil.Process().memory_info().rss
    peak = max(_PEAK_SINCE_LAST_LINE[0], rss)
    _PEAK_SINCE_LAST_LINE[0] = 0
    print(
        f"[{rss / 2**30:5.2f} GB, peak {peak / 2**30:5.2f} GB before] {message}", file=sys.stderr, flush=True
    )


def _timed(call):
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def _ask(out: Path, precision: str, new_tokens: int, forced=None):
    """One image prompt on the compiled artifacts, all ``new_tokens`` decoded (no end of sequence).

    ``forced`` (transformers' tokens) teacher-forces the decode: each step is fed transformers'
    token instead of our own, so every step's logits compare with transformers' at the same
    history, past a near-tie of random weights too. Returns the result and the processed inputs.
    """
    from qeff_vision import api
    from qeff_vision.fsutil import release_memory
    from tests import helpers

    chat = api.conversation(out, precision=precision, max_new_tokens=new_tokens)
    generator = chat.generator
    generator.eos_token_ids = set()
    if forced is not None:
        tokens = iter(forced)
        feed = generator.feed_token
        generator.feed_token = lambda token, *args, **kwargs: feed(next(tokens), *args, **kwargs)
    result = chat.ask([helpers.image(IMAGE_SIDE, IMAGE_SIDE)], PROMPT, keep_logits=True)
    processed = chat.last_inputs.processed
    del chat, generator
    # Our sessions are gone, but glibc keeps their freed pages unless they are handed back: after
    # Mistral 3's device-precision run 5.6 GB stayed resident (a session's folded fp16 weights).
    release_memory()
    return result, processed


def _stored_form(family: str, work: Path, stored: bool):
    """The ``stored`` argument of the real-width build (None: drawn as ``save_pretrained`` writes)."""
    if not stored:
        return None
    from tests.quantized_fixtures import real_width_form

    fmt, only = STORED[family]
    return real_width_form(fmt, work / "reference", only)


def run_case(family: str, work: Path, new_tokens: int, stored: bool = False) -> dict:
    """Build, compile, run and compare one family; each stage's seconds."""
    from qeff_vision import api
    from qeff_vision.fsutil import release_memory
    from qeff_vision.real_width import build_real_width_checkpoint, smallest_pinned_config
    from qeff_vision.reference import load_reference_model, reference_generate

    seconds = {}
    start = time.perf_counter()
    config = smallest_pinned_config(family)
    form = _stored_form(family, work, stored)
    checkpoint = build_real_width_checkpoint(
        family, work / "checkpoint", config=config, stored=form, **CUTS.get(family, {})
    )
    reference_dir = checkpoint if form is None else form.reference_dir
    seconds["build"] = time.perf_counter() - start
    spec = write_spec(work / "spec.yaml", checkpoint, f"{family}-real-width", family)
    start = time.perf_counter()
    _say(f"built {checkpoint} in {seconds['build']:.0f} s")
    outcome = api.compile(spec, work / "out", backend="onnxruntime", progress=_say, status_stream=None)
    seconds["compile"] = time.perf_counter() - start
    _say(f"compiled in {seconds['compile']:.0f} s")
    programs = outcome.manifest["programs"]
    plan = {name: (entry.get("node_precision") or {}).get("nodes") for name, entry in programs.items()}
    checked = {
        name: [
            {key: run[key] for key in ("index", "device_precision") if key in run}
            for run in (entry.get("verification") or {}).get("runs", [])
        ]
        for name, entry in programs.items()
    }
    seconds["run_fp32"], (fp32, processed) = _timed(lambda: _ask(work / "out", "fp32", new_tokens))
    _say(f"ran at fp32 in {seconds['run_fp32']:.0f} s")
    seconds["transformers"], reference = _timed(
        lambda: reference_generate(
            load_reference_model(reference_dir), processed, new_tokens, eos_token_ids=()
        )
    )
    _say(f"transformers generated in {seconds['transformers']:.0f} s")
    release_memory()
    seconds["run_device"], (device, _) = _timed(
        lambda: _ask(work / "out", "device", new_tokens, reference[0])
    )
    _say(f"ran at device precision (teacher-forced) in {seconds['run_device']:.0f} s")
    return {
        "family": family,
        "stored": STORED[family][0] if stored else None,
        "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")),
        "config": config.parent.name,
        "prompt_tokens": int(np.asarray(processed["input_ids"]).shape[-1]),
        "plan": plan,
        "verification": checked,
        "fp32": compare(fp32, reference),
        "device": compare(device, reference),
        "seconds": seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def run_ai200(family: str, work: Path, new_tokens: int, stored: bool = False) -> dict:
    """``--ai200``: the checkpoint drawn in bf16, compiled for ai200, against transformers in bf16.

    transformers runs the bf16 checkpoint with its float inputs in bf16 (greedy); our device
    precision (the bf16 emulation) is teacher-forced on its tokens, so each step compares.
    """
    import torch

    from qeff_vision import api
    from qeff_vision.fsutil import release_memory
    from qeff_vision.real_width import build_real_width_checkpoint, smallest_pinned_config
    from qeff_vision.reference import (
        load_reference_model,
        model_in_dtype,
        reference_generate,
        reference_teacher_forced,
    )

    seconds = {}
    start = time.perf_counter()
    config = smallest_pinned_config(family)
    cuts = {**CUTS.get(family, {}), "dtype": "bfloat16"}
    checkpoint = build_real_width_checkpoint(family, work / "checkpoint", config=config, **cuts)
    seconds["build"] = time.perf_counter() - start
    spec = write_spec(work / "spec.yaml", checkpoint, f"{family}-ai200", family, ai200=True)
    _say(f"built {checkpoint} in {seconds['build']:.0f} s")
    start = time.perf_counter()
    outcome = api.compile(spec, work / "out", backend="onnxruntime", progress=_say, status_stream=None)
    seconds["compile"] = time.perf_counter() - start
    _say(f"compiled in {seconds['compile']:.0f} s")
    programs = outcome.manifest["programs"]
    checked = {
        name: [
            {key: run[key] for key in ("index", "device_precision") if key in run}
            for run in (entry.get("verification") or {}).get("runs", [])
        ]
        for name, entry in programs.items()
    }
    plan = {name: (entry.get("node_precision") or {}).get("mode") for name, entry in programs.items()}
    weights = {
        name: entry["weights"]
        for name, entry in json.loads((work / "out" / "export" / "export.json").read_text())[
            "programs"
        ].items()
    }
    # The prompt as our runtime processes it (one fp32 run gives the processed inputs).
    _, processed = _ask(work / "out", "fp32", 1)
    # One reference model at a time: the bf16 one converted in place, freed before the fp32 one is
    # loaded again (mllama and Llama 4 passed 10 GB holding both).
    _say("loading transformers (bf16)")
    model = model_in_dtype(load_reference_model(checkpoint), torch.bfloat16, copy=False)
    inputs = {
        name: torch.as_tensor(value).to(torch.bfloat16)
        if torch.as_tensor(value).is_floating_point()
        else value
        for name, value in processed.items()
    }
    start = time.perf_counter()
    reference = reference_generate(model, inputs, new_tokens, eos_token_ids=())
    seconds["transformers"] = time.perf_counter() - start
    _say(f"transformers (bf16) generated in {seconds['transformers']:.0f} s")
    del model
    release_memory()
    # The yardstick: transformers fp32 forced to transformers bf16's tokens (same history).
    fp32_model = load_reference_model(checkpoint)
    start = time.perf_counter()
    fp32_forced = reference_teacher_forced(fp32_model, processed, reference[0])
    seconds["transformers_fp32"] = time.perf_counter() - start
    yardstick = [float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(reference[1], fp32_forced)]
    _say(f"transformers (fp32, teacher-forced) in {seconds['transformers_fp32']:.0f} s")
    del fp32_model
    release_memory()
    seconds["run_device"], (device, _) = _timed(
        lambda: _ask(work / "out", "device", new_tokens, reference[0])
    )
    _say(f"ran at device precision (bf16, teacher-forced) in {seconds['run_device']:.0f} s")
    return {
        "family": family,
        "config": config.parent.name,
        "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")),
        "weights": weights,
        "prompt_tokens": int(np.asarray(processed["input_ids"]).shape[-1]),
        "plan": plan,
        "verification": checked,
        "device": compare(device, reference),
        "yardstick": yardstick,
        "device_vs_fp32": [
            float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(device.logits, fp32_forced)
        ],
        "seconds": seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def run_export_only(family: str, work: Path, new_tokens: int, stored: bool = False) -> dict:
    """Diagnosis without compile: export, then the fp32 graphs against transformers (far less memory)."""
    from qeff_vision import api
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.real_width import build_real_width_checkpoint
    from qeff_vision.reference import load_reference_model, reference_generate
    from qeff_vision.runtime.conversation import Conversation
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from tests import helpers

    seconds = {}
    start = time.perf_counter()
    form = _stored_form(family, work, stored)
    checkpoint = build_real_width_checkpoint(family, work / "checkpoint", stored=form, **CUTS.get(family, {}))
    reference_dir = checkpoint if form is None else form.reference_dir
    seconds["build"] = time.perf_counter() - start
    start = time.perf_counter()
    api.export(checkpoint, work / "export", quiet=True)
    seconds["export"] = time.perf_counter() - start
    _say("exported")
    buckets = tuple(PrefillBucket(seq_len, seq_len) for seq_len in SEQ_LENS)
    generator = generator_for_export(
        work / "export", LanguageShape(buckets, buckets[-1].vision_size, CTX_LEN)
    )
    generator.eos_token_ids = set()
    chat = Conversation(generator, Checkpoint.open(checkpoint).processor, keep_prefix=False)
    start = time.perf_counter()
    ours = chat.ask(
        [helpers.image(IMAGE_SIDE, IMAGE_SIDE)], PROMPT, max_new_tokens=new_tokens, keep_logits=True
    )
    seconds["run_fp32"] = time.perf_counter() - start
    processed = chat.last_inputs.processed
    del chat, generator
    gc.collect()
    _say("ran at fp32")
    reference = reference_generate(
        load_reference_model(reference_dir), processed, new_tokens, eos_token_ids=()
    )
    return {
        "family": family,
        "prompt_tokens": int(np.asarray(processed["input_ids"]).shape[-1]),
        "fp32": compare(ours, reference),
        "seconds": seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(argv=None) -> int:
    """Run one family and print its JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family")
    parser.add_argument("work", type=Path)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--export-only", action="store_true", help="no compile: export and fp32 runs only")
    parser.add_argument("--stored", action="store_true", help="draw the checkpoint as its release stores it")
    parser.add_argument(
        "--ai200", action="store_true", help="bf16 checkpoint compiled for ai200, vs transformers bf16"
    )
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_sample_rss, daemon=True).start()
    case = run_ai200 if args.ai200 else run_export_only if args.export_only else run_case
    print(json.dumps(case(args.family, args.work, args.new_tokens, args.stored)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
