"""``deployment: single`` for the cross-attention decoder kind: the encoder writes retained K/V.

The composed program (:mod:`qeff_vision.compile.single_program`) holds the vision tower behind
an If on the pixel input's side. A prompt's first prefill chunk sends every image of the prompt
(``pixel_values`` [1, n, tiles, C, S, S] with its aspect-ratio inputs) and the program writes the
images' cross-attention K/V at the front of the cross layers' retained ``past_key.{i}`` /
``past_value.{i}``; every later chunk and every decode step sends a keep placeholder (side 1)
and reads the retained K/V. Chunks and masks are the cross-attention kind's
(:class:`~qeff_vision.runtime.cross_attention.CrossAttentionGenerator`): an image is one
placeholder token, so no image straddles chunks.

QEfficient's single QPC for mllama takes the pixels in every prefill call (ref:
quic/efficient-transformers ``modeling_auto.py`` ``_QEFFAutoModelForImageTextToTextSingleQPC``,
``models/mllama/modeling_mllama.py`` ``get_dummy_inputs`` with ``kv_offload=False``); ours
encodes each prompt's images once, counted by :class:`~qeff_vision.runtime.single.EncoderCount`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from qeff_vision.errors import UserError
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator
from qeff_vision.runtime.embedding_cache import content_key
from qeff_vision.runtime.planner import Chunk
from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.single import EncoderCount, batched_images, placeholder_feeds, single_image_inputs


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

    #: The batched engine and ``run --requests`` refuse it (one sequence's K/V live in the program).
    single_program = True

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
        super().__init__(checkpoint, self.encoder, program, shape, cache, **kwargs)
        if image_slots is not None:
            self.image_slots = image_slots
        #: The composed graph's image inputs (pixels, aspect-ratio ids and mask), with their axes.
        self.image_inputs = single_image_inputs(program, self.io.input_names)
        #: The cross K/V the program retains between calls (onnxruntime; a device keeps them).
        self._retained: dict[str, np.ndarray] = {}
        #: Content keys of the images whose K/V the retained caches hold, in slot order.
        self._held: tuple[str, ...] = ()
        self._pending: dict[str, np.ndarray] | None = None
        self._pending_images = 0
        self._fresh: list[bool] = []

    def _cross_states(self, processed: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """The retained K/V to feed and the images the first chunk encodes (0 when already held).

        A conversation prefills its whole history each turn: when the retained caches already
        hold exactly this prompt's images (a text-only follow-up), nothing is encoded.
        """
        per_image = self.host.vision_inputs(processed) if self.host.has_images(processed) else []
        slots = self.image_slots if self.image_slots is not None else max(len(per_image), 1)
        if len(per_image) > slots:
            raise UserError(
                f"{len(per_image)} images in the request; the program was compiled for at most {slots}"
            )
        keys = tuple(
            content_key(next(iter(inputs.values())), tuple(int(d) for a in inputs.values() for d in a.shape))
            for inputs in per_image
        )
        fresh = bool(keys) and keys != self._held
        self._pending = batched_images(self.language, self.image_inputs, per_image) if fresh else None
        self._pending_images, self._fresh = len(keys), [fresh] * len(keys)
        if fresh:
            self._held = keys
        return self._retained_feeds(), len(keys) if fresh else 0

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

    def chunk_vision(self, chunk: Chunk, past: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """The first chunk of a prompt with new images sends their pixels (counted); others a placeholder."""
        if chunk.index == 0 and self._pending is not None:
            pixels, self._pending = self._pending, None
            self.encoder.calls += 1
            self.encoder.images += self._pending_images
            return pixels, sum(array.nbytes for array in pixels.values())
        return placeholder_feeds(self.language, self.image_inputs), 0

    def decode_step_feeds(self, token_ids, positions, extra=None) -> dict[str, np.ndarray]:
        """A decode call: tokens, positions, the mask row and the keep placeholder; no encoder."""
        feeds = super().decode_step_feeds(token_ids, positions, extra)
        return {**feeds, **placeholder_feeds(self.language, self.image_inputs)}

    def _run(self, feeds: dict[str, np.ndarray], past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One program call; the returned cross K/V are kept for the next prompt (onnxruntime)."""
        outputs = super()._run(feeds, past)
        self._retained = {name: past[name] for name in self.cross_names if name in past}
        return outputs

    def generate(self, processed: Mapping[str, Any], *args: Any, **kwargs: Any) -> GenerationResult:
        """:meth:`CrossAttentionGenerator.generate`, with the images the program's encoder ran on."""
        result = super().generate(processed, *args, **kwargs)
        served = [
            f"image {number}: "
            + ("encoded inside the single program" if fresh else "K/V retained from the last prompt")
            for number, fresh in enumerate(self._fresh, start=1)
        ]
        # The encoder runs inside the program call: its time is the chunk's prefill time, and
        # what the base measured as encoding is only the host batching the pixels.
        chunks = [replace(chunk, encode_seconds=0.0) for chunk in result.chunks]
        return replace(result, chunks=chunks, served=served, vision_input=" + ".join(self.image_inputs))
