"""transformers as the reference: greedy generate on the same processed inputs, and a token comparison.

Used by ``qeff-vision run --compare-hf``. The model is loaded as the exporter loads it (float32,
eager attention). Generation is pure greedy argmax, as in our runtime: the checkpoint's sampling
settings (temperature, top-k/p, repetition penalty) are replaced, not inherited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def load_reference_model(model_dir: str | Path):
    """The checkpoint as a transformers model: float32, eager attention, eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText

    from qeff_vision.export.adapter import quiet_transformers

    quiet_transformers()
    return AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_generate(
    model, processed: Mapping[str, Any], max_new_tokens: int, eos_token_ids: Sequence[int]
) -> list[int]:
    """New tokens of transformers' greedy generate on ``processed`` (numpy processor outputs)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos_token_ids) or None,
        pad_token_id=model.generation_config.pad_token_id,
    )
    inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
    with torch.no_grad():
        sequences = model.generate(**inputs, generation_config=config)
    return sequences[0, inputs["input_ids"].shape[1] :].tolist()


@dataclass(frozen=True)
class TokenComparison:
    """Our tokens against the reference's.

    Attributes:
        ours: Tokens our runtime generated.
        reference: Tokens transformers generated.
    """

    ours: tuple[int, ...]
    reference: tuple[int, ...]

    @property
    def identical(self) -> bool:
        """Same tokens, same length."""
        return self.ours == self.reference

    @property
    def first_difference(self) -> int | None:
        """Index of the first differing token (or of the shorter end), None when identical."""
        if self.identical:
            return None
        for index, (a, b) in enumerate(zip(self.ours, self.reference)):
            if a != b:
                return index
        return min(len(self.ours), len(self.reference))

    def describe(self) -> str:
        """One line: identical, or where and how the sequences part."""
        if self.identical:
            return f"tokens identical to transformers generate ({len(self.ours)} tokens)"
        index = self.first_difference
        ours = self.ours[index] if index < len(self.ours) else "end"
        theirs = self.reference[index] if index < len(self.reference) else "end"
        return (
            f"tokens DIFFER from transformers generate at step {index}: ours {ours}, transformers {theirs} "
            f"({len(self.ours)} vs {len(self.reference)} tokens)"
        )
