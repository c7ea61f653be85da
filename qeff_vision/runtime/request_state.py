"""Per-request state of the engine loop: everything one request's run needs, and nothing kept after it.

vLLM keeps a request's progress in a request object (ref: vllm ``v1/request.py``), not on the
model runner; so does this runtime. A :class:`RequestState` is made when the engine takes a
request and dropped when its result is out: its prompt as it runs (clips pruned), where a kept
prefix lets its prefill start, its chunk plan and positions, the calls its decoder kind yields
(:class:`ChunkCall`), how the vision program served its images, its sampler and its tokens. The
runners (decoder kinds) read and fill it; they keep no per-call field of their own, so one runner
serves any number of requests, one after another or side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision.contract.language_io import Role
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.continuation import Continuation, continued_positions
from qeff_vision.runtime.device_sampler import RequestDraws, pick
from qeff_vision.runtime.planner import Chunk, ChunkPlan
from qeff_vision.runtime.results import ChunkRecord
from qeff_vision.runtime.retained_prefix import Resume
from qeff_vision.runtime.sampling import TokenSampler

if TYPE_CHECKING:
    from collections.abc import Callable

    from qeff_vision.runtime.embedding_cache import PreparedImage
    from qeff_vision.runtime.sequence_runner import SequenceRunner


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine.

    Attributes:
        processed: Processor outputs as numpy arrays (what :meth:`Generator.generate` takes).
        max_new_tokens: Upper bound of generated tokens.
        arrival_step: The engine step at which the request arrives.
        on_token: Called with each token id as soon as it is known (streaming).
        protocol: Its vision protocol (``chunk`` or ``full``); the engine's when None.
        sampling: How its tokens are chosen (greedy when None); its own random generator, so its
            tokens do not depend on the requests it shares steps with.
        history: A previous lone request's ``continuation``: the prompt runs after that history's
            cache (:mod:`~qeff_vision.runtime.continuation`), which it consumes.
        keep_prefix: The prompt is a whole conversation: prefill only what follows the prefix the
            program holds (:mod:`~qeff_vision.runtime.kept_prefix`; a lone request on a program
            with a cache per sequence).
    """

    processed: Mapping[str, Any]
    max_new_tokens: int = 32
    arrival_step: int = 0
    on_token: Callable[[int], None] | None = None
    protocol: str | None = None
    sampling: SamplingParams | None = None
    history: Continuation | None = None
    keep_prefix: bool = False


@dataclass
class ChunkCall:
    """One prefill call a decoder kind asks the engine for (its request's slot is the engine's).

    Attributes:
        chunk: The planned chunk.
        feeds: The call's inputs without the cache.
        vision_bytes: Bytes of vision input the call carries.
        before: Calls to run first, in order, into the same slot (a single program's encode
            calls writing a prompt's later image groups).
        images_encoded: Images this call encodes, when the decoder kind counts them itself (an
            encoder inside the program); None: the embedding cache's count.
    """

    chunk: Chunk
    feeds: dict[str, np.ndarray]
    vision_bytes: int
    before: list[dict[str, np.ndarray]] = field(default_factory=list)
    images_encoded: int | None = None


class RequestState:
    """A request's state while it runs (see the module docstring).

    Made by the engine for each request; the runner's :meth:`begin` decides where its prefill
    starts (a kept prefix) before the fit check and the plan.

    Args:
        number: The request's index in the engine's list.
        request: The request.
        runner: The decoder kind's runner.
        protocol: The vision protocol when the request names none.

    Raises:
        UserError: The prompt does not fit the compiled shapes (checked before any call).
    """

    def __init__(self, number: int, request: EngineRequest, runner: SequenceRunner, protocol: str):
        self.number = number
        self.request = request
        self.history = request.history
        #: How the vision program served each image of this prompt, by content key.
        self.served: dict[str, str] = {}
        #: The pruned prompt's prepared images and inputs, so preparing it again hashes nothing.
        self.prepared: tuple | None = None
        #: The prompt's images the prefill sends (after a kept prefix's), once its chunks start.
        self.images: list[PreparedImage] = []
        #: Content keys and spans of the prompt's images (for the prefix the program keeps).
        self.keys: list[str] = []
        stats, calls = runner.cache.stats, runner.vision.calls
        self.processed = runner.prepare_prompt(request.processed, self)
        # A pruning rate encodes the prompt's clips now (their kept rows shape the prompt): the
        # request's own encoding, counted with its chunks'.
        after = runner.cache.stats
        self.encoder_calls = runner.vision.calls - calls
        self.cache_hits = after.hits - stats.hits
        self.images_encoded = after.images_encoded - stats.images_encoded
        self.input_ids = np.asarray(self.processed["input_ids"], dtype=np.int64).reshape(-1)
        self.resume: Resume = runner.begin(self)
        self.start = self.resume.start
        positions = runner.host.prompt_positions(self.processed)
        used = 0
        if self.history is not None:
            history = self.history
            first = runner.host.decode_positions(history.positions, history.fed_steps + len(history.unfed))
            positions = continued_positions(positions, first)
            used = int(np.asarray(first).reshape(-1)[0])  # KV slots the history fills
        self.positions = positions
        runner.check_fits(len(self.input_ids), request.max_new_tokens, used)
        self.plan: ChunkPlan = runner.plan(
            self.input_ids,
            self.processed,
            request.protocol or protocol,
            start=self.start,
            positions=positions,
        )
        self.decode_extra: Mapping[Role, np.ndarray] = (
            self.history.decode_feeds if self.history is not None else runner.decode_extra(self.processed)
        )
        # A runner may choose tokens its own way (calibration feeds a fixed continuation).
        self.sampler = getattr(runner, "token_sampler", TokenSampler)(request.sampling, self.input_ids)
        #: Its parameters and seeded generator as the on-device sampler's inputs (None without one).
        sampler = runner.device_sampler
        self.draws: RequestDraws | None = sampler.draws(request.sampling) if sampler is not None else None
        #: The cache the request starts from (a lone request's: fresh, kept prefix or history);
        #: None: whatever its slot holds.
        self.initial: dict[str, np.ndarray] | None = None
        #: Caches not indexed by position as the prefill left them (a kept prefix restores them).
        self.at_prompt_end: dict[str, np.ndarray] | None = None
        self.chunks: Iterator[ChunkCall] | None = None
        self.encode_timer = [0.0]
        self.slot = -1
        self.admitted_step = self.first_token_step = -1
        self.arrived_at = self.first_token_at = self.last_token_at = 0.0
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []
        self.records: list[ChunkRecord] = []
        self.decode_batches: list[int] = []
        #: The compute-context length of every language call that served this request, in order
        #: (empty without CCL specializations): the request's, never the runner's.
        self.ccl_history: list[int] = []
        self._decode_base: np.ndarray | None = None
        self._affine = False

    def next_positions(self, host) -> np.ndarray:
        """Position ids of the token fed next (the last one generated)."""
        step = len(self.tokens) - 1
        if self._decode_base is None:
            self._decode_base = host.decode_positions(self.positions, 0)
            # Hosts advance every position row by one per generated token; checked once, so a host
            # that does not is asked every step.
            self._affine = np.array_equal(host.decode_positions(self.positions, 1), self._decode_base + 1)
        return self._decode_base + step if self._affine else host.decode_positions(self.positions, step)

    def called(self, ccl: int | None) -> None:
        """A language call served this request at compute-context length ``ccl`` (None: no CCLs)."""
        if ccl is not None:
            self.ccl_history.append(ccl)

    def emit(self, logits: np.ndarray, keep_logits: bool, eos: set[int]) -> bool:
        """Choose and record the next token from its logits row; True when the request is complete.

        A 0-d row is the token the on-device sampler chose (no logits to keep).
        """
        token = pick(self.sampler, logits)
        now = time.perf_counter()
        if not self.tokens:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens.append(token)
        if keep_logits and np.ndim(logits):
            self.logits.append(logits.copy())
        if self.request.on_token is not None:
            self.request.on_token(token)
        return token in eos or len(self.tokens) >= self.request.max_new_tokens
