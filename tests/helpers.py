"""Test helpers: tiny checkpoints, synthetic images, transformers reference generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny(family: str, out_dir: Path) -> Path:
    """Write ``family``'s tiny checkpoint with the CLI's code path."""
    from qeff_vision import api

    return api.tiny(family, out_dir)


def load_hf(model_dir: Path):
    """transformers' model (eager, fp32) and processor, loaded from the directory offline."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoProcessor.from_pretrained(str(model_dir))


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
    return processor(text=[text], images=images or None, return_tensors="pt")


def hf_generate(model, inputs, max_new_tokens: int):
    """transformers greedy generate: (new tokens, per-step logits rows as numpy)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    length = inputs["input_ids"].shape[1]
    return out.sequences[0, length:].tolist(), [step[0].float().numpy() for step in out.logits]


def as_numpy(inputs) -> dict:
    """Processor outputs as numpy arrays."""
    return {name: value.numpy() for name, value in inputs.items()}
