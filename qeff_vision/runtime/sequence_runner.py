"""The protocol a decoder kind's runner offers the batched engine (declared, not reached into).

:class:`~qeff_vision.runtime.generator.Generator` (token-merge) and
:class:`~qeff_vision.runtime.cross_attention.CrossAttentionGenerator` implement it; the engine
(:mod:`qeff_vision.runtime.engine`) uses nothing else of a runner. A new decoder kind's runner
(registered in :data:`qeff_vision.runtime.generate.RUNNERS`) implements the same members.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.families.host import Host
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.planner import Chunk, ChunkPlan


class SequenceRunner(Protocol):
    """What the batched engine asks of one decoder kind's runner.

    Attributes:
        host: The family's host protocol for the checkpoint.
        vision: The vision program (a session with ``calls``).
        language: The language program (a session with ``input_dims`` and ``run``).
        io: The language program's IO table.
        cache: The per-image embedding cache.
        eos_token_ids: Token ids that end a sequence.
        vision_input: What a result's vision bytes count (``vision_embeds``, cross-attention K/V).
    """

    host: Host
    vision: Any
    language: Any
    io: LanguageIO
    cache: EmbeddingCache
    eos_token_ids: set[int]
    vision_input: str

    def prepare_prompt(self, processed: Mapping[str, Any]) -> Mapping[str, Any]:
        """The prompt as the runner runs it (clips pruned at a video pruning rate)."""

    def check_fits(self, length: int, max_new_tokens: int, used: int = 0) -> None:
        """Raise a user error unless the prompt and the new tokens fit the compiled context."""

    def plan(
        self,
        input_ids: np.ndarray,
        processed: Mapping[str, Any],
        protocol: str,
        positions: np.ndarray | None = None,
    ) -> ChunkPlan:
        """The chunk plan of a processed prompt."""

    def request_chunks(
        self,
        plan: ChunkPlan,
        processed: Mapping[str, Any],
        input_ids: np.ndarray,
        positions: np.ndarray,
        encode_timer: list[float],
    ) -> Iterator[tuple[Chunk, dict[str, np.ndarray], int]]:
        """(chunk, its language inputs, vision bytes they carry) per prefill chunk of one request."""

    def request_images(self, plan: ChunkPlan, processed: Mapping[str, Any]) -> int:
        """Images (and videos) of a request, as its report counts them."""

    def decode_extra(self, processed: Mapping[str, Any]) -> dict[Role, np.ndarray]:
        """Inputs by role every decode step of this request adds, one row."""

    def check_chunk_outputs(self, chunk: Chunk, outputs: Mapping[str, np.ndarray]) -> None:
        """Raise when a prefill chunk's outputs contradict the plan."""
