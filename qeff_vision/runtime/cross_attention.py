"""Host side of the cross-attention decoder kind (``Family.decoder_kind == "cross-attention"``).

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
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.runtime.continuation import Continuation, continued_positions
from qeff_vision.runtime.embedding_cache import content_key
from qeff_vision.runtime.generate import ChunkRecord, GenerationResult, Generator
from qeff_vision.runtime.planner import VisionProtocol, plan_chunks

CROSS_ATTENTION_MASK = symbols.CROSS_ATTENTION_MASK


class CrossAttentionGenerator(Generator):
    """:class:`Generator` for cross-attention families (same constructor, same results).

    ``cross_mask_shape`` is the language program's ``cross_attention_mask`` shape (its last axis,
    tiles per image, is static); read from the program's inputs when not given.
    """

    def __init__(self, *args, cross_mask_shape=(), **kwargs):
        super().__init__(*args, **kwargs)
        cross_mask_shape = cross_mask_shape or self.language.input_dims.get(self.io.name(Role.CROSS_MASK), ())
        description = self.checkpoint.description
        self.cross_names = list(self.family.vision_outputs(description))
        self.cross_mask_width = int(cross_mask_shape[-1]) if cross_mask_shape else 0
        self.states_per_image = self.family.kv_cache_lengths(description, self.shape.ctx_len)
        #: States computed by the vision program, per image content key (one request's images).
        self.encoded: dict[str, dict[str, np.ndarray]] = {}
        # A compiled language program has a fixed image-slot count: fewer images are padded with
        # zero states that the mask never selects. None (a bare export): exactly the request's.
        slots = {s.get(symbols.MAX_NUM_IMAGES) for s in self.language.specializations or ()} - {None}
        self.image_slots = slots.pop() if len(slots) == 1 else None

    def _empty_cache(self, slots: int = 1) -> dict[str, np.ndarray]:
        """Zeroed self-attention KV; cross layers are filled per request by :meth:`_cross_states`."""
        past = super()._empty_cache(slots)
        for name in self.cross_names:
            past.pop(name, None)
        return past

    def _cross_states(self, processed: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Every cross layer's K/V for the request's images (each encoded once) and images encoded."""
        per_image = self.host.vision_inputs(processed) if self.host.has_images(processed) else []
        states, encoded = [], 0
        for inputs in per_image:
            arrays = list(inputs.values())
            key = content_key(arrays[0], tuple(int(d) for a in arrays for d in a.shape))
            if key not in self.encoded:
                self.encoded[key] = self.vision.run(inputs)
                encoded += 1
            states.append(self.encoded[key])
        slots = self.image_slots if self.image_slots is not None else max(len(states), 1)
        if len(states) > slots:
            raise UserError(
                f"{len(states)} images in the request; the programs were compiled for at most {slots}"
            )
        states += [self._zero_states()] * (slots - len(states))
        return {name: np.concatenate([s[name] for s in states], axis=2) for name in self.cross_names}, encoded

    def _zero_states(self) -> dict[str, np.ndarray]:
        dims = self.dims
        symbol = next(s for s in self.states_per_image if s != symbols.CTX_LEN)
        shape = (1, dims.num_kv_heads, self.states_per_image[symbol], dims.head_dim)
        return {name: np.zeros(shape, np.float32) for name in self.cross_names}

    def _cross_mask(self, processed: Mapping[str, Any], length: int) -> np.ndarray:
        """The processor's mask, padded on the image axis to the image slots with -1 (slot unused)."""
        if CROSS_ATTENTION_MASK in processed:
            mask = np.asarray(processed[CROSS_ATTENTION_MASK], dtype=np.int64)
        else:
            mask = np.zeros((1, length, 0, self.cross_mask_width), np.int64)
        slots = self.image_slots if self.image_slots is not None else max(mask.shape[2], 1)
        return np.pad(mask, ((0, 0), (0, 0), (0, slots - mask.shape[2]), (0, 0)), constant_values=-1)

    def generate(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int = 32,
        protocol: str = VisionProtocol.CHUNK.value,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        history: Continuation | None = None,
    ) -> GenerationResult:
        """Greedy generation for one processed prompt (batch 1); see :meth:`Generator.generate`.

        A continued turn (``history``) keeps the first turn's cross states and extends its mask
        with the last row, as transformers' ``prepare_inputs_for_generation`` pads a shorter
        ``cross_attention_mask`` for mllama; it cannot add images.
        """
        started = time.perf_counter()
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(-1)
        length = len(input_ids)
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if history is not None and self.host.has_images(processed):
            raise UserError("a continued turn of a cross-attention model cannot add images")
        positions = self.host.prompt_positions(processed)
        used = 0
        if history is not None:
            past = history.past
            first = self._feed_history(history, past)
            positions = continued_positions(positions, first)
            used = int(np.asarray(first).reshape(-1)[0])  # KV slots the history fills
        if used + length + max_new_tokens > self.shape.ctx_len:
            raise UserError(
                f"prompt of {length} tokens + {max_new_tokens} new tokens exceeds the compiled "
                f"ctx_len {self.shape.ctx_len}"
            )
        plan = plan_chunks(length, [], self.shape.buckets, protocol=protocol)
        calls_before = self.vision.calls
        encode_start = time.perf_counter()
        if history is None:
            cross, images_encoded = self._cross_states(processed)
            mask = self._cross_mask(processed, length)
            past = {**self._empty_cache(), **cross}
        else:
            images_encoded = 0
            mask = np.repeat(history.decode_feeds[Role.CROSS_MASK], length, axis=1)
        encode_seconds = time.perf_counter() - encode_start
        records, outputs = [], {}
        for chunk in plan.chunks:
            chunk_start = time.perf_counter()
            token_ids = np.zeros((1, chunk.seq_len), dtype=np.int64)
            token_ids[0, : chunk.tokens] = input_ids[chunk.start : chunk.stop]
            chunk_mask = np.zeros((1, chunk.seq_len, *mask.shape[2:]), np.int64)
            chunk_mask[:, : chunk.tokens] = mask[:, chunk.start : chunk.stop]
            feeds = self.io.feeds(
                {
                    Role.TOKEN_IDS: token_ids,
                    Role.POSITIONS: self._positions(positions, chunk.start, chunk.stop, chunk.seq_len),
                    Role.CROSS_MASK: chunk_mask,
                }
            )
            outputs = self._run(feeds, past)
            records.append(
                ChunkRecord(
                    tokens=chunk.tokens,
                    seq_len=chunk.seq_len,
                    vision_size=0,
                    rows=0,
                    vision_bytes=sum(past[n].nbytes for n in self.cross_names) if chunk.index == 0 else 0,
                    seconds=time.perf_counter() - chunk_start,
                    encode_seconds=encode_seconds if chunk.index == 0 else 0.0,
                    images_encoded=images_encoded if chunk.index == 0 else 0,
                    start=chunk.start,
                )
            )
        kept = [outputs[self.logits_name][0, -1].copy()] if keep_logits else None
        token = int(outputs[self.logits_name][0, -1].argmax())
        ttft = time.perf_counter() - started
        if on_token:
            on_token(token)
        decode_start, tokens = time.perf_counter(), [token]
        last_row = mask[:, -1:]
        for step in range(max_new_tokens - 1):
            if token in self.eos_token_ids:
                break
            position = self.host.decode_positions(positions, step)
            outputs = self._feed_token(token, position, past, {Role.CROSS_MASK: last_row})
            if kept is not None:
                kept.append(outputs[self.logits_name][0, -1].copy())
            token = int(outputs[self.logits_name][0, -1].argmax())
            tokens.append(token)
            if on_token:
                on_token(token)
        return GenerationResult(
            prompt_tokens=length,
            tokens=tokens,
            chunks=records,
            ttft=ttft,
            decode_seconds=time.perf_counter() - decode_start,
            encoder_calls=self.vision.calls - calls_before,
            cache_hits=0,
            logits=kept or [],
            protocol=plan.protocol.value,
            images=len(self.host.placeholder_counts(processed)) if self.host.has_images(processed) else 0,
            image_rows=0,
            images_encoded=images_encoded,
            continuation=Continuation(
                past, positions, len(tokens) - 1, (tokens[-1],), {Role.CROSS_MASK: last_row}
            ),
        )

    def _feed_token(self, token, position, past, extra=None) -> dict[str, np.ndarray]:
        """One decode step: ``token`` at ``position`` with ``extra`` (the cross-attention mask row)."""
        by_role = {Role.TOKEN_IDS: np.array([[token]], dtype=np.int64), Role.POSITIONS: position}
        return self._run(self.io.feeds({**by_role, **(extra or {})}), past)

    def _run(self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One language call. A device keeps retained inputs resident: send the cross states once."""
        outputs = self.language.run({**feeds, **past})
        retained = self.io.retained_outputs()
        for name in list(past):
            if self.language.retains_state and name in self.cross_names:
                del past[name]  # resident on the device from now on
            else:
                past[name] = outputs[retained[name]]
        return outputs
