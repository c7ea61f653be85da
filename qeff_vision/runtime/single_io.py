"""The composed single program's image inputs, as the host sends them (no runner state).

What both single-program runners (:mod:`qeff_vision.runtime.single`,
:mod:`qeff_vision.runtime.single_cross`) share: the image inputs and their keep placeholder,
one batch per encode call, the count of encoder runs inside the program, and what both runners
do alike with the conversation the program holds (:class:`EncoderInside`).
See :mod:`qeff_vision.runtime.single` for the protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.deployment_programs import KEEP_SIDE
from qeff_vision.errors import UserError
from qeff_vision.runtime.deployment import DEPLOYMENTS
from qeff_vision.runtime.session import CompiledProgram
from qeff_vision.spec.deployment import SINGLE
from qeff_vision.symbols import NUM_IMAGES

if TYPE_CHECKING:
    from qeff_vision.runtime.request_state import RequestState
    from qeff_vision.runtime.retained_prefix import Resume


def single_image_inputs(program: CompiledProgram, language_inputs: Any) -> dict[str, list]:
    """The composed program's image inputs (the vision graph's), with their axes.

    Raises:
        UserError: The program has none (it is not a single-deployment program).
    """
    names = set(language_inputs)
    found = {name: axes for name, axes in program.input_dims.items() if name not in names}
    if not found:
        raise UserError(f"{program.path}: not a single-deployment program (no image input)")
    return found


def _dtype(program: CompiledProgram, name: str) -> np.dtype:
    return np.dtype(program.input_dtypes.get(name, np.float32))


def placeholder_feeds(program: CompiledProgram, image_inputs: Mapping[str, list]) -> dict[str, np.ndarray]:
    """The keep specializations' image inputs: every symbolic axis 1, fixed axes kept.

    Each in its input's dtype (mllama's ``aspect_ratio_ids`` and ``aspect_ratio_mask`` are int64).
    """
    return {
        name: np.zeros([axis if isinstance(axis, int) else KEEP_SIDE for axis in axes], _dtype(program, name))
        for name, axes in image_inputs.items()
    }


def batched_images(
    program: CompiledProgram, image_inputs: Mapping[str, list], per_image: list[Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Every image of a prompt in one batch per input, joined on its ``num_images`` axis.

    The axis named ``num_images`` in the composed graph (the vision graph's image count: axis 0
    for LLaVA, axis 1 of mllama's [batch, images, tiles, C, S, S]); axis 0 where none is (a
    tiled graph's tile axis).

    Raises:
        UserError: The images' inputs differ in shape besides that axis.
    """
    out = {}
    for name, axes in image_inputs.items():
        axis = list(axes).index(NUM_IMAGES) if NUM_IMAGES in axes else 0
        shapes = {tuple(np.delete(np.array(inputs[name].shape), axis)) for inputs in per_image}
        if len(shapes) > 1:
            raise UserError(
                f"deployment single encodes a prompt's images in one call, so their {name} must share "
                f"a shape (got {', '.join(str(list(shape)) for shape in sorted(shapes))})"
            )
        joined = np.concatenate([inputs[name] for inputs in per_image], axis=axis)
        out[name] = joined.astype(_dtype(program, name))
    return out


def image_groups(
    program: CompiledProgram,
    image_inputs: Mapping[str, list],
    per_image: list[Mapping[str, np.ndarray]],
    rows: list[int],
    alone: bool = False,
) -> list[tuple[int, dict[str, np.ndarray]]]:
    """A prompt's images as encode calls: (first buffer row, batched inputs) per call.

    One call when every image's inputs share their shapes besides the ``num_images`` axis (or
    the tile axis of a tiled graph): :func:`batched_images`. Otherwise (images of different
    sizes where one call takes images of one size: LLaVA-NeXT's tile and feature grids, Pixtral's
    pixel grid) one call per run of consecutive images of one shape, each written from the row
    its first image's rows start at (the composed graph writes at ``image_idx``), so the rows
    stay in prompt order.

    Args:
        program: The composed program (its input dtypes).
        image_inputs: Its image inputs with their axes (:func:`single_image_inputs`).
        per_image: Each image's vision inputs, in prompt order.
        rows: Each image's embedding rows, in prompt order.
        alone: One call per image (a vision output padded past the image's own rows: a batch
            would put the second image's rows after the first one's padding).
    """

    def shape_key(inputs: Mapping[str, np.ndarray]) -> tuple:
        return tuple(
            tuple(np.delete(np.array(inputs[name].shape), list(axes).index(NUM_IMAGES)))
            for name, axes in image_inputs.items()
            if NUM_IMAGES in axes
        )

    groups: list[tuple[int, list]] = []
    first = 0
    for index, inputs in enumerate(per_image):
        if alone or not groups or shape_key(per_image[groups[-1][1][0]]) != shape_key(inputs):
            groups.append((first, []))
        groups[-1][1].append(index)
        first += rows[index]
    return [
        (row, batched_images(program, image_inputs, [per_image[i] for i in members]))
        for row, members in groups
    ]


class EncoderCount:
    """The encoder inside the single program, as a generator sees a vision program: runs counted.

    Attributes:
        calls: Program calls that ran the encoder (encode specializations).
        images: Images those calls encoded.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.images = 0
        self.seconds = 0.0

    def accepts(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """The single program is never called as a vision program."""
        return False


class EncoderInside:
    """What both single-program runners do alike (a mixin before the decoder kind's runner).

    The program holds what it was fed, so every prompt keeps the prefix it holds
    (:mod:`~qeff_vision.runtime.kept_prefix`): tokens and images of an earlier turn are not
    prefilled or encoded again, and only the rest's images reach the encoder inside the program.
    A ``history`` (a cache of the caller's) has no place there.
    """

    #: What a prompt is to this runner: the whole conversation the program holds.
    prompt_kind = "conversation"
    #: Every token prefills (the plan has no decode-shaped tail past the last prefill CCL).
    decode_shaped_tail = False

    def __init__(self, checkpoint: Any, program: Any, shape: Any, cache: Any = None, **kwargs: Any):
        self.encoder = EncoderCount()
        kwargs.setdefault("deployment", DEPLOYMENTS[SINGLE])  # the batched engine refuses it
        super().__init__(checkpoint, self.encoder, program, shape, cache, **kwargs)
        #: The composed graph's image inputs (the vision graph's), with their axes.
        self.image_inputs = single_image_inputs(program, self.io.input_names)
        self.image_inputs.pop(symbols.FIRST_IMAGE_SLOT, None)  # mllama's: fed beside the images
        self.vision_input = " + ".join(self.image_inputs)  # pixels, not embedding rows

    def begin(self, request: RequestState) -> Resume:
        """The decoder kind's :meth:`begin`, after refusing a history."""
        if request.history is not None:
            raise UserError(
                "deployment single continues a conversation from the prompt it holds; pass no history"
            )
        return super().begin(request)

    def _placeholder(self) -> dict[str, np.ndarray]:
        """The keep specializations' image inputs (see :func:`placeholder_feeds`)."""
        return placeholder_feeds(self.language, self.image_inputs)

    def decode_step_feeds(self, token_ids, positions, extra=None) -> dict[str, np.ndarray]:
        """The decoder kind's decode call with the keep placeholder: no encoder runs.

        Vision rows among them (token-merge, onnxruntime) are replaced at the call by the ones
        the slot cache holds (:meth:`~qeff_vision.runtime.single.SingleGenerator.empty_cache`).
        """
        return {**super().decode_step_feeds(token_ids, positions, extra), **self._placeholder()}

    def keeps_prefix(self, request: RequestState) -> bool:
        """Always: the program holds what it was fed."""
        return True
