"""Chunk-aware generation over the two programs: plan, encode on first use, prefill chunk by chunk, decode.

The host side of the protocol in docs/design.md: positions (M-RoPE included) are computed once
for the whole prompt and sliced per chunk; each chunk receives only its rows of the per-image
embeddings (``chunk`` protocol) or the whole embedding (``full``, kept for comparison); images are
encoded when a chunk first needs them, through a per-conversation :class:`EmbeddingCache`. A
conversation's turn prefills only what follows the prefix the language program already holds
(:mod:`qeff_vision.runtime.kept_prefix`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.contract.full_kv import keeps_full_kv
from qeff_vision.contract.language_io import SLOT_ROLES, Role
from qeff_vision.contract.slot_names import kv_prefix_of, with_kv_prefix
from qeff_vision.errors import UserError
from qeff_vision.runtime.continuation import Continuation, continued_positions
from qeff_vision.runtime.decoding import TokenDecoding
from qeff_vision.runtime.deployment import Deployment, deployment_of
from qeff_vision.runtime.device_sampler import last_rows, pick, program_sampler
from qeff_vision.runtime.embedding_cache import EmbeddingCache, PreparedImage, feed_chunks
from qeff_vision.runtime.image_encoding import ImageEncoding
from qeff_vision.runtime.kept_prefix import PrefixKeeping
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import Chunk, ChunkPlan, VisionProtocol, plan_chunks
from qeff_vision.runtime.results import ChunkRecord, GenerationResult
from qeff_vision.runtime.retained_prefix import segments_after, unpositioned_caches
from qeff_vision.runtime.sampling import SamplingParams, TokenSampler
from qeff_vision.runtime.session import OnnxProgram

DEFAULT_CACHE_BYTES = 256 * 2**20


class Generator(ImageEncoding, TokenDecoding, PrefixKeeping):
    """Runs prompts through a vision program and a language program with the chunk protocol.

    Its vision half is :class:`~qeff_vision.runtime.image_encoding.ImageEncoding`, its decode half
    (one-token calls after the prompt) :class:`~qeff_vision.runtime.decoding.TokenDecoding`, the
    prefix a conversation keeps between turns :class:`~qeff_vision.runtime.kept_prefix.PrefixKeeping`.

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
            by default the one ``language`` is (dual, or disaggregated for a phase router).
    """

    #: What a result's ``vision_bytes`` count (:attr:`GenerationResult.vision_input`).
    vision_input = "vision_embeds"

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
        self.deployment = deployment if deployment is not None else deployment_of(language)
        family = self.family = checkpoint.family
        self.host = checkpoint.host
        self.vision = vision
        self.language = language
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
        graph_dims = getattr(language, "input_dims", {})
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
            getattr(language, "retains_state", False),
        )
        self.logits_name = None if self.device_sampler else self.io.name(Role.LOGITS, output=True)
        #: Caches a kept prefix cannot roll back (window rings, recurrent states).
        self._unpositioned = unpositioned_caches(self.io)
        #: The compute-context length fed to each language call (empty without CCL specializations).
        self.ccl_history: list[int] = []
        self._ccl_feeds: dict[int, np.ndarray] = {}
        #: Patch-bucket mode: the vision specializations (symbol values), smallest bucket first;
        #: the encoder packs images into them. None: one program per resolution.
        self.patch_buckets = (
            sorted(patch_buckets, key=lambda bucket: bucket[symbols.VISION_SIZE]) if patch_buckets else None
        )
        #: How the vision program served each image of the last prompt (what ``run`` reports).
        self.served: dict[str, str] = {}
        self._images: list[PreparedImage] = []
        #: Video token pruning (EVS) rate, 0 = off (:meth:`set_video_pruning_rate`), and the
        #: retention mask of each pruned clip by its cache key.
        self.video_pruning_rate = 0.0
        self.retention: dict[str, np.ndarray] = {}
        self.prepared: tuple | None = None

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
        if self.language.retains_state:
            return {}
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
            row.name: np.zeros(row.concrete_shape(values), np.float32) for row in self.io.rows(*SLOT_ROLES)
        }
        if self.device_sampler is not None:  # its penalty buffers: per slot, handed off like the KV
            caches.update(self.device_sampler.empty_buffers(slots))
        return caches

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
        for a continuous-batching program without ``batch_index`` in ``feeds``, KV slot 0.

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
        positions = feeds[self.io.name(Role.POSITIONS)]
        text_positions = positions if self.position_rows is None else positions[0]
        decode = feeds[self.io.name(Role.TOKEN_IDS)].shape[1] == 1
        ccl = self.shape.comp_ctx_length(decode, int(text_positions.max()))
        if ccl is not None:
            # Attention reads the first `ccl` slots: every position written so far (QEfficient feeds
            # a zero vector of that length; only its shape matters).
            if ccl not in self._ccl_feeds:  # one array per length, so a bound input stays bound
                self._ccl_feeds[ccl] = np.zeros(ccl, np.int64)
            feeds = {**feeds, self.io.name(Role.COMP_CTX_LENGTHS): self._ccl_feeds[ccl]}
            self.ccl_history.append(ccl)
        feeds = self._with_kv_slot(feeds)
        if self.device_sampler is not None:  # its inputs; the host-kept penalty buffers join past
            feeds = self.device_sampler.with_inputs(feeds, past)
        retained = self.io.retained_outputs()
        if in_place and past:
            return self.language.run_retained(feeds, past, retained)
        outputs = self.language.run({**feeds, **past})
        for name in past:
            past[name] = outputs[retained[name]]
        return outputs

    def _with_kv_slot(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` plus ``batch_index`` 0 when a continuous-batching program is given no slot.

        Unchanged when the program takes no ``batch_index`` or ``feeds`` already names a slot.
        """
        if self.io.has(Role.KV_SLOT) and self.io.name(Role.KV_SLOT) not in feeds:
            # A continuous-batching program driven for one sequence: it lives in KV slot 0.
            batch = feeds[self.io.name(Role.TOKEN_IDS)].shape[0]
            feeds = {**feeds, self.io.name(Role.KV_SLOT): np.zeros((batch, 1), np.int64)}
        return feeds

    def check_fits(self, length: int, max_new_tokens: int, used: int = 0) -> None:
        """Raise :class:`UserError` unless ``used`` KV slots, ``length`` prompt and the new tokens fit.

        With compute-context lengths the prompt must also end below the last prefill CCL, which
        QEfficient's lists keep under ``ctx_len`` (:mod:`qeff_vision.spec.ccl_lists`): a prefill
        chunk reaching past it has no specialization.
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
        if used + length > limit:
            raise UserError(
                f"prompt of {length} tokens reaches position {used + length - 1}, past the last prefill "
                f"comp_ctx_length {limit} (prefill is compiled for prompts of at most {limit} tokens)"
            )

    def plan(self, input_ids: np.ndarray, processed: Mapping[str, Any], protocol: str) -> ChunkPlan:
        """The chunk plan of a processed prompt (of its tokens after a kept prefix, in a kept generation)."""
        start = self._resume.start
        return plan_chunks(
            len(input_ids) - start,
            segments_after(self.host.segments({**processed, "input_ids": input_ids}), start),
            self.shape.buckets,
            allow_image_split=self.family.splits_images(self.checkpoint.description),
            protocol=protocol,
        )

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
        """Generation for one processed prompt (batch 1), greedy unless ``sampling`` says otherwise.

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
            sampling: How tokens are chosen (:class:`~qeff_vision.runtime.sampling.SamplingParams`;
                greedy when None).

        Raises:
            UserError: The prompt and the new tokens do not fit ``ctx_len``, no plan fits the
                compiled buckets (:class:`PlanError`), or a shape was not compiled
                (:class:`ShapeMismatch`).
        """
        args = (max_new_tokens, protocol, on_token, keep_logits, sampling, history)
        return self.run_generation(processed, keep_prefix, *args)

    def _generate(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int,
        protocol: str,
        on_token: Callable[[int], None] | None,
        keep_logits: bool,
        sampling: SamplingParams | None,
        history: Continuation | None,
    ) -> GenerationResult:
        """:meth:`generate`'s run (after the prefix :attr:`_resume` keeps, in a kept generation)."""
        started = time.perf_counter()
        self.ccl_history = []
        self.served = {}
        stats_before, calls_before = self.cache.stats, self.vision.calls
        processed = self.prepare_prompt(processed)  # clips pruned (and so encoded) at a pruning rate
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(-1)
        self.resume_prompt(processed, input_ids)  # where a kept generation's prefill starts
        length = len(input_ids)
        # A kept prefix's caches: held on the host (onnxruntime) or resident on the device.
        past = history.past if history is not None else {**self.empty_cache(), **self._resume.restore}
        positions = self.host.prompt_positions(processed)
        used = 0
        if history is not None:
            first = self._feed_history(history, past)
            positions = continued_positions(positions, first)
            used = int(np.asarray(first).reshape(-1)[0])  # KV slots the history fills
        self.check_fits(length, max_new_tokens, used)
        plan = self.plan(input_ids, processed, protocol)
        if self.device_sampler is not None:  # one sequence: row (or KV slot) 0
            self.device_sampler.admit(0, sampling)
        outputs, records = self._prefill(plan, input_ids, positions, processed, past)
        kept = [outputs[self.logits_name][0, -1].copy()] if keep_logits and self.logits_name else None
        sampler = TokenSampler(sampling, input_ids)
        token = pick(sampler, last_rows(outputs, self.logits_name)[0])
        ttft = time.perf_counter() - started
        if on_token:
            on_token(token)
        decode_start = time.perf_counter()
        tokens = self._decode(token, positions, past, max_new_tokens, on_token, kept, sampler=sampler)
        decode_seconds = time.perf_counter() - decode_start
        stats_after = self.cache.stats
        # The images of a kept prefix are the prompt's too (held, so not in the plan).
        held_images = self.host.segments(processed)[: self._resume.images] if self._resume.images else []
        return GenerationResult(
            prompt_tokens=length,
            tokens=tokens,
            chunks=records,
            ttft=ttft,
            decode_seconds=decode_seconds,
            encoder_calls=self.vision.calls - calls_before,
            cache_hits=stats_after.hits - stats_before.hits,
            logits=kept or [],
            protocol=plan.protocol.value,
            images=len(held_images) + len(plan.segments),
            image_rows=sum(segment.rows for segment in held_images) + plan.total_rows,
            images_encoded=stats_after.images_encoded - stats_before.images_encoded,
            continuation=Continuation(past, positions, len(tokens) - 1, (tokens[-1],)),
            served=self._served_notes(),
        )

    def _prefill(
        self,
        plan: ChunkPlan,
        input_ids: np.ndarray,
        positions: np.ndarray,
        processed: Mapping[str, Any],
        past: dict[str, np.ndarray],
    ) -> tuple[dict[str, np.ndarray], list[ChunkRecord]]:
        """Run every chunk of ``plan``; the last call's outputs and one record per chunk.

        In a kept generation the plan covers the tokens after the kept prefix, and its images are
        the prompt's after the kept ones.
        """
        start, kept = self._resume.start, self._resume.images
        input_ids, positions = input_ids[start:], positions[..., start:]
        images, inputs_by_key = self._prepare_images(processed) if plan.segments else ([], {})
        self._images = images = images[kept:]
        encode_timer = [0.0]
        encoder = self._encoder(inputs_by_key, encode_timer)
        hidden = self.row_width
        records: list[ChunkRecord] = []
        outputs: dict[str, np.ndarray] = {}
        encoded_before, encode_before = self.cache.stats.images_encoded, 0.0
        for chunk, vision_embeds in feed_chunks(plan, images, self.cache, encoder, hidden, np.float32):
            chunk_start = time.perf_counter()
            outputs = self.step(self.chunk_feeds(chunk, vision_embeds, input_ids, positions), past)
            seconds = time.perf_counter() - chunk_start
            self.check_chunk_outputs(chunk, outputs)
            encoded_now = self.cache.stats.images_encoded
            records.append(
                ChunkRecord(
                    tokens=chunk.tokens,
                    seq_len=chunk.seq_len,
                    vision_size=chunk.vision_size,
                    rows=chunk.rows,
                    vision_bytes=vision_embeds.nbytes,
                    seconds=seconds,
                    encode_seconds=encode_timer[0] - encode_before,
                    images_encoded=encoded_now - encoded_before,
                    start=start + chunk.start,
                )
            )
            encoded_before, encode_before = encoded_now, encode_timer[0]
        self.record_prompt_end(past)  # what a later turn resuming at the prompt's end restores
        return outputs, records

    def chunk_feeds(
        self, chunk: Chunk, vision_embeds: np.ndarray, input_ids: np.ndarray, positions: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Language inputs of one prefill chunk (batch 1; the KV cache is added by the caller)."""
        token_ids = np.zeros((1, chunk.seq_len), dtype=np.int64)
        token_ids[0, : chunk.tokens] = input_ids[chunk.token_slice]
        return self.io.feeds(
            {
                Role.TOKEN_IDS: token_ids,
                Role.POSITIONS: self._positions(positions, chunk.start, chunk.stop, chunk.seq_len),
                Role.VISION_ROWS: self._vision_feeds_of_rows(vision_embeds),
                Role.VISION_CURSOR: np.array([[chunk.image_idx]], dtype=np.int64),
            }
        )

    def request_chunks(
        self,
        plan: ChunkPlan,
        processed: Mapping[str, Any],
        input_ids: np.ndarray,
        positions: np.ndarray,
        encode_timer: list[float],
    ) -> Iterator[tuple[Chunk, dict[str, np.ndarray], int]]:
        """(chunk, its language inputs, vision bytes they carry) per prefill chunk of one request.

        What the batched engine feeds a request's slot, chunk by chunk: images are encoded (or
        taken from the embedding cache) when a chunk first needs them and unpinned after their
        last chunk, also when the caller closes the iterator early.
        """
        images, inputs_by_key = self._prepare_images(processed) if plan.segments else ([], {})
        encoder = self._encoder(inputs_by_key, encode_timer)
        chunks = feed_chunks(plan, images, self.cache, encoder, self.row_width, np.float32)
        try:
            for chunk, rows in chunks:
                yield chunk, self.chunk_feeds(chunk, rows, input_ids, positions), rows.nbytes
        finally:
            chunks.close()

    def request_images(self, plan: ChunkPlan, processed: Mapping[str, Any]) -> int:
        """Images (and videos) of a request, as its report counts them: the plan's segments."""
        return len(plan.segments)

    def check_chunk_outputs(self, chunk: Chunk, outputs: Mapping[str, np.ndarray]) -> None:
        """The program's image counter after a chunk must be the plan's."""
        returned = int(outputs[self.io.name(Role.VISION_CURSOR, output=True)].reshape(-1)[0])
        if returned != chunk.image_idx_output:
            raise RuntimeError(
                f"chunk {chunk.index}: image_idx_output {returned}, expected {chunk.image_idx_output}"
            )
