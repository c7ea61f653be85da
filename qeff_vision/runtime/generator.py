"""The token-merge decoder kind over two programs: plan, encode on first use, feed each chunk its rows.

The host side of the protocol in docs/design.md: positions (M-RoPE included) are computed once
for the whole prompt and sliced per chunk; each chunk receives only its rows of the per-image
embeddings (``chunk`` protocol) or the whole embedding (``full``, kept for comparison); images are
encoded when a chunk first needs them, through a per-conversation :class:`EmbeddingCache`. A
conversation's turn prefills only what follows the prefix the language program already holds
(:mod:`qeff_vision.runtime.kept_prefix`). The loop itself is the engine's
(:mod:`qeff_vision.runtime.engine`): a lone prompt is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.contract.full_kv import keeps_full_kv
from qeff_vision.contract.language_io import SLOT_ROLES, Role
from qeff_vision.contract.slot_names import kv_prefix_of, with_kv_prefix
from qeff_vision.errors import UserError
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.backends import backend_of
from qeff_vision.runtime.continuation import Continuation
from qeff_vision.runtime.deployment import DEPLOYMENTS, Deployment
from qeff_vision.runtime.device_sampler import RequestDraws, program_sampler
from qeff_vision.runtime.embedding_cache import EmbeddingCache, feed_chunks
from qeff_vision.runtime.engine import BatchedEngine, compiled_slots
from qeff_vision.runtime.image_encoding import ImageEncoding
from qeff_vision.runtime.kept_prefix import PrefixKeeping
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import Chunk, ChunkPlan, VisionProtocol, plan_chunks
from qeff_vision.runtime.request_state import ChunkCall, RequestState
from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import segments_after, unpositioned_caches
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec.deployment import DUAL

DEFAULT_CACHE_BYTES = 256 * 2**20


class Generator(ImageEncoding, PrefixKeeping):
    """Runs prompts through a vision program and a language program with the chunk protocol.

    Its vision half is :class:`~qeff_vision.runtime.image_encoding.ImageEncoding`, the prefix a
    conversation keeps between turns :class:`~qeff_vision.runtime.kept_prefix.PrefixKeeping`. After
    the prompt, each decode call feeds one token at its position and takes no image row (a
    seq_len-1 call merges none), so a placeholder id the model generates keeps its token
    embedding, as in transformers; the engine makes the calls, one row per slot.

    Args:
        checkpoint: The checkpoint the programs were exported from (config, family, end ids).
        vision: The vision program.
        language: The language program.
        shape: Compiled language shapes.
        cache: Per-image embedding cache (share one across a conversation's turns).
        patch_buckets: The vision specializations of a patch-bucket program (images are packed
            into them); ``None``: a vision program specialized per resolution.
        eos_token_ids: Generation stops after emitting one of these (default: the checkpoint's).
        deployment: The deployment mode the programs belong to (:mod:`~qeff_vision.runtime.deployment`);
            dual by default (:func:`~qeff_vision.runtime.generate.make_generator` names it).
    """

    #: What a result's ``vision_bytes`` count (:attr:`GenerationResult.vision_input`).
    vision_input = "vision_embeds"
    #: Tokens past the last prefill CCL go one per decode-shaped call (the planner's
    #: ``prefill_stop``); a runner whose plan has no such tail refuses those prompts instead.
    decode_shaped_tail = True

    def __init__(
        self,
        checkpoint: Checkpoint,
        vision: OnnxProgram,
        language: OnnxProgram,
        shape: LanguageShape,
        cache: EmbeddingCache | None = None,
        patch_buckets: Sequence[Mapping[str, int]] | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        deployment: Deployment | None = None,
    ):
        self.checkpoint = checkpoint
        #: The deployment mode: capabilities, the engine's slots, where state lives.
        self.deployment = deployment if deployment is not None else DEPLOYMENTS[DUAL]
        family = self.family = checkpoint.family
        self.host = checkpoint.host
        self.vision = vision
        self.language = language
        #: Where the language program's retained state lives (:mod:`~qeff_vision.runtime.backends`).
        self.backend = backend_of(language)
        self.shape = shape
        self.eos_token_ids = set(checkpoint.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.cache = cache if cache is not None else EmbeddingCache(DEFAULT_CACHE_BYTES)
        description = checkpoint.description
        dims = self.dims = checkpoint.dims
        self.image_token_id = family.image_token_id(description)
        self.position_rows = family.position_id_rows
        # Stacked row inputs (Qwen3-VL deepstack) travel with vision_embeds as extra columns of
        # one wide row per placeholder, so the cache and the chunk slicing treat them as one.
        self.stack_depths = family.stack_depths(description)
        self.row_width = dims.hidden_size * (1 + sum(self.stack_depths.values()))
        #: Compiled vision specializations (symbol values), when known: clips are checked against them.
        self.compiled_vision: list[Mapping[str, object]] = []
        #: The language IO table: feeds, caches and outputs are named and shaped by its rows.
        graph_dims = language.input_dims
        table = {
            "comp_ctx_lengths": bool(shape.prefill_ccls or shape.decode_ccls),
            # A continuous-batching program (it takes batch_index) driven for one sequence, slot 0.
            "continuous_batching": symbols.BATCH_INDEX in graph_dims,
        }
        # A disaggregated compile's kv_cache_prefix: the graph's KV inputs are past_key.{i}_<prefix>.
        prefix = kv_prefix_of(graph_dims)
        self.io = with_kv_prefix(family.language_table(description, **table), prefix)
        if keeps_full_kv(self.io, graph_dims):  # exported with retain_full_kv: ctx_len on ring layers
            self.io = with_kv_prefix(family.language_table(description, **table, retain_full_kv=True), prefix)
        # A program compiled with the on-device sampler returns next_tokens instead of logits.
        self.io, self.device_sampler = program_sampler(
            self.io,
            graph_dims,
            getattr(language, "output_names", ()),
            dims.vocab_size,
        )
        self.logits_name = None if self.device_sampler else self.io.name(Role.LOGITS, output=True)
        #: Caches a kept prefix cannot roll back (window rings, recurrent states).
        self._unpositioned = unpositioned_caches(self.io)
        # One zero array per compute-context length (a bound input stays bound); which length each
        # call used is its request's (RequestState.ccl_history), never kept here.
        self._ccl_feeds: dict[int, np.ndarray] = {}
        #: Patch-bucket mode: the vision specializations (symbol values), smallest bucket first;
        #: the encoder packs images into them. None: one program per resolution.
        self.patch_buckets = (
            sorted(patch_buckets, key=lambda bucket: bucket[symbols.VISION_SIZE]) if patch_buckets else None
        )
        #: Video token pruning (EVS) rate, 0 = off (:meth:`set_video_pruning_rate`), and the
        #: retention mask of each pruned clip by its cache key.
        self.video_pruning_rate = 0.0
        self.retention: dict[str, np.ndarray] = {}
        self._engine: BatchedEngine | None = None

    def empty_cache(self, slots: int = 1) -> dict[str, np.ndarray]:
        """A zeroed KV cache to pass as :meth:`step`'s ``past``; empty when the device retains it.

        A device reuses its resident cache across requests without clearing it: positions restart
        at 0 and the masks only read slots a request has written, so stale slots are never seen.

        Args:
            slots: The cache's batch axis: 1, or ``full_batch_size`` for a continuous-batching
                program (one row per KV slot).

        Returns:
            KV input name -> a new zero array, shaped for the compiled ``ctx_len``.
        """
        return self.backend.host_state(lambda: self._zero_state(slots))

    def _zero_state(self, slots: int) -> dict[str, np.ndarray]:
        """Every per-slot input of the table at its initial value, ``slots`` rows (:meth:`empty_cache`)."""
        description = self.checkpoint.description
        values = {
            symbols.BATCH_SIZE: slots,
            symbols.FULL_BATCH_SIZE: slots,
            **self.family.language_dims(description),
            **self.family.kv_cache_lengths(description, self.shape.ctx_len),
        }
        # Recurrent layers' conv and recurrent states start at zero too (a chunk at text position 0
        # also resets them in the graph, so a reused slot never sees its previous occupant's).
        caches = {
            row.name: self.io.layers[row.layer].initial(row, values) for row in self.io.rows(*SLOT_ROLES)
        }
        if self.device_sampler is not None:  # its penalty buffers: per slot, handed off like the KV
            caches.update(self.device_sampler.empty_buffers(slots))
        return caches

    def with_sampler_inputs(
        self, feeds: dict[str, np.ndarray], rows: Sequence[RequestDraws | None]
    ) -> dict[str, np.ndarray]:
        """``feeds`` plus the on-device sampler's inputs for each row's request (unchanged without one).

        Args:
            feeds: A call's inputs (its token ids name ``last_accepted_output_tokens``).
            rows: Each row's request draws (:attr:`RequestState.draws
                <qeff_vision.runtime.request_state.RequestState.draws>`), None for an idle row.
        """
        if self.device_sampler is None:
            return feeds
        return self.device_sampler.with_inputs(feeds, rows)

    def _positions(self, positions: np.ndarray, start: int, stop: int, seq_len: int) -> np.ndarray:
        window = positions[..., start:stop]
        pad = seq_len - (stop - start)
        if pad:
            padding = np.full(window.shape[:-1] + (pad,), -1, dtype=np.int64)
            window = np.concatenate([window, padding], axis=-1)
        return np.ascontiguousarray(window, dtype=np.int64)

    def step(
        self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray], in_place: bool = False
    ) -> dict[str, np.ndarray]:
        """One language-program call over the KV cache ``past``, which then holds the updated caches.

        Adds the compute-context length input the positions need (when compiled with CCLs) and,
        for a continuous-batching program without ``batch_index`` in ``feeds``, KV slot 0. State
        a call supplies beside the cache is the decoder kind's to place (:meth:`supply_states`);
        the one call of every decoder kind, program form and backend (no runner overrides it).

        Args:
            feeds: The call's inputs without the cache (:meth:`chunk_feeds` or
                :meth:`decode_step_feeds`, plus ``batch_index`` to write one slot); not modified.
            past: The cache (from :meth:`empty_cache`), updated by the call.
            in_place: The backend may write the new caches into ``past``'s own arrays: only for a
                cache nothing else holds (the batched engine's). Otherwise ``past``'s entries are
                replaced by new arrays.

        Returns:
            The program's outputs by name (logits, ``image_idx_output``, the retained caches).
        """
        ccl = self.call_ccl(feeds)
        if ccl is not None:
            # Attention reads the first `ccl` slots: every position written so far (QEfficient feeds
            # a zero vector of that length; only its shape matters).
            if ccl not in self._ccl_feeds:  # one array per length, so a bound input stays bound
                self._ccl_feeds[ccl] = np.zeros(ccl, np.int64)
            feeds = {**feeds, self.io.name(Role.COMP_CTX_LENGTHS): self._ccl_feeds[ccl]}
        feeds, may_alias = self.supply_states(feeds, past)
        retained = self.io.retained_outputs()
        feeds = self._with_kv_slot(feeds)
        return self.backend.call(self.language, feeds, past, retained, in_place and may_alias)

    def call_ccl(self, feeds: Mapping[str, np.ndarray]) -> int | None:
        """The compute-context length the call with ``feeds`` attends (None without CCL specializations)."""
        decode = feeds[self.io.name(Role.TOKEN_IDS)].shape[1] == 1
        return self.ccl_at(decode, [feeds[self.io.name(Role.POSITIONS)]])

    def ccl_at(self, decode: bool, positions: Sequence[np.ndarray]) -> int | None:
        """The compute-context length of a prefill or ``decode`` call whose rows have ``positions``.

        One rule for :meth:`step` and the engine, which books each call's length to the requests
        it served (:attr:`RequestState.ccl_history
        <qeff_vision.runtime.request_state.RequestState.ccl_history>`).
        """
        text = (rows if self.position_rows is None else rows[0] for rows in positions)
        return self.shape.comp_ctx_length(decode, max(int(np.max(rows)) for rows in text))

    def supply_states(
        self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], bool]:
        """(the call's feeds, whether the cache may be written in place) after placing supplied state.

        The token-merge kind supplies none: ``feeds`` as given, in place allowed. (The
        cross-attention kind writes a request's cross states into its slot of the cache.)
        """
        return feeds, True

    def _with_kv_slot(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` plus ``batch_index`` 0 when a continuous-batching program is given no slot.

        Unchanged when the program takes no ``batch_index`` or ``feeds`` already names a slot.
        """
        if self.io.has(Role.KV_SLOT) and self.io.name(Role.KV_SLOT) not in feeds:
            # A continuous-batching program driven for one sequence: it lives in KV slot 0.
            batch = feeds[self.io.name(Role.TOKEN_IDS)].shape[0]
            feeds = {**feeds, self.io.name(Role.KV_SLOT): np.zeros((batch, 1), np.int64)}
        return feeds

    def feed_token(
        self,
        token: int,
        position: np.ndarray,
        past: dict[str, np.ndarray],
        extra: Mapping[Role, np.ndarray] | None = None,
        draws: RequestDraws | None = None,
    ) -> dict:
        """One decode-shaped :meth:`step` of one sequence: ``token`` at ``position``, taking no image row.

        A seq_len-1 step merges no row (:func:`qeff_vision.export.decoder.vision_row_index`), so a
        placeholder id the model generated keeps its token embedding, as in transformers.

        Args:
            token: The token fed (the last one generated).
            position: Its position ids
                (:meth:`~qeff_vision.families.host.Host.decode_positions`).
            past: The sequence's batch-1 KV cache, updated by the call.
            extra: Further inputs of every decode step by role (:meth:`decode_extra`).
            draws: The sequence's request draws, for a program with the on-device sampler.

        Returns:
            The program's outputs by name; the next token's logits are ``[0, -1]`` of the logits.
        """
        feeds = self.decode_step_feeds(np.array([[token]], dtype=np.int64), position, extra)
        return self.step(self.with_sampler_inputs(feeds, [draws]), past)

    def decode_step_feeds(
        self, token_ids: np.ndarray, positions: np.ndarray, extra: Mapping[Role, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """Inputs of a decode-shaped call (seq_len 1, one row per sequence), the KV cache excluded.

        ``image_idx`` points past the decode rows (the call merges none); the decode rows are
        zeros sent on onnxruntime only (a device keeps the last chunk's vision_embeds resident).
        ``extra`` adds inputs by role (a cross-attention family's mask row).
        """
        by_role = {
            Role.TOKEN_IDS: token_ids,
            Role.POSITIONS: positions,
            Role.VISION_CURSOR: np.array([[self.shape.decode_vision_size]], dtype=np.int64),
            **self.backend.host_state(lambda: {Role.VISION_ROWS: self.decode_vision_feeds()}),
        }
        by_role.update(extra or {})
        return self.io.feeds(by_role)

    def decode_extra(self, processed: Mapping[str, Any]) -> dict[Role, np.ndarray]:
        """Inputs by role every decode step of this request adds, one row (none for this kind)."""
        return {}

    def check_fits(self, length: int, max_new_tokens: int, used: int = 0) -> None:
        """Raise :class:`UserError` unless ``used`` KV slots, ``length`` prompt and the new tokens fit.

        With compute-context lengths a prompt may reach past the last prefill CCL, which
        QEfficient's lists keep under ``ctx_len`` (:mod:`qeff_vision.spec.ccl_lists`): its tokens
        there go one per decode-shaped call (:meth:`plan`). A runner or deployment without such
        calls (:attr:`decode_shaped_tail`) refuses that prompt here.
        """
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if used + length + max_new_tokens > self.shape.ctx_len:
            room = self.shape.ctx_len - used - length
            hint = f"at most {room} new tokens fit" if room > 0 else "shorten the prompt or use fewer images"
            raise UserError(
                f"prompt of {length} tokens + {max_new_tokens} new tokens exceeds the compiled "
                f"ctx_len {self.shape.ctx_len} ({hint})"
            )
        limit = self.shape.prefill_limit
        if used + length > limit and not self.feeds_decode_tail:
            raise UserError(
                f"prompt of {length} tokens reaches position {used + length - 1}, past the last prefill "
                f"comp_ctx_length {limit} (prefill is compiled for prompts of at most {limit} tokens)"
            )

    @property
    def feeds_decode_tail(self) -> bool:
        """Whether this runner and deployment feed tokens past the last prefill CCL one at a time."""
        return self.decode_shaped_tail and self.deployment.decode_shaped_tail

    def plan(
        self,
        input_ids: np.ndarray,
        processed: Mapping[str, Any],
        protocol: str,
        start: int = 0,
        positions: np.ndarray | None = None,
    ) -> ChunkPlan:
        """The chunk plan of a processed prompt's tokens from ``start`` on (after a kept prefix).

        ``positions``: the prompt's position ids as fed (after a history, continued); by default the
        host's. With prefill CCLs, the tokens whose text position is past the last one end the
        prefill part (:func:`~qeff_vision.runtime.planner.plan_chunks` ``prefill_stop``).
        """
        return plan_chunks(
            len(input_ids) - start,
            segments_after(self.host.segments({**processed, "input_ids": input_ids}), start),
            self.shape.buckets,
            allow_image_split=self.family.splits_images(self.checkpoint.description),
            protocol=protocol,
            prefill_stop=self._prefill_stop(processed, positions, start),
            decode_vision_size=self.shape.decode_vision_size,
        )

    def _prefill_stop(
        self, processed: Mapping[str, Any], positions: np.ndarray | None, start: int
    ) -> int | None:
        """The first planned token whose text position no prefill CCL covers (None: every one is covered)."""
        if not self.shape.prefill_ccls or not self.feeds_decode_tail:
            return None
        if positions is None:
            positions = self.host.prompt_positions(processed)
        text = np.asarray(positions if self.position_rows is None else positions[0]).reshape(-1)[start:]
        beyond = np.flatnonzero(text >= self.shape.prefill_limit)
        return int(beyond[0]) if len(beyond) else None

    @property
    def engine(self) -> BatchedEngine:
        """The engine of this runner's lone requests: slot 0 of the compiled slots (made once)."""
        if self._engine is None:
            self._engine = BatchedEngine(self, compiled_slots(self), one_sequence=True)
        return self._engine

    def generate(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int = 32,
        protocol: str = VisionProtocol.CHUNK.value,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        history: Continuation | None = None,
        keep_prefix: bool = False,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generation for one processed prompt, a batch of one of :attr:`engine` (greedy by default).

        Args:
            processed: Processor outputs as numpy arrays (input_ids, pixel_values, ...).
            max_new_tokens: Upper bound on generated tokens.
            protocol: ``chunk`` or ``full``.
            on_token: Called with each token id as soon as it is known (streaming).
            keep_logits: Keep each step's logits row in the result (parity checks).
            history: A previous result's ``continuation``: ``processed`` is then only the new
                turn's tokens and images, run after that history's KV cache (see
                :mod:`qeff_vision.runtime.continuation`). The history is consumed.
            keep_prefix: ``processed`` is the whole conversation: prefill only what follows the
                prefix the program holds from the last such call (:mod:`~qeff_vision.runtime.kept_prefix`),
                and record what it holds after this one.
            sampling: How tokens are chosen (:class:`~qeff_vision.inputs.sampling_params.SamplingParams`;
                greedy when None).

        Raises:
            UserError: The prompt and the new tokens do not fit ``ctx_len``, no plan fits the
                compiled buckets (:class:`PlanError`), or a shape was not compiled
                (:class:`ShapeMismatch`).
        """
        return self.engine.generate(
            processed,
            max_new_tokens,
            protocol,
            on_token,
            keep_logits,
            sampling,
            history=history,
            keep_prefix=keep_prefix,
        )

    def initial_cache(self, request: RequestState) -> dict[str, np.ndarray]:
        """The cache a lone request starts from: its history's, else fresh with a kept prefix's caches."""
        if request.history is not None:
            return request.history.past
        return {**self.empty_cache(), **request.resume.restore}

    def chunk_feeds(
        self, chunk: Chunk, vision: np.ndarray, input_ids: np.ndarray, positions: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Language inputs of one prefill chunk (batch 1; the KV cache is added by the caller).

        Args:
            chunk: The chunk.
            vision: What carries image information into it, the decoder kind's: the chunk's wide
                embedding rows (token-merge; the cross-attention kind takes the request's mask).
            input_ids: The prompt's token ids from where the plan starts.
            positions: Their position ids.
        """
        return self.io.feeds(
            {
                **self._chunk_tokens(chunk, input_ids, positions),
                Role.VISION_ROWS: self._vision_feeds_of_rows(vision),
                Role.VISION_CURSOR: np.array([[chunk.image_idx]], dtype=np.int64),
            }
        )

    def _chunk_tokens(
        self, chunk: Chunk, input_ids: np.ndarray, positions: np.ndarray
    ) -> dict[Role, np.ndarray]:
        """A chunk's token ids and position ids, padded to its ``seq_len`` (padding at position -1).

        ``input_ids`` and ``positions`` start where the plan does (after a kept prefix).
        """
        token_ids = np.zeros((1, chunk.seq_len), dtype=np.int64)
        token_ids[0, : chunk.tokens] = input_ids[chunk.token_slice]
        return {
            Role.TOKEN_IDS: token_ids,
            Role.POSITIONS: self._positions(positions, chunk.start, chunk.stop, chunk.seq_len),
        }

    def request_chunks(self, request: RequestState) -> Iterator[ChunkCall]:
        """One call per prefill chunk of ``request`` (its tokens after a kept prefix).

        Images are encoded (or taken from the embedding cache) when a chunk first needs them and
        unpinned after their last chunk, also when the caller closes the iterator early. A kept
        prefix's images are held by the program: the plan and the rows start after them.
        """
        plan, processed = request.plan, request.processed
        images, inputs_by_key = (
            self._prepare_images(processed, request.prepared) if plan.segments else ([], {})
        )
        request.images = images = images[request.resume.images :]
        encoder = self._encoder(inputs_by_key, request.encode_timer, request.served)
        chunks = feed_chunks(plan, images, self.cache, encoder, self.row_width, np.float32)
        input_ids, positions = request.input_ids[request.start :], request.positions[..., request.start :]
        try:
            for chunk, rows in chunks:
                yield ChunkCall(chunk, self.chunk_feeds(chunk, rows, input_ids, positions), rows.nbytes)
        finally:
            chunks.close()

    def request_images(self, request: RequestState) -> tuple[int, int]:
        """(images and videos, their embedding rows) of a request's prompt, a kept prefix's included."""
        kept = request.resume.images
        held = self.host.segments(request.processed)[:kept] if kept else []
        plan = request.plan
        return len(held) + len(plan.segments), sum(segment.rows for segment in held) + plan.total_rows

    def finish(self, request: RequestState, result: GenerationResult) -> GenerationResult:
        """The result with how each image was served; records what the program holds (a kept prefix)."""
        result.served = self.served_notes(request)
        return super().finish(request, result)

    def check_chunk_outputs(self, chunk: Chunk, outputs: Mapping[str, np.ndarray]) -> None:
        """The program's image counter after a chunk must be the plan's."""
        returned = int(outputs[self.io.name(Role.VISION_CURSOR, output=True)].reshape(-1)[0])
        if returned != chunk.image_idx_output:
            raise RuntimeError(
                f"chunk {chunk.index}: image_idx_output {returned}, expected {chunk.image_idx_output}"
            )
