"""Parity of an export against transformers: vision features per resolution, then greedy generation.

Used by ``make demo`` and available to users' Python. The tests check the same properties per
family with tighter control (tests/test_family_parity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class ParityReport:
    """Max differences and tokens of an onnxruntime-vs-transformers comparison."""

    vision_max_diff: dict[str, float] = field(default_factory=dict)
    hf_tokens: list[int] = field(default_factory=list)
    onnx_tokens: list[int] = field(default_factory=list)
    max_logit_diff: float = 0.0
    chunks: int = 0
    text: str = ""

    @property
    def tokens_identical(self) -> bool:
        """Greedy tokens are the same."""
        return self.hf_tokens == self.onnx_tokens


def synthetic_image(height: int, width: int, seed: int = 0):
    """A deterministic random RGB image (the demo and benchmarks need no image files)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def check_parity(
    export_dir: str | Path,
    *,
    image_sizes: Sequence[tuple[int, int]],
    prompt: str = "Describe this image.",
    max_new_tokens: int = 8,
    chunk_size: int = 32,
) -> ParityReport:
    """Compare the exported graphs with transformers on the export's own checkpoint.

    Args:
        export_dir: An export directory (export.json names the checkpoint).
        image_sizes: Resolutions for the vision comparison; the first also drives generation.
        prompt: User text after the image.
        max_new_tokens: Greedy tokens to compare.
        chunk_size: Prefill bucket S (and V) for the chunked generation.
    """
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.export_record import read_export
    from qeff_vision.exporter import load_adapter
    from qeff_vision.inputs.prompt import as_arrays
    from qeff_vision.reference import reference_generate
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import OnnxProgram

    export_dir = Path(export_dir)
    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    family = checkpoint.family
    adapter = load_adapter(family)
    model, processor = checkpoint.reference_model(), checkpoint.processor
    vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
    report = ParityReport()
    for seed, (height, width) in enumerate(image_sizes):
        processed = processor.image_processor(
            images=[synthetic_image(height, width, seed)], return_tensors="pt"
        )
        features = adapter.hf_image_features(model, processed)
        numpy_inputs = {
            name: value for name, value in as_arrays(processed).items() if isinstance(value, np.ndarray)
        }
        inputs = checkpoint.host.vision_inputs(numpy_inputs)[0]
        outputs = vision.run(inputs)
        pairs = adapter.vision_parity_pairs(outputs, features, checkpoint.description)
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in pairs)
        report.vision_max_diff[f"{height}x{width}"] = worst

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = {
        name: value
        for name, value in as_arrays(
            processor(text=[text], images=[synthetic_image(*image_sizes[0])], return_tensors="pt")
        ).items()
        if isinstance(value, np.ndarray)
    }
    report.hf_tokens, hf_logits = reference_generate(model, inputs, max_new_tokens)
    bucket = PrefillBucket(chunk_size, chunk_size)
    length = inputs["input_ids"].shape[1]
    shape = LanguageShape((bucket,), chunk_size, length + max_new_tokens + chunk_size)
    generator = generator_for_export(export_dir, shape)
    result = generator.generate(
        inputs,
        max_new_tokens=max_new_tokens,
        keep_logits=True,
    )
    report.onnx_tokens = result.tokens
    report.chunks = len(result.chunks)
    report.max_logit_diff = float(
        max(np.abs(ours - ref).max() for ours, ref in zip(result.logits, hf_logits))
    )
    report.text = processor.tokenizer.decode(result.tokens)
    return report
