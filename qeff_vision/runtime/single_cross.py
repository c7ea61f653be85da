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

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator
from qeff_vision.runtime.kept_prefix import PrefixKeeping
from qeff_vision.runtime.request_state import ChunkCall, RequestState
from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import HeldPrefix, Resume, image_set_resume, served_notes
from qeff_vision.runtime.single_io import (
    EncoderInside,
    batched_images,
)

SLOT = symbols.FIRST_IMAGE_SLOT


class SingleCrossGenerator(EncoderInside, CrossAttentionGenerator):
    """A cross-attention runner over one single-deployment program (one sequence: slot 0 of its engine).

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
        super().__init__(checkpoint, program, shape, cache, **kwargs)
        if image_slots is not None:
            self.image_slots = image_slots

    def kept_resume(self, resume: Resume, held: HeldPrefix | None, keys) -> Resume:
        """A prefix kept only while the prompt's images are the held ones; the leading held images stay.

        Only the images after the kept ones are encoded, into the next slots (a changed image set
        still keeps the leading held images in their slots: the held cross K/V are restored, on
        onnxruntime; a device keeps them resident).
        """
        resume = image_set_resume(resume, held, keys)
        if resume.images and not resume.start:
            return replace(
                resume, restore={name: held.past[name] for name in self.cross_names if name in held.past}
            )
        return resume

    def request_chunks(self, request: RequestState) -> Iterator[ChunkCall]:
        """The prompt's chunks after the kept prefix; the first sends the images after the kept ones.

        The encoder runs inside the first chunk's program call (no separate encode time): it
        takes the new images' pixels and ``first_image_slot``, the slot after the kept images.
        """
        kept = request.resume.images
        per_image, _, _ = self.keys_and_spans(request.processed)
        new = per_image[kept:]
        mask = self.request_mask(request)
        input_ids, positions = request.input_ids[request.start :], request.positions[..., request.start :]
        for chunk in request.plan.chunks:
            feeds = self.chunk_feeds(chunk, mask, input_ids, positions)
            if chunk.index or not new:
                yield ChunkCall(chunk, {**feeds, **self._placeholder()}, 0, images_encoded=0)
                continue
            pixels = batched_images(self.language, self.image_inputs, new)
            self.encoder.calls += 1
            self.encoder.images += len(new)
            sent = sum(array.nbytes for array in pixels.values())
            yield ChunkCall(
                chunk, {**feeds, **pixels, SLOT: np.array([kept], np.int64)}, sent, images_encoded=len(new)
            )

    def finish(self, request: RequestState, result: GenerationResult) -> GenerationResult:
        """Records what the program holds; per image, held or encoded, and why text was prefilled again."""
        result = PrefixKeeping.finish(self, request, result)
        resume = request.resume
        result.served = served_notes(len(request.keys), resume.images, "K/V")
        if not resume.start and resume.images:
            result.notes.append(
                f"the prompt's text prefilled again (a new image changes what its image-less tokens "
                f"attend to); {resume.images} image(s) kept in their slots, not encoded again"
            )
        return result

    def _placeholder(self) -> dict[str, np.ndarray]:
        """The keep specializations' image inputs (the slot unread there: 0)."""
        return {**super()._placeholder(), SLOT: np.zeros(1, np.int64)}
