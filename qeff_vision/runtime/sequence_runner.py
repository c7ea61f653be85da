"""The protocol a decoder kind's runner offers the engine (declared, not reached into).

:class:`~qeff_vision.runtime.generator.Generator` (token-merge),
:class:`~qeff_vision.runtime.cross_attention.CrossAttentionGenerator` and their single-program
forms implement it; the engine (:mod:`qeff_vision.runtime.engine`) uses nothing else of a runner.
A new decoder kind's runner (registered in :data:`qeff_vision.runtime.generate.RUNNERS`)
implements the same members. Every per-request value lives in the
:class:`~qeff_vision.runtime.request_state.RequestState` passed in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.families.host import Host
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.planner import Chunk, ChunkPlan

if TYPE_CHECKING:
    from qeff_vision.runtime.deployment import Deployment
    from qeff_vision.runtime.device_sampler import ProgramSampler, RequestDraws
    from qeff_vision.runtime.request_state import ChunkCall, RequestState
    from qeff_vision.runtime.results import GenerationResult
    from qeff_vision.runtime.retained_prefix import Resume


class SequenceRunner(Protocol):
    """What the engine asks of one decoder kind's runner.

    Attributes:
        host: The family's host protocol for the checkpoint.
        vision: The vision program (a session with ``calls``).
        language: The language program (a session with ``input_dims`` and ``run``).
        deployment: The deployment mode (the engine's slots, the decoding program).
        io: The language program's IO table.
        cache: The per-image embedding cache.
        eos_token_ids: Token ids that end a sequence.
        vision_input: What a result's vision bytes count (``vision_embeds``, cross-attention K/V).
        device_sampler: The on-device sampler of its language program (None: it returns logits).
        logits_name: The logits output (None: the program returns ``next_tokens``).
    """

    host: Host
    vision: Any
    language: Any
    deployment: Deployment
    io: LanguageIO
    cache: EmbeddingCache
    eos_token_ids: set[int]
    vision_input: str
    device_sampler: ProgramSampler | None
    logits_name: str | None

    def prepare_prompt(
        self, processed: Mapping[str, Any], request: RequestState | None = None
    ) -> Mapping[str, Any]:
        """The prompt as the runner runs it (clips pruned at a video pruning rate)."""

    def begin(self, request: RequestState) -> Resume:
        """Where the request's prefill starts (a prefix the program holds), before any call."""

    def check_fits(self, length: int, max_new_tokens: int, used: int = 0) -> None:
        """Raise a user error unless the prompt and the new tokens fit the compiled context."""

    def plan(
        self,
        input_ids: np.ndarray,
        processed: Mapping[str, Any],
        protocol: str,
        start: int = 0,
        positions: np.ndarray | None = None,
    ) -> ChunkPlan:
        """The chunk plan of a processed prompt's tokens from ``start`` on (``positions``: as fed)."""

    def initial_cache(self, request: RequestState) -> dict[str, np.ndarray]:
        """The batch-1 cache a lone request starts from."""

    def request_chunks(self, request: RequestState) -> Iterator[ChunkCall]:
        """The calls of each prefill chunk of one request."""

    def request_images(self, request: RequestState) -> tuple[int, int]:
        """(images and videos, their embedding rows) of a request, as its report counts them."""

    def decode_extra(self, processed: Mapping[str, Any]) -> dict[Role, np.ndarray]:
        """Inputs by role every decode step of this request adds, one row."""

    def call_ccl(self, feeds: Mapping[str, np.ndarray]) -> int | None:
        """The compute-context length of the call with ``feeds`` (None without CCLs)."""

    def ccl_at(self, decode: bool, positions: Sequence[np.ndarray]) -> int | None:
        """The compute-context length of a call whose rows have ``positions``."""

    def check_chunk_outputs(self, chunk: Chunk, outputs: Mapping[str, np.ndarray]) -> None:
        """Raise when a prefill chunk's outputs contradict the plan."""

    def with_sampler_inputs(
        self, feeds: dict[str, np.ndarray], rows: Sequence[RequestDraws | None]
    ) -> dict[str, np.ndarray]:
        """A call's feeds plus the on-device sampler's inputs of its rows' requests (if compiled in)."""

    def prefill_done(self, request: RequestState, cache: Mapping[str, np.ndarray] | None) -> None:
        """The request's last prefill chunk ran (``cache``: its slot's cache, if its own)."""

    def finish(self, request: RequestState, result: GenerationResult) -> GenerationResult:
        """The request's result as reported (notes, serving notes); what the program now holds."""
