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

import numpy as np

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.hub import HubReference


def load_reference_model(model_dir: str | Path | HubReference):
    """The checkpoint as a transformers model: float32, eager attention, eval mode.

    A :class:`~qeff_vision.hub.HubReference` (the id and commit an export recorded) is resolved
    through the Hugging Face cache first, downloading the weights when they are not there.
    """
    if isinstance(model_dir, HubReference):
        model_dir = model_dir.directory()
    return Checkpoint.open(model_dir).reference_model()


def reference_generate(
    model, processed: Mapping[str, Any], max_new_tokens: int, eos_token_ids: Sequence[int] | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy generate of transformers on ``processed``: its new tokens and each step's logits row.

    The one greedy reference of the project (``run --compare-hf``, verification, tests).
    ``processed`` holds processor outputs (numpy arrays or tensors). The model's generation config
    is kept except what would make it other than pure argmax: sampling, beams and the repetition
    penalty are switched off. ``eos_token_ids`` replaces the config's end ids when given.
    """
    import torch

    inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
    return _greedy(model, inputs, max_new_tokens, eos_token_ids, inputs["input_ids"].shape[1])


def _greedy(model, inputs, max_new_tokens, eos_token_ids, prompt_len):
    """``model.generate`` as pure argmax; the tokens after ``prompt_len`` and each step's logits row."""
    import torch

    options: dict[str, Any] = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0}
    if eos_token_ids is not None:
        options["eos_token_id"] = list(eos_token_ids) or None
    options.update(max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(**inputs, **options)
    return out.sequences[0, prompt_len:].tolist(), [step[0].float().numpy() for step in out.logits]


def reference_generate_pruned(
    model,
    family,
    original: Mapping[str, Any],
    pruned: Mapping[str, Any],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] | None = None,
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy generate of transformers on a prompt whose clips were pruned (EVS).

    transformers does not prune, so it is given what our host computed: the pruned prompt's
    token embeddings (``inputs_embeds``), its recomputed positions (``position_ids``, the
    [4, 1, L] text + M-RoPE rows) and its own vision tower's features of ``original``'s pixels
    with each clip's rows cut by our retention masks (``mm_encoder_outputs``, from the family's
    adapter: ``hf_pruned_encoder_outputs``). A prompt with nothing pruned (``pruned`` is
    ``original``) is :func:`reference_generate`'s.

    Args:
        model: The transformers model (:func:`load_reference_model`).
        family: The checkpoint's family (its adapter knows the model's encoder outputs).
        original: The processor outputs before pruning (pixels and grids).
        pruned: :meth:`~qeff_vision.runtime.generator.Generator.prepare_prompt`'s result for them.
        max_new_tokens: Tokens to generate.
        eos_token_ids: Replaces the config's end ids when given.

    Returns:
        The new tokens and each step's logits row, as :func:`reference_generate`.
    """
    if pruned is original:
        return reference_generate(model, original, max_new_tokens, eos_token_ids)
    import torch

    from qeff_vision.contract.video_pruning import PRUNED_POSITIONS, RETENTION

    keep = np.asarray(pruned[RETENTION], dtype=bool)
    outputs = family.adapter().hf_pruned_encoder_outputs(model, original, keep)
    input_ids = torch.as_tensor(np.asarray(pruned["input_ids"], dtype=np.int64))
    with torch.no_grad():
        inputs = {
            "inputs_embeds": model.get_input_embeddings()(input_ids),
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.as_tensor(np.asarray(pruned[PRUNED_POSITIONS], dtype=np.int64)),
            "mm_encoder_outputs": outputs,
        }
    # With inputs_embeds only, the sequences hold just the new tokens.
    return _greedy(model, inputs, max_new_tokens, eos_token_ids, 0)


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


def model_in_dtype(model, dtype, copy: bool = True):
    """A copy of ``model`` in ``dtype`` as ``from_pretrained(dtype=...)`` loads it.

    ``model.to(torch.bfloat16)`` would round every float buffer, the rotary frequencies included
    (Qwen2.5-VL's 0.8058 becomes 0.8047: 0.55 rad off at position 500), and drop the imaginary
    part of complex ones (Llama 4's vision ``freqs_ci``). transformers' own bf16 loading computes
    those at init and keeps them fp32 / complex64: so does this copy (``*inv_freq`` and complex
    buffers keep their values).

    ``copy=False`` converts ``model`` itself instead (and returns it): no second model is held,
    only one tensor at a time in both dtypes (a real-width reference, issue 49: the copy held
    the fp32 model twice while it was made, and beside the bf16 one after).
    """
    import copy as copying

    kept = {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name.endswith("inv_freq") or buffer.is_complex()
    }
    converted = (copying.deepcopy(model) if copy else model).to(dtype)
    for name in [name for name, _ in converted.named_buffers()]:
        if name in kept:
            owner, _, attribute = name.rpartition(".")
            converted.get_submodule(owner)._buffers[attribute] = kept[name]
    return converted


def reference_teacher_forced(
    model, processed: Mapping[str, Any], tokens: Sequence[int], dtype: str | None = None
) -> list[np.ndarray]:
    """The logits rows of transformers at each step of ``tokens`` fed as its own choices (teacher forcing).

    ``generate`` runs with a logits processor that forces the next of ``tokens``; the logits it
    returns are the raw rows before that processor, so step ``i`` is the model's prediction after
    the prompt and ``tokens[:i]`` whatever it would have chosen. ``generate`` extends each family's
    extra inputs (masks, token types, cross-attention masks) as it does for its own tokens.

    Args:
        model: A transformers model (:func:`load_reference_model`).
        processed: Processor outputs for the prompt.
        tokens: The tokens to force (another run's generation).
        dtype: ``bfloat16`` runs the model and its float inputs in bf16 (a copy; ``model`` is
            unchanged), as a bf16 deployment computes; ``None`` keeps the model's dtype.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
    if dtype is not None:
        torch_dtype = getattr(torch, dtype)
        model = model_in_dtype(model, torch_dtype)
        inputs = {n: v.to(torch_dtype) if v.is_floating_point() else v for n, v in inputs.items()}

    class Forced(LogitsProcessor):
        def __init__(self):
            self.step = 0

        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, tokens[min(self.step, len(tokens) - 1)]] = 0.0
            self.step += 1
            return forced

    options = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "eos_token_id": None}
    options.update(max_new_tokens=len(tokens), min_new_tokens=len(tokens), output_logits=True)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            **options,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([Forced()]),
        )
    return [step[0].float().numpy() for step in out.logits]
