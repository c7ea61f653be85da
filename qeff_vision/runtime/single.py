"""``deployment: single`` on the host: one ``lang`` program that encodes each image once.

The program (:mod:`qeff_vision.compile.single_program`) holds the vision tower behind an If whose
condition is the pixel input's side: the first prefill chunk of a prompt with images sends every
image of the prompt (``pixel_values`` [n, C, H, W]) and the program writes their rows at the front
of its retained ``vision_embeds`` buffer; every later chunk and every decode step sends a
[1, C, 1, 1] placeholder (the compiled keep specializations), and placeholders read rows by
``image_idx``, the running count (the planner's ``full`` protocol: ``image_idx = P[a]``). On
onnxruntime the buffer travels as ``vision_embeds`` / ``vision_embeds_RetainedState`` like a KV
cache; a device keeps it resident.

A conversation keeps what the program holds (:mod:`qeff_vision.runtime.retained_prefix`): a turn
prefills only the tokens after the prefix the program already fed, and its first chunk encodes
only the images among them (their rows at the buffer's front, ``image_idx`` counting only them),
so each image of a conversation is encoded once.

QEfficient's single QPC encodes in every prefill call (ref: quic/efficient-transformers
``_QEFFAutoModelForImageTextToTextSingleQPC``); :class:`EncoderCount` counts ours per call and
per image, and ``run`` prints the count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qeff_vision.contract.language_io import Role
from qeff_vision.runtime.generator import Generator
from qeff_vision.runtime.planner import ChunkPlan, VisionProtocol
from qeff_vision.runtime.request_state import ChunkCall, RequestState
from qeff_vision.runtime.retained_prefix import served_notes
from qeff_vision.runtime.single_io import (  # noqa: F401 - batched_images re-exported
    EncoderInside,
    batched_images,
    image_groups,
    placeholder_feeds,
)


class SingleGenerator(EncoderInside, Generator):
    """A :class:`Generator` over one single-deployment program (one sequence: slot 0 of its engine).

    Args:
        checkpoint: The checkpoint the program was exported from.
        program: The composed ``lang`` program.
        shape: Its compiled shapes (every bucket's ``vision_size`` is the retained buffer's rows).
        cache: Unused by this program (images are encoded inside it); kept for the signature.
        **kwargs: :class:`Generator`'s keyword arguments.
    """

    def empty_cache(self, slots: int = 1) -> dict[str, np.ndarray]:
        """:meth:`Generator.empty_cache` plus the retained row buffers (onnxruntime; a device keeps them).

        ``vision_embeds`` (and any stacked rows, Qwen3-VL's deepstack) is retained state like a KV
        cache: a call's feeds take it from the cache and the call returns it there, so a kept
        prefix holds its images' rows with its KV.
        """
        zeros = (1, self.shape.decode_vision_size, self.row_width)
        rows = self.backend.host_state(lambda: self._vision_feeds_of_rows(np.zeros(zeros, np.float32)))
        return {**super().empty_cache(slots), **rows}

    def plan(
        self,
        input_ids: np.ndarray,
        processed: Mapping[str, Any],
        protocol: str,
        start: int = 0,
        positions: np.ndarray | None = None,
    ) -> ChunkPlan:
        """The chunks after the kept prefix, ``full`` protocol: rows stay in the program.

        ``image_idx`` is the running count of the prefilled part's placeholders, whose images are
        the ones the first chunk encodes (written at the buffer's front). Every token prefills
        (:attr:`decode_shaped_tail` off): a prompt past the last prefill CCL is refused by ``check_fits``.
        """
        return super().plan(input_ids, processed, VisionProtocol.FULL, start, positions)

    def served_notes(self, request: RequestState) -> list[str]:
        """Per image: held from an earlier turn, or encoded inside the program (never a cache)."""
        kept = request.resume.images
        return served_notes(kept + len(request.images), kept, "KV")

    def _call_feeds(self, by_role: dict, images: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**self.io.feeds(by_role), **images}

    def request_chunks(self, request: RequestState) -> Iterator[ChunkCall]:
        """Every chunk of the plan (after the kept prefix); the first encodes the images after it.

        Before the first chunk, calls writing the rows of the prompt's later image groups: each
        is the first chunk's call with one group's images, ``image_idx`` at the group's first row
        (where the composed graph writes them; rows before and after are kept) and every token
        padding (position -1). It writes rows only, no KV slot anyone reads and no recurrent
        state (padding leaves both unchanged), so the first chunk's own call (the first group's
        images, written at row 0, with every later group's rows in place) feeds the chunk once.
        A device keeps the caches resident, so they could not be put back after a call that
        wrote them (a Gated DeltaNet state would advance twice). Images whose output is padded are
        all encoded there, in row order, and the first chunk then runs as a keep call.
        """
        kept, processed, plan = request.resume.images, request.processed, request.plan
        input_ids, positions = request.input_ids[request.start :], request.positions[..., request.start :]
        images, _ = self._prepare_images(processed, request.prepared) if plan.segments else ([], {})
        request.images = images = images[kept:] if plan.segments else []
        # The planner already refused a prompt whose new rows exceed the buffer (every bucket's V).
        per_image = self.host.vision_inputs(processed)[kept:] if images else []
        rows = self.host.placeholder_counts(processed)[kept:] if images else []
        # A vision output padded past each image's rows (Host.own_rows) writes zeros after them:
        # one call per image, in prompt order, so each overwrites the previous one's padding.
        padded = any(self.host.own_rows(inputs) is not None for inputs in per_image)
        groups = image_groups(self.language, self.image_inputs, per_image, rows, padded) if images else []
        pending = groups[0][1] if groups else None
        pixel_bytes = sum(array.nbytes for _, feeds in groups for array in feeds.values())
        for chunk in plan.chunks:
            by_role = {
                **self._chunk_tokens(chunk, input_ids, positions),
                Role.VISION_CURSOR: np.array([[chunk.image_idx]], dtype=np.int64),
            }
            if pending is None:
                yield ChunkCall(chunk, self._call_feeds(by_role, self._placeholder()), 0, images_encoded=0)
                continue
            # Padded outputs with several calls: every group before the chunk, in row order, and
            # the chunk itself keeps (the first group's padding would overwrite the next rows).
            chunk_keeps = padded and len(groups) > 1
            padding = np.full_like(by_role[Role.POSITIONS], -1)
            before = [
                self._call_feeds(
                    {
                        **by_role,
                        Role.POSITIONS: padding,
                        Role.VISION_CURSOR: np.array([[row]], dtype=np.int64),
                    },
                    feeds,
                )
                for row, feeds in (groups if chunk_keeps else groups[1:])
            ]
            own = self._placeholder() if chunk_keeps else pending
            self.encoder.calls += len(groups)
            self.encoder.images += len(images)
            pending = None
            yield ChunkCall(chunk, self._call_feeds(by_role, own), pixel_bytes, before, len(images))
