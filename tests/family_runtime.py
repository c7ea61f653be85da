"""Shared harness for the chunked-generation parity tests of one family on its tiny checkpoint.

Loads the export's two onnxruntime sessions once, builds generators for any bucket set, and checks
a result against transformers' own greedy ``generate`` on the same processor outputs: tokens
identical and every step's logits within tolerance (logits catch a wrong image row that greedy
tokens of a random tiny model can survive).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.export_record import read_export
from qeff_vision.families.base import CROSS_ATTENTION
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generate import Generator, make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-3
CTX_LEN = 512
FULL_V = 320


class FamilyRuntime:
    """One family's exported programs, transformers model and processor, with memoized references."""

    def __init__(self, family: str, export_dir, model, processor):
        manifest = read_export(export_dir)
        self.checkpoint = Checkpoint.open(manifest["model"], family)
        self.family, self.config = self.checkpoint.family, self.checkpoint.config
        self.vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
        self.language = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"])
        self.model, self.processor = model, processor
        self._references: dict[bytes, tuple[list[int], list[np.ndarray]]] = {}

    def generator(self, seq_lens: Sequence[int], protocol: str = "chunk", cache=None) -> Generator:
        """V = S under ``chunk`` (the chunk policy), V = FULL_V under ``full``; the family's host kind.

        A cross-attention program has no image rows per chunk: V is 1 (one zero row).
        """
        if self.family.decoder_kind == CROSS_ATTENTION:
            buckets = tuple(PrefillBucket(s, 1) for s in seq_lens)
        else:
            buckets = tuple(PrefillBucket(s, s if protocol == "chunk" else FULL_V) for s in seq_lens)
        shape = LanguageShape(buckets, max(b.vision_size for b in buckets), CTX_LEN)
        return make_generator(self.checkpoint, self.vision, self.language, shape, cache)

    def inputs(self, parts, images) -> dict:
        """Numpy processor outputs of one user turn (``"<image>"`` parts are images)."""
        return helpers.as_numpy(helpers.process(self.processor, helpers.user_turn(*parts), images))

    def reference(self, processed) -> tuple[list[int], list[np.ndarray]]:
        """transformers greedy tokens and per-step logits (memoized on the inputs' bytes)."""
        key = b"".join(np.ascontiguousarray(value).tobytes() for value in processed.values())
        if key not in self._references:
            inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
            self._references[key] = helpers.hf_generate(self.model, inputs, NEW_TOKENS)
        return self._references[key]

    def check(self, result, processed, label: str) -> None:
        """Tokens identical to transformers generate; every step's logits within tolerance."""
        tokens, logits = self.reference(processed)
        assert result.tokens == tokens, f"{label}: tokens differ from transformers"
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(result.logits, logits))
        assert worst <= LOGIT_TOLERANCE, f"{label}: logits differ by {worst}"

    def three_turns(self, chat, first, second, label: str) -> list:
        """Image, text-only follow-up, new image through ``chat``: each turn checked, the results."""
        turns = [
            ([first], "Describe this picture."),
            ([], "What colour dominates?"),
            ([second], "Compare them."),
        ]
        results = []
        self.turn_inputs = []  # each turn's processor outputs (the whole history, as rendered)
        for images, text in turns:
            result = chat.ask(images, text, keep_logits=True)
            self.check(result, chat.last_inputs.processed, f"{label} turn {len(results) + 1}")
            self.turn_inputs.append(chat.last_inputs.processed)
            results.append(result)
        return results

    def run(
        self, processed, seq_lens: Sequence[int], protocol: str = "chunk", cache: EmbeddingCache | None = None
    ):
        """Generate chunk by chunk, compare with transformers, return (plan, result)."""
        generator = self.generator(seq_lens, protocol, cache)
        plan = generator.plan(processed["input_ids"].reshape(-1), processed, protocol)
        result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol=protocol, keep_logits=True)
        assert len(result.chunks) == len(plan.chunks)
        self.check(result, processed, f"{self.family.name} {protocol} S={list(seq_lens)}")
        return plan, result


def chunks_of_image(plan, image: int) -> list[int]:
    """Indices of the chunks that carry rows of ``image``."""
    return [chunk.index for chunk in plan.chunks if image in chunk.images]
