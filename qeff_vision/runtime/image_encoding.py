"""The vision half of a :class:`~qeff_vision.runtime.generator.Generator`: images in, wide rows out.

A prompt's images are prepared (content keys for the embedding cache), encoded by the vision
program (one call per resolution and accepted batch, or packed into patch buckets by
:mod:`qeff_vision.runtime.packing`), and their rows laid out as one wide row per placeholder:
``vision_embeds`` then each stacked input (Qwen3-VL's deepstack), so the cache and the chunk
slicing treat them as one. A chunk's wide rows are split back into the language program's
vision-row inputs by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.contract.video_pruning import KEPT_ROWS, OPTION, check_rate
from qeff_vision.errors import UserError
from qeff_vision.runtime.embedding_cache import PreparedImage, content_key
from qeff_vision.runtime.packing import packing_encoder
from qeff_vision.runtime.video_pruning import prune_prompt, prune_rows, pruned_key


class ImageEncoding:
    """Methods of :class:`~qeff_vision.runtime.generator.Generator` on the vision side (a mixin).

    They read the generator's ``family``, ``host``, ``vision`` (the program), ``io`` (the language IO table),
    ``dims``, ``shape``, ``stack_depths``, ``row_width``, ``patch_buckets``,
    ``video_pruning_rate`` and ``retention`` (pruned cache key -> retention mask); the generator
    sets them all. How the vision program served each image is recorded in the request's
    ``served`` (:class:`~qeff_vision.runtime.request_state.RequestState`).
    """

    def set_video_pruning_rate(self, rate: object) -> None:
        """Prune clips at ``rate`` from now on (0 turns pruning off).

        Raises:
            UserError: The rate is outside [0, 1), or the family declares no video pruning.
        """
        rate = check_rate(rate)
        support = self.family.features.video_pruning
        if rate and not support.supported:
            raise UserError(f"{OPTION}: {self.family.title} does not prune video tokens ({support.note})")
        self.video_pruning_rate = rate

    def prepare_prompt(self, processed: Mapping[str, Any], request: Any = None) -> Mapping[str, Any]:
        """The prompt as it runs: its clips pruned at ``video_pruning_rate`` (unchanged at 0).

        See :func:`qeff_vision.runtime.video_pruning.prune_prompt`: a pruning rate encodes the
        prompt's clips now, since their kept rows decide the prompt's placeholders and positions.
        ``request`` (a :class:`~qeff_vision.runtime.request_state.RequestState`) records how the
        clips were served and keeps the pruned prompt's prepared images.
        """
        served = request.served if request is not None else {}
        pruned, prepared = prune_prompt(self, processed, served)
        if request is not None:
            request.prepared = prepared
        return pruned

    def _prepare_images(
        self, processed: Mapping[str, Any], prepared: tuple | None = None
    ) -> tuple[list[PreparedImage], dict[str, dict]]:
        """Per image of the prompt: its content key, and its inputs by key.

        ``prepared``: what pruning made for this very prompt ((prompt, images, inputs by key)),
        taken as it is instead of hashing the pixels again.
        """
        if prepared is not None and prepared[0] is processed:
            return list(prepared[1]), dict(prepared[2])
        per_image = self.host.vision_inputs(processed)
        # A pruned prompt's clips are cached as their kept rows, under a key naming the rate.
        pruned = self.host.pruning_grids(processed) if KEPT_ROWS in processed else [None] * len(per_image)
        prepared, inputs_by_key = [], {}
        for inputs, grid in zip(per_image, pruned):
            arrays = list(inputs.values())
            resolution = tuple(int(d) for array in arrays for d in array.shape)
            key = content_key(arrays[0], resolution)
            if grid is not None:
                key = pruned_key(key, self.video_pruning_rate)
            prepared.append(PreparedImage(arrays[0], resolution, key))
            inputs_by_key[key] = inputs
        return prepared, inputs_by_key

    @staticmethod
    def _vision_feeds(batch: Sequence[PreparedImage], inputs_by_key: Mapping[str, dict]) -> dict:
        # Same resolution: every input concatenates along its batch axis (axis 0).
        return {
            name: np.concatenate([inputs_by_key[image.key][name] for image in batch], axis=0)
            for name in inputs_by_key[batch[0].key]
        }

    def _encoder(
        self, inputs_by_key: Mapping[str, dict], timer: list[float], served: dict[str, str] | None = None
    ) -> Callable[[Sequence[PreparedImage]], list[np.ndarray]]:
        """The cache's encoder: one vision call per resolution, split where the program requires.

        ``timer[0]`` accumulates the seconds spent; ``served`` (a request's) records, per image
        key, the call that served it.

        A compiled vision program accepts only its specializations' batch sizes (usually 1), so a
        group of same-resolution misses is cut into the largest batches it accepts.
        """
        served = served if served is not None else {}
        if self.patch_buckets is not None:
            return packing_encoder(self, inputs_by_key, timer, served)

        # Images stack along axis 0 only when some vision input carries the image count there (a
        # batch axis); a program whose inputs only count one image's tiles (InternVL, QEfficient's
        # layout) takes one image per call.
        stackable = any(axes.get(0) == symbols.BATCH_SIZE for axes in self.family.vision_input_axes.values())

        def encode(batch: Sequence[PreparedImage]) -> list[np.ndarray]:
            start = time.perf_counter()
            embeds: list[np.ndarray] = []
            pending = list(batch)
            while pending:
                size = len(pending) if stackable else 1
                while size > 1 and not self.vision.accepts(self._vision_feeds(pending[:size], inputs_by_key)):
                    size -= 1
                output = self.vision.run(self._vision_feeds(pending[:size], inputs_by_key))
                for i, image in enumerate(pending[:size]):
                    # A fixed-length output pads an image's rows with zeros: keep its own.
                    rows = self.wide_rows(output, i, slice(self.host.own_rows(inputs_by_key[image.key])))
                    # A pruned clip evicted since its prompt was built: the same mask again.
                    mask = self.retention.get(image.key)
                    embeds.append(rows if mask is None else prune_rows(rows, mask))
                for image in pending[:size]:
                    grid = "x".join(str(d) for d in image.resolution)
                    served[image.key] = f"resolution-list program (input shapes {grid}), batch of {size}"
                pending = pending[size:]
            timer[0] += time.perf_counter() - start
            return embeds

        return encode

    def wide_rows(self, output: Mapping[str, np.ndarray], item: int, rows: slice = slice(None)) -> np.ndarray:
        """[tokens, row_width]: image ``item``'s vision_embeds ``rows``, then each stacked input's rows.

        The vision program's outputs are named like the language table's vision-row inputs.
        """
        embeds = output[self.io.rows(Role.VISION_ROWS)[0].name][item, rows]
        columns = [embeds]
        for name, depth in self.stack_depths.items():
            stacked = output[name][:, item, rows]  # [depth, tokens, hidden]
            columns.append(np.moveaxis(stacked, 0, 1).reshape(embeds.shape[0], depth * embeds.shape[1]))
        return np.concatenate(columns, axis=-1) if len(columns) > 1 else embeds

    def _vision_feeds_of_rows(self, wide: np.ndarray) -> dict[str, np.ndarray]:
        """Split [1, V, row_width] chunk rows into the table's vision-row inputs, by name.

        The first vision row (``vision_embeds``) takes the first ``hidden`` columns; each stacked
        row then takes ``depth * hidden`` columns.
        """
        hidden = self.dims.hidden_size
        main, *stacked = self.io.rows(Role.VISION_ROWS)
        feeds = {main.name: np.ascontiguousarray(wide[..., :hidden])}
        offset = hidden
        for row in stacked:
            depth = self.stack_depths[row.name]
            block = wide[..., offset : offset + depth * hidden]
            shaped = block.reshape(wide.shape[0], wide.shape[1], depth, hidden).transpose(2, 0, 1, 3)
            feeds[row.name] = np.ascontiguousarray(shaped)
            offset += depth * hidden
        return feeds

    def decode_vision_feeds(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Zero vision rows of a decode call (decode merges no row; onnxruntime needs the input)."""
        rows = np.zeros((batch, self.shape.decode_vision_size, self.row_width), dtype=np.float32)
        return self._vision_feeds_of_rows(rows)

    def served_notes(self, request: Any) -> list[str]:
        """One line per image of ``request``'s prompt: which vision program (mode) served it.

        The images of a kept prefix (the leading ones) were not sent at all: the language program
        holds their KV from an earlier turn.
        """
        kept = request.resume.images
        return [f"image {number}: KV held from an earlier turn" for number in range(1, kept + 1)] + [
            f"image {number}: "
            + request.served.get(image.key, "embedding cache (encoded by an earlier turn)")
            for number, image in enumerate(request.images, start=kept + 1)
        ]
