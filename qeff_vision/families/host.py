"""The host protocol of a family, without torch: what the runtime computes from processor outputs.

Per prompt the host needs, from the processor's numpy outputs: each image's vision-program
inputs, the embedding rows each image becomes (in prompt order), the position ids of the whole
prompt and of every generated token. These are numpy and token math, so they live here and not
in a family's torch-side ``export`` module; the runtime imports nothing from ``export/``.

A family whose protocol differs from the defaults registers a ``Host`` subclass (see
:func:`qeff_vision.families.register`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.segments import find_segments
from qeff_vision.errors import UserError
from qeff_vision.families.layout import PlaceholderRuns

if TYPE_CHECKING:
    from qeff_vision.families.base import Family, ModelDescription


class Host:
    """A family's host protocol for one checkpoint (numpy only).

    A family with the optional patch-bucket capability
    (:class:`~qeff_vision.families.base.PatchBuckets`) gives its host four more methods, which
    the runtime calls only for such families: ``patch_layout(items, bucket)``,
    ``pack_vision_inputs(items, bucket, layout=None)``, ``item_patches(item)`` and
    ``item_rows(item)`` (see the Qwen2.5-VL host).

    Args:
        family: The family.
        model: The checkpoint's config (and processor config).
    """

    #: Processor outputs that carry pixels for the vision program (stills, then clips): a prompt
    #: has images when any is present.
    pixel_inputs: tuple[str, ...] = (symbols.PIXEL_VALUES,)
    #: Processor outputs of modalities the exported programs do not take (name -> modality):
    #: a prompt carrying one is refused with one user error (Gemma 4's audio and video).
    refused_inputs: Mapping[str, str] = {}

    def __init__(self, family: Family, model: ModelDescription):
        self.family = family
        self.model = model

    @property
    def config(self) -> Mapping[str, Any]:
        """The raw config.json dictionary."""
        return self.model.config

    def has_images(self, processed: Mapping[str, Any]) -> bool:
        """Whether the processor outputs carry pixels for the vision program (any of :attr:`pixel_inputs`).

        Raises:
            UserError: The outputs carry a modality of :attr:`refused_inputs`.
        """
        self.refuse_other_modalities(processed)
        return any(name in processed for name in self.pixel_inputs)

    def refuse_other_modalities(self, processed: Mapping[str, Any]) -> None:
        """Raise the one-line user error for an input of :attr:`refused_inputs`."""
        for key, modality in self.refused_inputs.items():
            if key in processed:
                raise UserError(
                    f"{self.family.title} {modality} input is not supported: only images and text export"
                )

    def vision_inputs(self, processed: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Vision-program inputs of each image in prompt order (batch axis of size 1).

        The default suits fixed-resolution towers: one ``pixel_values`` row per image.
        """
        pixels = np.asarray(processed[symbols.PIXEL_VALUES], dtype=np.float32)
        return [{symbols.PIXEL_VALUES: pixels[index : index + 1]} for index in range(pixels.shape[0])]

    def own_rows(self, inputs: Mapping[str, np.ndarray]) -> int | None:
        """How many leading rows of one image's vision output are its own (None: all of them).

        A vision program whose output length is fixed per specialization (LLaVA-NeXT: the most
        rows its tile count can produce) pads each image's rows with zeros; the runtime keeps
        only these. ``inputs`` are the image's :meth:`vision_inputs` entry.
        """
        return None

    def placeholder_ids(self) -> dict[int, str]:
        """Placeholder token id -> modality of every placeholder whose tokens take vision rows.

        Read from the family's declared placeholder ids: the image id, then the video id of a
        family exporting video (a family whose clips reuse the image id keeps ``image``).
        """
        ids: dict[int, str] = {}
        for token, modality in zip(self.family.placeholder_token_ids(self.model), ("image", "video")):
            ids.setdefault(token, modality)
        return ids

    def segments(self, processed: Mapping[str, Any]) -> list:
        """The prompt's multimodal segments (:class:`~qeff_vision.contract.segments.Segment`), in order.

        Each image (or clip) consumes the rows :meth:`placeholder_counts` gives it at its
        placeholder runs; a family listing :class:`~qeff_vision.families.layout.PlaceholderRuns`
        joins an item's runs (``find_segments``, its owner).
        """
        counts = self.placeholder_counts(processed) if self.has_images(processed) else []
        input_ids = np.asarray(processed["input_ids"]).reshape(-1)
        runs = self.family.capability(PlaceholderRuns) is not None
        return find_segments(input_ids, self.placeholder_ids(), counts, multi_run=runs)

    def placeholder_counts(self, processed: Mapping[str, Any]) -> Sequence[int]:
        """Placeholder tokens (= embedding rows) per image, in prompt order."""
        raise NotImplementedError

    def prompt_positions(self, processed: Mapping[str, Any]) -> np.ndarray:
        """Positions of the whole prompt: [1, L] or [R, 1, L] int64, computed once and sliced per chunk."""
        input_ids = np.asarray(processed["input_ids"])
        return np.arange(input_ids.shape[-1], dtype=np.int64).reshape(1, -1)

    def pruning_grids(self, processed: Mapping[str, Any]) -> list[tuple[int, int, int] | None]:
        """Per image or clip in prompt order: a clip's merged (frames, height, width), None for an image.

        Only families declaring ``video_pruning`` have clips to prune (none by default).
        """
        return [None] * len(self.placeholder_counts(processed)) if self.has_images(processed) else []

    def pruned_positions(
        self, processed: Mapping[str, Any], keep: np.ndarray, masks: Sequence[np.ndarray | None]
    ) -> np.ndarray:
        """Positions of the prompt with only the ``keep`` tokens, for a family that prunes clips.

        Args:
            processed: The unpruned prompt.
            keep: bool [L]: the tokens the pruned prompt keeps.
            masks: Per image or clip in prompt order, the rows it keeps (None: all).
        """
        raise NotImplementedError(f"{self.family.title} does not prune video tokens")

    def decode_positions(self, prompt_positions: np.ndarray, step: int) -> np.ndarray:
        """Positions of the ``step``-th generated token fed back (step 0 follows the prompt).

        With rotary rows (``position_id_rows``: row 0 the text position, the others M-RoPE
        t/h/w), row 0 continues the text slots and the rotary rows continue from the prompt's
        largest rotary position (a prompt that ends inside an image has its largest value before
        the last token; ref: transformers v5 Qwen2_5_VLModel.get_rope_index, ``mrope_position_deltas``).
        """
        if self.family.position_id_rows is None:
            return (prompt_positions[..., -1:] + 1 + step).astype(np.int64)
        text = prompt_positions[0, :, -1:] + 1 + step
        rows = prompt_positions.shape[0] - 1
        rope = np.broadcast_to(prompt_positions[1:].max() + 1 + step, (rows, 1, 1))
        return np.concatenate([text[None], rope], axis=0).astype(np.int64)
