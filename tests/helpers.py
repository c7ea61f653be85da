"""Test helpers: tiny checkpoints, synthetic images, transformers reference generation."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.reference import reference_generate as hf_generate  # noqa: F401 (tests' name)


def write_tiny(family: str, out_dir: Path) -> Path:
    """Write ``family``'s tiny checkpoint with the CLI's code path."""
    from qeff_vision import api

    return api.tiny(family, out_dir)


def load_hf(model_dir: Path):
    """transformers' model (eager, fp32) and processor, loaded from the directory offline."""
    checkpoint = Checkpoint.open(model_dir)
    return checkpoint.reference_model(), checkpoint.processor


def image(height: int, width: int, seed: int = 0):
    """A deterministic random RGB PIL image."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def user_turn(*parts) -> list[dict]:
    """Chat messages of one user turn; ``"<image>"`` stands for an image, any other string is text."""
    content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def process(processor, messages, images):
    """Processor outputs (torch tensors) for chat ``messages`` and their ``images``."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return float32_pixels(processor(text=[text], images=images or None, return_tensors="pt"))


def float32_pixels(outputs):
    """Processor outputs with bfloat16 tensors widened to float32 (exact; Llama 4's image processor
    computes in bfloat16, and the reference model runs in float32)."""
    import torch

    for name, value in outputs.items():
        if torch.is_tensor(value) and value.dtype == torch.bfloat16:
            outputs[name] = value.float()
    return outputs


def host(model, family: str):
    """The torch-free host protocol of ``family`` for a transformers model's config."""
    from qeff_vision.families import get_family
    from qeff_vision.families.base import ModelDescription

    return get_family(family).host(ModelDescription(model.config.to_dict()))


def as_numpy(inputs) -> dict:
    """Processor outputs as numpy arrays."""
    return {name: value.numpy() for name, value in float32_pixels(dict(inputs)).items()}


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package).

    Its directory joins ``sys.path`` as when the script runs, so a benchmark importing a sibling
    (``from window_attention import VISION``) loads here too.
    """
    directory = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(directory) not in sys.path:
        sys.path.append(str(directory))
    path = directory / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_vision_manifest(out_dir: Path, family: str, symbols: dict[str, str]) -> Path:
    """A compiled OUT holding only a manifest: one vision specialization of ``symbols``, no language one.

    Enough for ``run`` to read what the artifact was compiled with (stale-symbol checks) before any
    program is opened.
    """
    from qeff_vision.compile_record import MANIFEST_FILE, MANIFEST_FORMAT

    out_dir.mkdir()
    manifest = {
        "format": MANIFEST_FORMAT,
        "backend": "onnxruntime",
        "family": family,
        "programs": {
            "vision": {"specializations": [{"name": "v", "symbols": symbols}]},
            "lang": {"specializations": []},
        },
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out_dir


# The families the default tier runs a costly every-family suite on: one per decoder kind and state
# kind (qwen2_5_vl: windowed and full vision attention, M-RoPE; gemma4: sliding ring and shared KV;
# qwen3_5: recurrent; kimi_k25: latent (MLA) and routed experts; mllama: cross-attention). The slow
# tier (`make test-all`) runs the same suites over every registered family.
DEFAULT_TIER_FAMILIES = ("qwen2_5_vl", "gemma4", "qwen3_5", "kimi_k25", "mllama")


def tiered(values, keep=DEFAULT_TIER_FAMILIES, key=lambda value: value):
    """``values`` as pytest params, those whose ``key`` is not in ``keep`` marked ``slow``."""
    import pytest

    def slow(value):  # a tuple is one case of several arguments
        return pytest.param(*value if isinstance(value, tuple) else (value,), marks=pytest.mark.slow)

    return [value if key(value) in keep else slow(value) for value in values]


def with_score_tokens(source: Path, out: Path) -> Path:
    """A copy of ``source`` (a Qwen3-VL checkpoint) with ``yes`` / ``no`` tokens and random output rows."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    shutil.copytree(source, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(["yes", "no"])
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(source), dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        head = model.lm_head.weight
        head[-2:] = torch.randn(2, head.shape[1], generator=generator) * head.std()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
