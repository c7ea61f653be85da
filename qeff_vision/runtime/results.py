"""What a generation reports: its tokens and what each prefill call carried and cost.

Filled by :meth:`~qeff_vision.runtime.generator.Generator.generate`, by the cross-attention host
and, per request, by the batched engine (:mod:`qeff_vision.runtime.engine`); read by ``qeff-vision
run``, conversations and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qeff_vision.runtime.continuation import Continuation
from qeff_vision.runtime.planner import VisionProtocol


@dataclass
class ChunkRecord:
    """What one prefill call carried and cost.

    Attributes:
        tokens: Real prompt tokens in the chunk.
        seq_len: The bucket's S (tokens sent, padding included).
        vision_size: The bucket's V (``vision_embeds`` rows sent, zero padding included).
        rows: Rows of the image embeddings the chunk actually uses.
        vision_bytes: Bytes of the vision input sent with the call (what it is:
            :attr:`GenerationResult.vision_input`).
        seconds: Wall time of the language-program call.
        encode_seconds: Vision-program time spent just before the call (images first used here).
        images_encoded: Images the vision program encoded for this chunk (cache misses).
        start: First prompt token of the chunk.
    """

    tokens: int
    seq_len: int
    vision_size: int
    rows: int
    vision_bytes: int
    seconds: float
    encode_seconds: float = 0.0
    images_encoded: int = 0
    start: int = 0


@dataclass
class GenerationResult:
    """Tokens and the measurements ``qeff-vision run`` reports.

    Attributes:
        prompt_tokens: L, tokens in the prompt.
        tokens: Generated token ids (the end-of-sequence token included when it was emitted).
        chunks: One record per prefill call, in order.
        ttft: Seconds from the start of :meth:`Generator.generate` to the first token: image
            preparation, vision encoding of cache misses and every prefill chunk.
        decode_seconds: Seconds spent in decode steps (tokens after the first).
        encoder_calls: Vision-program calls made for this prompt.
        cache_hits: Images found in the embedding cache instead of encoded.
        text: The decoded reply (filled by callers that own a tokenizer, e.g. a conversation).
        logits: Each step's last-position logits (with ``keep_logits``).
        protocol: The vision protocol used (``chunk`` or ``full``).
        images: Images in the prompt.
        image_rows: Embedding rows of all images (placeholder tokens in the prompt).
        images_encoded: Images the vision program encoded for this prompt.
        notes: Things worth telling the user (e.g. an image resized to a compiled resolution).
        continuation: Where the language program stopped; pass it as ``history=`` to continue.
        served: Per image, which vision program served it (resolution list or patch bucket, packed
            with how many others) or that the embedding cache did.
        vision_input: What the chunks' ``vision_bytes`` count: ``vision_embeds`` rows (dual), the
            cross-attention K/V (the cross-attention kind) or the pixel inputs (single program).
        ccl_history: The compute-context length of each language call that served the request,
            in order (prefill chunks, then decode steps; empty without CCL specializations).
    """

    prompt_tokens: int
    tokens: list[int]
    chunks: list[ChunkRecord]
    ttft: float
    decode_seconds: float
    encoder_calls: int
    cache_hits: int
    text: str = ""
    logits: list[np.ndarray] = field(default_factory=list)
    protocol: str = VisionProtocol.CHUNK.value
    images: int = 0
    image_rows: int = 0
    images_encoded: int = 0
    notes: list[str] = field(default_factory=list)
    continuation: Continuation | None = None
    served: list[str] = field(default_factory=list)
    vision_input: str = "vision_embeds"
    ccl_history: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decode."""
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens prefilled (fewer than :attr:`prompt_tokens` after a kept prefix)."""
        return sum(chunk.tokens for chunk in self.chunks)

    @property
    def vision_bytes(self) -> int:
        """Bytes of the vision input (:attr:`vision_input`) sent over all prefill chunks."""
        return sum(chunk.vision_bytes for chunk in self.chunks)

    @property
    def prefill_seconds(self) -> float:
        """Language-program time over all prefill chunks."""
        return sum(chunk.seconds for chunk in self.chunks)
