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

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.decoder_kinds import CROSS_ATTENTION, TOKEN_MERGE, DecoderKind
from qeff_vision.contract.deployment_programs import KEEP_SIDE
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.planner import ChunkPlan, VisionProtocol, plan_chunks
from qeff_vision.runtime.results import ChunkRecord, GenerationResult
from qeff_vision.runtime.retained_prefix import segments_after, served_notes
from qeff_vision.runtime.session import CompiledProgram
from qeff_vision.spec.table import LANGUAGE_SYMBOLS
from qeff_vision.symbols import NUM_IMAGES, PIXEL_SIDE


def image_specializations(specializations, family: Any = None) -> tuple[dict[str, int], ...]:
    """The image symbols of a single program's encode entries, named as the vision program's.

    ``num_images`` is the vision graph's image count (``family.vision_images_symbol``); keep
    entries (every image symbol 1) and duplicates are dropped. With ``family``, only symbols of
    its vision inputs count (mllama's entries also bind the mask's ``max_num_images`` and the
    K/V's ``cross_states``, both language symbols there). What the image fitter checks a
    resolution against.
    """
    count = family.vision_images_symbol if family is not None else symbols.BATCH_SIZE
    wanted = None
    if family is not None:
        on_inputs = {name for axes in family.vision_input_axes.values() for name in axes.values()}
        wanted = (on_inputs - {count}) | {NUM_IMAGES, PIXEL_SIDE}
    found: list[dict[str, int]] = []
    for entry in specializations:
        images = {
            name: value
            for name, value in entry.items()
            if name not in LANGUAGE_SYMBOLS and (wanted is None or name in wanted)
        }
        if not images or all(value == KEEP_SIDE for name, value in images.items() if name != NUM_IMAGES):
            continue
        vision = {
            (count if name == NUM_IMAGES else name): value
            for name, value in images.items()
            if name != PIXEL_SIDE
        }
        if vision not in found:
            found.append(vision)
    return tuple(found)


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


class SingleGenerator(Generator):
    """A :class:`Generator` over one single-deployment program (batch 1; not for the batched engine).

    Args:
        checkpoint: The checkpoint the program was exported from.
        program: The composed ``lang`` program.
        shape: Its compiled shapes (every bucket's ``vision_size`` is the retained buffer's rows).
        cache: Unused by this program (images are encoded inside it); kept for the signature.
        **kwargs: :class:`Generator`'s keyword arguments.
    """

    #: The batched engine and ``run --requests`` refuse it (one sequence's rows live in the program).
    single_program = True

    def __init__(self, checkpoint: Any, program: Any, shape: Any, cache: Any = None, **kwargs: Any):
        self.encoder = EncoderCount()
        super().__init__(checkpoint, self.encoder, program, shape, cache, **kwargs)
        #: The composed graph's image inputs (the vision graph's), with their axes.
        self.image_inputs = single_image_inputs(program, self.io.input_names)
        #: The retained row buffers (``vision_embeds`` and any stacked rows, Qwen3-VL's deepstack).
        self._row_inputs = self.io.rows(Role.VISION_ROWS)
        self._buffers: dict[str, np.ndarray] | None = None

    def plan(self, input_ids: np.ndarray, processed: Mapping[str, Any], protocol: str) -> ChunkPlan:
        """The chunks after the kept prefix, ``full`` protocol: rows stay in the program.

        ``image_idx`` is the running count of the prefilled part's placeholders, whose images are
        the ones the first chunk encodes (written at the buffer's front).
        """
        start = self._resume.start
        segments = segments_after(self.host.segments({**processed, "input_ids": input_ids}), start)
        return plan_chunks(
            len(input_ids) - start,
            segments,
            self.shape.buckets,
            allow_image_split=self.family.splits_images(self.checkpoint.description),
            protocol=VisionProtocol.FULL,
        )

    def generate(self, processed: Mapping[str, Any], *args: Any, **kwargs: Any) -> GenerationResult:
        """:meth:`Generator.generate` after the prefix the program holds, with the images encoded.

        The program always keeps what it holds (``keep_prefix``, :mod:`~qeff_vision.runtime.kept_prefix`):
        tokens and images of an earlier turn are not prefilled or encoded again, and only the
        rest's images reach the encoder inside the program.
        """
        if kwargs.get("history") is not None:
            raise UserError(
                "deployment single continues a conversation from the prompt it holds; pass no history"
            )
        before = self.encoder.images
        result = super().generate(processed, *args, **{**kwargs, "keep_prefix": True})
        return replace(
            result,
            images_encoded=self.encoder.images - before,
            vision_input=" + ".join(self.image_inputs),  # pixels, not embedding rows
        )

    def _served_notes(self) -> list[str]:
        """Per image: held from an earlier turn, or encoded inside the program (never a cache)."""
        kept = self._resume.images
        return served_notes(kept + len(self._images), kept, "KV")

    def _placeholder(self) -> dict[str, np.ndarray]:
        """The keep specializations' image inputs (see :func:`placeholder_feeds`)."""
        return placeholder_feeds(self.language, self.image_inputs)

    def _rows_feed(self) -> dict[Role, dict[str, np.ndarray]]:
        """The retained buffers on onnxruntime, by name (a device keeps them resident)."""
        if self.language.retains_state:
            return {}
        if self._buffers is None:
            zeros = np.zeros((1, self.shape.decode_vision_size, self.row_width), np.float32)
            self._buffers = self._vision_feeds_of_rows(zeros)
        return {Role.VISION_ROWS: self._buffers}

    def _call(self, by_role: dict, images: Mapping[str, np.ndarray], past: dict) -> dict[str, np.ndarray]:
        return self.step({**self.io.feeds({**by_role, **self._rows_feed()}), **images}, past)

    def decode_step_feeds(self, token_ids, positions, extra=None) -> dict[str, np.ndarray]:
        """A decode call: the retained rows (onnxruntime) and the keep placeholder; no encoder."""
        by_role = {
            Role.TOKEN_IDS: token_ids,
            Role.POSITIONS: positions,
            Role.VISION_CURSOR: np.array([[self.shape.decode_vision_size]], dtype=np.int64),
            **self._rows_feed(),
            **(extra or {}),
        }
        return {**self.io.feeds(by_role), **self._placeholder()}

    def step(self, feeds, past, in_place=False):
        """:meth:`Generator.step`, keeping the retained rows of a decode step too."""
        outputs = super().step(feeds, past, in_place)
        if not self.language.retains_state and self._buffers is not None:
            for row in self._row_inputs:
                if row.name in feeds:
                    self._buffers[row.name] = outputs[self.io.output_of(row)]
        return outputs

    def _encode_later_groups(
        self, groups: list[tuple[int, dict[str, np.ndarray]]], by_role: dict, past: dict[str, np.ndarray]
    ) -> None:
        """Encode calls writing the rows of a prompt's later image groups before its first chunk runs.

        Each is the first chunk's call with one group's images, ``image_idx`` at the group's first
        row (where the composed graph writes them; rows before and after are kept) and every token
        padding (position -1): it writes rows only, no KV slot anyone reads and no recurrent state
        (padding leaves both unchanged), so the first chunk's own call (the first group's images,
        written at row 0, with every later group's rows in place) feeds the chunk once. A device
        keeps the caches resident, so they could not be put back after a call that wrote them
        (a Gated DeltaNet state would advance twice). Images whose output is padded are all
        encoded here, in row order, and the first chunk then runs as a keep call.
        """
        padding = np.full_like(by_role[Role.POSITIONS], -1)
        for first_row, feeds in groups:
            cursor = {Role.VISION_CURSOR: np.array([[first_row]], dtype=np.int64)}
            self._call({**by_role, Role.POSITIONS: padding, **cursor}, feeds, past)

    def _prefill(
        self,
        plan: ChunkPlan,
        input_ids: np.ndarray,
        positions: np.ndarray,
        processed: Mapping[str, Any],
        past: dict[str, np.ndarray],
    ) -> tuple[dict[str, np.ndarray], list[ChunkRecord]]:
        """Every chunk of ``plan`` (after the kept prefix); the first encodes the images after it."""
        start, kept = self._resume.start, self._resume.images
        past.update(self._resume.restore)  # the held caches (the copy at the last prompt's end)
        images, _ = self._prepare_images(processed) if plan.segments else ([], {})
        self._images = images = images[kept:] if plan.segments else []
        # The planner already refused a prompt whose new rows exceed the buffer (every bucket's V).
        per_image = self.host.vision_inputs(processed)[kept:] if images else []
        rows = self.host.placeholder_counts(processed)[kept:] if images else []
        # A vision output padded past each image's rows (Host.own_rows) writes zeros after them:
        # one call per image, in prompt order, so each overwrites the previous one's padding.
        padded = any(self.host.own_rows(inputs) is not None for inputs in per_image)
        groups = image_groups(self.language, self.image_inputs, per_image, rows, padded) if images else []
        pending = groups[0][1] if groups else None
        pixel_bytes = sum(array.nbytes for _, feeds in groups for array in feeds.values())
        records, outputs = [], {}
        for chunk in plan.chunks:
            token_ids = np.zeros((1, chunk.seq_len), dtype=np.int64)
            token_ids[0, : chunk.tokens] = input_ids[start + chunk.start : start + chunk.stop]
            by_role = {
                Role.TOKEN_IDS: token_ids,
                Role.POSITIONS: self._positions(
                    positions, start + chunk.start, start + chunk.stop, chunk.seq_len
                ),
                Role.VISION_CURSOR: np.array([[chunk.image_idx]], dtype=np.int64),
            }
            encoding = pending is not None
            # Padded outputs with several calls: every group before the chunk, in row order, and
            # the chunk itself keeps (the first group's padding would overwrite the next rows).
            chunk_keeps = padded and len(groups) > 1
            ahead = groups if chunk_keeps else groups[1:]
            began = time.perf_counter()
            if encoding and ahead:
                self._encode_later_groups(ahead, by_role, past)
            own = pending if encoding and not chunk_keeps else self._placeholder()
            outputs = self._call(by_role, own, past)
            seconds = time.perf_counter() - began
            self.check_chunk_outputs(chunk, outputs)
            count = len(images) if encoding else 0
            if encoding:
                self.encoder.calls += len(groups)
                self.encoder.images += count
                pending = None
            records.append(
                ChunkRecord(
                    tokens=chunk.tokens,
                    seq_len=chunk.seq_len,
                    vision_size=chunk.vision_size,
                    rows=chunk.rows,
                    vision_bytes=pixel_bytes if count else 0,
                    seconds=seconds,
                    encode_seconds=0.0,
                    images_encoded=count,
                    start=start + chunk.start,
                )
            )
        self.record_prompt_end(past)  # what a later turn resuming at the prompt's end restores
        return outputs, records


def _single_cross_runner() -> type[Generator]:
    from qeff_vision.runtime.single_cross import SingleCrossGenerator  # subclasses this module's helpers

    return SingleCrossGenerator


#: The single-program runner of each decoder kind (a loader of its class), as ``generate.RUNNERS``.
SINGLE_RUNNERS: dict[DecoderKind, Callable[[], type[Generator]]] = {
    TOKEN_MERGE: lambda: SingleGenerator,
    CROSS_ATTENTION: _single_cross_runner,
}


def make_single_generator(
    checkpoint: Any, program: Any, shape: Any, cache: Any = None, **kwargs: Any
) -> Generator:
    """The single-program runner registered for the checkpoint's decoder kind (:data:`SINGLE_RUNNERS`).

    Raises:
        UserError: The decoder kind has no single-program runner.
    """
    kind = checkpoint.family.decoder_kind
    if kind not in SINGLE_RUNNERS:
        raise UserError(
            f"{checkpoint.family.title}: no single-program runtime for decoder kind {kind.name!r}"
        )
    return SINGLE_RUNNERS[kind]()(checkpoint, program, shape, cache, **kwargs)
