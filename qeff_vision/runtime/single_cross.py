"""``deployment: single`` for the cross-attention decoder kind: the encoder writes retained K/V.

The composed program (:mod:`qeff_vision.compile.single_program`) holds the vision tower behind
an If on the pixel input's side. A prompt's first prefill chunk sends the images not yet in the
program (``pixel_values`` [1, n, tiles, C, S, S] with its aspect-ratio inputs) and
``first_image_slot``; the program writes their cross-attention K/V into the cross layers'
retained ``past_key.{i}`` / ``past_value.{i}`` from that slot on (the slots before it keep the
images an earlier turn wrote, the slots after are cleared). Every later chunk and every decode
step sends a keep placeholder (side 1) and reads the retained K/V. Chunks and masks are the
cross-attention kind's (:class:`~qeff_vision.runtime.cross_attention.CrossAttentionGenerator`):
an image is one placeholder token, so no image straddles chunks.

A conversation keeps the prefix the program holds
(:mod:`qeff_vision.runtime.retained_prefix`): a later turn prefills only its new tokens, and the
tokens after an image still attend to it through the mask's column of its slot (mllama's mask
spans from an image's token to the next image's; a kept token's mask row names only images
before it, so it is the same row in the longer conversation).

QEfficient's single QPC for mllama takes the pixels in every prefill call (ref:
quic/efficient-transformers ``modeling_auto.py`` ``_QEFFAutoModelForImageTextToTextSingleQPC``,
``models/mllama/modeling_mllama.py`` ``get_dummy_inputs`` with ``kv_offload=False``); ours
encodes each image of a conversation once, counted by
:class:`~qeff_vision.runtime.single.EncoderCount`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.runtime.continuation import Continuation
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator, CrossPrefill
from qeff_vision.runtime.deployment import DEPLOYMENTS
from qeff_vision.runtime.planner import Chunk, VisionProtocol, plan_chunks
from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import (
    Resume,
    held_after,
    image_set_resume,
    kept_note,
    resume_point,
    served_notes,
)
from qeff_vision.runtime.single_io import EncoderCount, batched_images, placeholder_feeds, single_image_inputs
from qeff_vision.spec.deployment import SINGLE

SLOT = symbols.FIRST_IMAGE_SLOT


class SingleCrossGenerator(CrossAttentionGenerator):
    """A cross-attention runner over one single-deployment program (batch 1; not for the engine).

    Args:
        checkpoint: The checkpoint the program was exported from.
        program: The composed ``lang`` program.
        shape: Its compiled shapes.
        cache: Unused (images are encoded inside the program); kept for the signature.
        image_slots: The program's image slots (``max_num_images``); None reads them from its
            specializations, as :class:`CrossAttentionGenerator` does.
        **kwargs: :class:`CrossAttentionGenerator`'s keyword arguments.
    """

    def __init__(
        self,
        checkpoint: Any,
        program: Any,
        shape: Any,
        cache: Any = None,
        image_slots: int | None = None,
        **kwargs: Any,
    ):
        self.encoder = EncoderCount()
        kwargs.setdefault("deployment", DEPLOYMENTS[SINGLE])  # the batched engine refuses it
        super().__init__(checkpoint, self.encoder, program, shape, cache, **kwargs)
        if image_slots is not None:
            self.image_slots = image_slots
        #: The composed graph's image inputs (pixels, aspect-ratio ids and mask), with their axes.
        self.image_inputs = single_image_inputs(program, self.io.input_names)
        self.image_inputs.pop(SLOT, None)  # fed beside the images, not batched per image
        #: The cross K/V the program retains between calls (onnxruntime; a device keeps them).
        self._retained: dict[str, np.ndarray] = {}

    def generate(self, processed: Mapping[str, Any], *args: Any, **kwargs: Any) -> GenerationResult:
        """:meth:`CrossAttentionGenerator.generate` after the prefix the program holds.

        Tokens and images an earlier turn left in the program are kept
        (:func:`~qeff_vision.runtime.retained_prefix.resume_point`); only the rest is prefilled
        and only the images after the kept ones are encoded, into the next slots.
        """
        if kwargs.get("history") is not None:
            raise UserError(
                "deployment single continues a conversation from the prompt it holds; pass no history"
            )
        kwargs.pop("keep_prefix", None)  # the program always keeps what it holds
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(-1)
        _, keys, spans = self.keys_and_spans(processed)
        resume = resume_point(self.held, input_ids, spans, keys, self._unpositioned)
        self._resume = image_set_resume(resume, self.held, keys)
        self.held = None  # a failed generation leaves the program holding nothing known
        try:
            result = super().generate(processed, *args, **kwargs)
        finally:
            resume, self._resume = self._resume, Resume()
        self.held = held_after(input_ids, result.tokens, keys, result.continuation.past, None)
        served = served_notes(len(keys), resume.images, "K/V")
        # The encoder runs inside the program call: its time is the chunk's prefill time, and
        # what the base measured as encoding is only the host batching the pixels.
        chunks = [replace(chunk, encode_seconds=0.0) for chunk in result.chunks]
        notes = [kept_note(resume.start, len(input_ids))] if resume.start else []
        if not resume.start and resume.images:
            notes.append(
                f"the prompt's text prefilled again (a new image changes what its image-less tokens "
                f"attend to); {resume.images} image(s) kept in their slots, not encoded again"
            )
        return replace(
            result,
            chunks=chunks,
            served=served,
            notes=[*result.notes, *notes],
            vision_input=" + ".join(self.image_inputs),
        )

    def prefill(
        self,
        processed: Mapping[str, Any],
        max_new_tokens: int = 32,
        protocol: str = VisionProtocol.CHUNK.value,
        history: Continuation | None = None,
    ) -> CrossPrefill:
        """The prompt's chunks after the kept prefix; the first sends the images after the kept ones."""
        if history is not None:
            raise UserError(
                "deployment single continues a conversation from the prompt it holds; pass no history"
            )
        started = time.perf_counter()
        input_ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(-1)
        length = len(input_ids)
        self.check_fits(length, max_new_tokens)
        start, kept = self._resume.start, self._resume.images
        per_image, _, _ = self.keys_and_spans(processed)
        slots = self.image_slots if self.image_slots is not None else max(len(per_image), 1)
        if len(per_image) > slots:
            raise UserError(
                f"{len(per_image)} images in the conversation; the program was compiled for at most {slots}"
            )
        new = per_image[kept:]
        # What the first chunk sends: the new images' inputs, how many, and the slot they start at.
        pending = (batched_images(self.language, self.image_inputs, new), len(new), kept) if new else None
        positions = self.host.prompt_positions(processed)
        mask = self._cross_mask(processed, length)
        past = {**self.empty_cache(), **self._retained_feeds(), **self._resume.restore}
        rest = (mask[:, start:], input_ids[start:], positions[..., start:])
        chunks = plan_chunks(length - start, [], self.shape.buckets, protocol=protocol).chunks
        # The encoder runs inside the first chunk's program call: no separate encode time.
        outputs, records = self.run_chunks(chunks, rest, past, len(new), start=start, new_images=pending)
        return CrossPrefill(
            length=length,
            logits=outputs[self.logits_name][0, -1].copy(),
            positions=positions,
            last_mask_row=mask[:, -1:],
            past=past,
            records=records,
            protocol=VisionProtocol(protocol).value,
            images_encoded=len(new),
            encoder_calls=1 if new else 0,
            started=started,
        )

    def _retained_feeds(self) -> dict[str, np.ndarray]:
        """The cross K/V last returned (zeros before the first call); none on a device."""
        if self.language.retains_state:
            return {}
        if not self._retained:
            cache = self.empty_cache()
            self._retained = {name: cache[name] for name in self.cross_names if name in cache}
        return dict(self._retained)

    def empty_cache(self, slots: int = 1) -> dict[str, np.ndarray]:
        """:meth:`CrossAttentionGenerator.empty_cache`, without the cross K/V on a device (resident)."""
        past = super().empty_cache(slots)
        if self.language.retains_state:
            for name in self.cross_names:
                past.pop(name, None)
        return past

    def chunk_vision(
        self, chunk: Chunk, past: Mapping[str, np.ndarray], new_images: Any = None
    ) -> tuple[dict[str, np.ndarray], int]:
        """The first chunk of a prompt with new images sends their pixels (counted); others a placeholder.

        ``new_images``: (batched inputs, image count, first slot) of the prompt's new images, or None.
        """
        if chunk.index == 0 and new_images is not None:
            pixels, count, first_slot = new_images
            self.encoder.calls += 1
            self.encoder.images += count
            slot = np.array([first_slot], np.int64)
            return {**pixels, SLOT: slot}, sum(array.nbytes for array in pixels.values())
        return self._placeholder(), 0

    def _placeholder(self) -> dict[str, np.ndarray]:
        """The keep specializations' image inputs (the slot unread there: 0)."""
        return {
            **placeholder_feeds(self.language, self.image_inputs),
            SLOT: np.zeros(1, np.int64),
        }

    def decode_step_feeds(self, token_ids, positions, extra=None) -> dict[str, np.ndarray]:
        """A decode call: tokens, positions, the mask row and the keep placeholder; no encoder."""
        feeds = super().decode_step_feeds(token_ids, positions, extra)
        return {**feeds, **self._placeholder()}

    def _run(self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One program call; the returned cross K/V are kept for the next prompt (onnxruntime)."""
        outputs = super()._run(feeds, past)
        self._retained = {name: past[name] for name in self.cross_names if name in past}
        return outputs
