"""Host side of the cross-attention decoder kind (``contract.decoder_kinds.CROSS_ATTENTION``).

The vision program turns one image into key/value states for every cross-attention layer (its
outputs are named like the language program's cache inputs of those layers). The host encodes
each image of a request once, concatenates the images' states along the row axis in prompt order
(one image's states are a block of rows, so the cross-attention mask's image axis selects them),
and hands them to the language program with the first prefill call. Those inputs are retained
state: on onnxruntime the host feeds back the returned (unchanged) tensors, on a device they stay
resident, so no chunk or decode step recomputes or resends them.

Prefill chunks are plain token windows (an image is one placeholder token, nothing to keep
whole); each carries its rows of the processor's ``cross_attention_mask``. Decode steps repeat the
prompt's last mask row, as transformers' ``_update_model_kwargs_for_generation`` does for mllama.
A compiled program has a fixed number of image slots (``max_num_images``): unused slots get zero
states and mask -1, which the decoder keeps unseen even for rows that see no image. A text-only
prompt sends only such slots: attention over zero values and the masked-out MLP leave the hidden
states unchanged, as transformers' skipping of the cross layers does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.runtime.embedding_cache import content_key
from qeff_vision.runtime.generator import Generator
from qeff_vision.runtime.kept_prefix import PrefixKeeping
from qeff_vision.runtime.planner import Chunk, ChunkPlan, plan_chunks
from qeff_vision.runtime.request_state import ChunkCall, RequestState
from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import HeldPrefix, Resume, image_set_resume, unpositioned_caches

CROSS_ATTENTION_MASK = symbols.CROSS_ATTENTION_MASK


class CrossAttentionGenerator(Generator):
    """:class:`Generator` for cross-attention families (same constructor, same results).

    ``cross_mask_shape`` is the language program's ``cross_attention_mask`` shape (its last axis,
    tiles per image, is static); read from the program's inputs when not given.
    """

    vision_input = "cross-attention K/V"
    decode_shaped_tail = False  # its plan prefills every token (mask rows per chunk)
    #: What a prompt is to this runner (a single program holds a whole conversation).
    prompt_kind = "request"

    def __init__(self, *args, cross_mask_shape=(), **kwargs):
        super().__init__(*args, **kwargs)
        cross_mask_shape = cross_mask_shape or self.language.input_dims.get(self.io.name(Role.CROSS_MASK), ())
        description = self.checkpoint.description
        self.cross_names = list(self.family.vision_outputs(description))
        self.cross_mask_width = int(cross_mask_shape[-1]) if cross_mask_shape else 0
        self.states_per_image = self.family.kv_cache_lengths(description, self.shape.ctx_len)
        # A compiled language program has a fixed image-slot count: fewer images are padded with
        # zero states that the mask never selects. None (a bare export): exactly the request's.
        slots = {s.get(symbols.MAX_NUM_IMAGES) for s in self.language.specializations or ()} - {None}
        self.image_slots = slots.pop() if len(slots) == 1 else None
        self._unpositioned = unpositioned_caches(self.io, exclude=self.cross_names)

    def prefix_images(
        self, processed: Mapping[str, Any], prepared: tuple | None = None
    ) -> tuple[list[str], list[tuple[int, int]]]:
        """Content keys and ``<|image|>`` token spans of the prompt's images (see :meth:`keys_and_spans`)."""
        return self.keys_and_spans(processed)[1:]

    def keys_and_spans(self, processed: Mapping[str, Any]) -> tuple[list, list[str], list]:
        """Per image of the prompt: its inputs, content key and ``<|image|>`` token span."""
        per_image = self.host.vision_inputs(processed) if self.host.has_images(processed) else []
        keys = [
            content_key(next(iter(inputs.values())), tuple(int(d) for a in inputs.values() for d in a.shape))
            for inputs in per_image
        ]
        input_ids = np.asarray(processed["input_ids"]).reshape(-1)
        spans = [(int(at), int(at) + 1) for at in np.flatnonzero(input_ids == self.image_token_id)]
        return per_image, keys, spans if len(spans) == len(keys) else []

    def kept_resume(self, resume: Resume, held: HeldPrefix | None, keys) -> Resume:
        """A prefix kept only while the prompt's images are the held ones (a text-less token reads all).

        The dual programs hold no image slots of their own: a changed image set starts over (the
        vision program's states come from the embedding cache while it holds them).
        """
        resume = image_set_resume(resume, held, keys)
        return resume if resume.start else Resume()

    def empty_cache(self, slots: int = 1) -> dict[str, np.ndarray]:
        """Zeroed KV of ``slots`` sequences, the cross layers' sized for the compiled image slots.

        :meth:`generate` replaces the cross layers' with the request's states; the batched
        engine's requests write theirs into their slot (:meth:`step`).
        """
        past = super().empty_cache(slots)
        images = self.image_slots if self.image_slots is not None else 1
        for name in self.cross_names:
            if name in past:
                shape = past[name].shape
                past[name] = np.zeros((*shape[:2], images * self._rows_per_image(), shape[3]), np.float32)
        return past

    def _cross_states(self, processed: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Every cross layer's K/V for the request's images and the images encoded for them.

        Each image's states live in the bounded, shared embedding cache under its content key (an
        image shown again is not encoded while the cache holds it; the least recently used are
        evicted past the bound, so a server's memory stays flat however many images it sees).
        The request's own copy is the concatenation below, held only while it runs.
        """
        per_image, keys, _ = self.keys_and_spans(processed)
        states, encoded = [], 0
        for inputs, key in zip(per_image, keys):
            found = self.cache.get(key)
            if found is None:
                outputs = self.vision.run(inputs)
                found = {name: outputs[name] for name in self.cross_names}
                self.cache.put(key, found)
                self.cache.record_encoder_call(1)
                encoded += 1
            states.append(found)
        # More images than slots were refused before any call (:meth:`begin`).
        slots = self.image_slots if self.image_slots is not None else max(len(states), 1)
        states += [self._zero_states()] * (slots - len(states))
        return {name: np.concatenate([s[name] for s in states], axis=2) for name in self.cross_names}, encoded

    def _zero_states(self) -> dict[str, np.ndarray]:
        shape = (1, self.dims.num_kv_heads, self._rows_per_image(), self.dims.head_dim)
        return {name: np.zeros(shape, np.float32) for name in self.cross_names}

    def _cross_mask(self, processed: Mapping[str, Any], length: int) -> np.ndarray:
        """The processor's mask, padded on the image axis to the image slots with -1 (slot unused)."""
        if CROSS_ATTENTION_MASK in processed:
            mask = np.asarray(processed[CROSS_ATTENTION_MASK], dtype=np.int64)
        else:
            mask = np.zeros((1, length, 0, self.cross_mask_width), np.int64)
        slots = self.image_slots if self.image_slots is not None else max(mask.shape[2], 1)
        return np.pad(mask, ((0, 0), (0, 0), (0, slots - mask.shape[2]), (0, 0)), constant_values=-1)

    def begin(self, request: RequestState) -> Resume:
        """:meth:`Generator.begin`; a continued turn cannot add images (its cross states are the first's)."""
        processed = request.processed
        images = len(self.host.placeholder_counts(processed)) if self.host.has_images(processed) else 0
        if request.history is not None and images:
            raise UserError("a continued turn of a cross-attention model cannot add images")
        if self.image_slots is not None and images > self.image_slots:
            slots = self.image_slots
            raise UserError(
                f"{images} images in the {self.prompt_kind}; the programs were compiled for at most {slots}"
            )
        return super().begin(request)

    def plan(
        self,
        input_ids: np.ndarray,
        processed: Mapping[str, Any],
        protocol: str,
        start: int = 0,
        positions: np.ndarray | None = None,
    ) -> ChunkPlan:
        """Plain token windows from ``start`` on: an image is one placeholder token (``positions`` unused)."""
        return plan_chunks(len(input_ids) - start, [], self.shape.buckets, protocol=protocol)

    def chunk_feeds(
        self, chunk: Chunk, vision: np.ndarray, input_ids: np.ndarray, positions: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Language inputs of one prefill chunk: its tokens, positions and rows of ``vision``.

        ``vision`` is what carries image information for this kind: the request's
        cross-attention mask (:meth:`request_mask`), of which the chunk takes its token rows.
        """
        chunk_mask = np.zeros((1, chunk.seq_len, *vision.shape[2:]), np.int64)
        chunk_mask[:, : chunk.tokens] = vision[:, chunk.token_slice]
        return self.io.feeds({**self._chunk_tokens(chunk, input_ids, positions), Role.CROSS_MASK: chunk_mask})

    def request_mask(self, request: RequestState) -> np.ndarray:
        """The request's cross-attention mask from its first prefilled token on.

        A continued turn repeats its history's last row, as transformers'
        ``prepare_inputs_for_generation`` pads a shorter ``cross_attention_mask`` for mllama.
        """
        length = len(request.input_ids)
        if request.history is not None:
            mask = np.repeat(request.history.decode_feeds[Role.CROSS_MASK], length, axis=1)
        else:
            mask = self._cross_mask(request.processed, length)
        return mask[:, request.start :]

    def request_chunks(self, request: RequestState) -> Iterator[ChunkCall]:
        """One call per prefill chunk of ``request`` (see :meth:`Generator.request_chunks`).

        The first chunk of a request with images also carries its cross states (each image
        encoded once, shared across requests), which :meth:`step` writes into the request's
        slot. A request without images carries none: its slot keeps whatever it held, and the
        program reads no cross values for it; nor does a kept prefix or a continued turn, whose
        cache holds its images' states.
        """
        started = time.perf_counter()
        processed = request.processed
        fresh = not request.start and request.history is None and self.host.has_images(processed)
        cross = self._cross_states(processed)[0] if fresh else {}
        request.encode_timer[0] += time.perf_counter() - started
        mask = self.request_mask(request)
        input_ids, positions = request.input_ids[request.start :], request.positions[..., request.start :]
        for chunk in request.plan.chunks:
            feeds = self.chunk_feeds(chunk, mask, input_ids, positions)
            if chunk.index == 0 and cross:
                feeds.update(cross)
            yield ChunkCall(chunk, feeds, sum(cross[n].nbytes for n in cross) if chunk.index == 0 else 0)

    def request_images(self, request: RequestState) -> tuple[int, int]:
        """(images, rows) of a request: one ``<|image|>`` token each, no embedding rows."""
        processed = request.processed
        return len(self.host.placeholder_counts(processed)) if self.host.has_images(processed) else 0, 0

    def finish(self, request: RequestState, result: GenerationResult) -> GenerationResult:
        """Records what the program holds (a kept prefix); no per-image serving notes."""
        return PrefixKeeping.finish(self, request, result)

    def check_chunk_outputs(self, chunk: Chunk, outputs: Mapping[str, np.ndarray]) -> None:
        """Nothing to check: the cross-attention kind has no image cursor."""

    def decode_vision_feeds(self, batch: int = 1) -> dict[str, np.ndarray]:
        """None: a decode step sends no vision input (the cross states are retained)."""
        return {}

    def decode_extra(self, processed: Mapping[str, Any]) -> dict[Role, np.ndarray]:
        """The prompt's last cross-attention mask row, which every decode step repeats."""
        length = np.asarray(processed["input_ids"]).reshape(-1).shape[0]
        return {Role.CROSS_MASK: self._cross_mask(processed, length)[:, -1:]}

    def decode_step_feeds(
        self, token_ids: np.ndarray, positions: np.ndarray, extra: Mapping[Role, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """Inputs of a decode-shaped call: tokens, positions and ``extra`` (the mask rows)."""
        return self.io.feeds({Role.TOKEN_IDS: token_ids, Role.POSITIONS: positions, **(extra or {})})

    def supply_states(
        self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], bool]:
        """Cross states among ``feeds`` written into the cache; never in place.

        The call then replaces ``past``'s entries (this kind rewrites cross-state slots on the
        host between calls), so the cache is not written in place.

        With ``batch_index`` they go to that slot of the ``full_batch_size``-slot buffers (the
        engine's slots); a device-resident program gets them as inputs, which only a single-slot
        program can take (the whole buffer is the one slot).

        Raises:
            UserError: More images than the buffers' image slots, or a device-resident program
                with several slots (writing one slot of a resident buffer is not supported).
        """
        feeds = dict(feeds)
        supplied = {name: feeds.pop(name) for name in self.cross_names if name in feeds}
        slot_name = self.io.name(Role.KV_SLOT) if self.io.has(Role.KV_SLOT) else None
        # A device-resident buffer is the one slot unless the program has several.
        slots = self._slots() if slot_name is not None and self.language.specializations else 1
        for name, states in supplied.items():
            place = partial(self._placed, states, None if slot_name is None else feeds.get(slot_name))
            self.backend.supply_state(feeds, past, name, states, place, slots, "cross-attention states")
        return feeds, False

    def _placed(self, states: np.ndarray, slot: np.ndarray | None, held: np.ndarray) -> np.ndarray:
        """The host cache's ``held`` cross states with the request's ``states`` in its ``slot``.

        Without a slot (a single-sequence cache) the request's states replace it.

        Raises:
            UserError: More images than the buffers' image slots.
        """
        if slot is None:
            return states
        if states.shape[2] != held.shape[2]:
            raise UserError(
                f"{states.shape[2] // self._rows_per_image()} images in the request; the "
                f"programs were compiled for at most {held.shape[2] // self._rows_per_image()}"
            )
        held = held.copy()
        held[slot.reshape(-1)] = states
        return held

    def _slots(self) -> int:
        return max(int(s.get(symbols.FULL_BATCH_SIZE, 1)) for s in self.language.specializations)

    def _rows_per_image(self) -> int:
        return next(v for k, v in self.states_per_image.items() if k != symbols.CTX_LEN)
