"""Molmo2: overlapping high-res crops plus a low-res view, a ViT, a pooling adapter, a Qwen3-style decoder.

Token math follows transformers v5.23 (ref: models/molmo2/image_processing_molmo2.py,
``select_tiling`` / ``compute_crop_geometry`` / ``get_image_grid_and_crops``, and
processing_molmo2.py ``replace_image_token``). The processor resizes the image onto a canvas of
``tiling_h x tiling_w`` windows (crops of ``size`` px overlapping by ``overlap_margins`` patches),
cuts it into those crops and adds a low-res view (the whole image at crop size) in front: an image
is ``tiling_h * tiling_w + 1`` crops of ``(size / patch)^2`` patches. The adapter pools every
``pooling_size`` window of the low-res patch grid and of the canvas's patch grid (overlaps
removed) into one token, so an image is ``low_h * low_w + high_h * high_w`` placeholders
(``<im_patch>``), written row by row with ``<im_col>`` after each row, each view between a start
token and ``<im_end>``.

The vision program takes one image: ``pixel_values`` [crops, patches, 3 * patch^2] (the processor's
patchified crops; QEfficient's tile-axis name ``batched_num_patches``) and ``image_token_pooling``
[vision_size, pool_h * pool_w] (the patches each token pools, -1 for padding); it returns
``vision_embeds`` [1, vision_size, hidden].

A video clip goes through the same program (ref: video_processing_molmo2.py): each frame is
resized whole to the video processor's size and pooled ``pooling_size`` (3x3 on the published
checkpoints), so the pooling window is a symbol (``pooling_window``); a clip's span is its frames
(``<frame_start>`` rows ``<frame_end>``) with each next frame's timestamp text between them.

Molmo2 *adds* an image's features to the ``<im_patch>`` embeddings (``Molmo2Model.forward``); the
vision program adds that embedding row, so the IO contract's row replacement gives the same sum.
Every image and frame token (patches, columns, starts and ends; ``mm_token_type_ids``) attends to
every other one in the prompt both ways (``block_sequence_ids``, one block): an image is kept in
one chunk (``chunk_split``), and the decoder links all the chunk's image tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    NO_DEEPSTACK,
    NO_VIDEO_PRUNING,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    Family,
    Features,
    ImageMarkers,
    ImageSize,
    JoinedImages,
    ModelDescription,
    SingleProgramGate,
    bidirectional,
    single_program_not_built,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.molmo2.tiny import write_tiny_checkpoint  # torch-free until called

#: Crops of one image (QEfficient's tile-axis name, as InternVL's vision program).
BATCHED_NUM_PATCHES = "batched_num_patches"
#: The adapter's pooled-token index input (the processor's name).
IMAGE_TOKEN_POOLING = "image_token_pooling"
#: Patches one token pools: 2x2 for images, 3x3 for video frames on the published processors.
POOLING_WINDOW = "pooling_window"
#: Tokens between two frames of a clip (the " 0.5 " timestamp), at most: one per character of an
#: ASCII timestamp up to " 9999.5 " (the processor's ``{t:.1f}``; a byte-level BPE never makes more).
TIMESTAMP_TOKENS = 8

# ref: transformers v5.23 Molmo2ImageProcessor class defaults and Molmo2VisionConfig defaults.
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "size": 378,
    "max_crops": 8,
    "overlap_margins": [4, 4],
    "pooling_size": [2, 2],
}
VISION_DEFAULTS: dict[str, Any] = {"patch_size": 14, "image_size": [378, 378]}
# ref: transformers v5.23 Molmo2VideoProcessor class defaults.
VIDEO_DEFAULTS: dict[str, Any] = {"size": 378, "pooling_size": [3, 3]}
VIDEO_SOURCE = "transformers' Molmo2VideoProcessor default"
PROCESSOR_SOURCE = "transformers' Molmo2ImageProcessor default"
VISION_SOURCE = "transformers' Molmo2VisionConfig default"
#: The image/frame token ids of the config (``mm_token_type_ids`` 1, one bidirectional block).
IMAGE_TOKEN_KEYS = (
    "image_patch_id",
    "image_start_token_id",
    "low_res_image_start_token_id",
    "image_end_token_id",
    "image_col_id",
    "image_low_res_id",
    "frame_start_token_id",
    "frame_end_token_id",
)


@dataclass(frozen=True)
class Molmo2Vision:
    """The crop geometry of a Molmo2 checkpoint, read once.

    Attributes:
        crop_size: Side of a crop and of the low-res view in pixels (the processor's ``size``).
        patch_size: Pixels per patch side.
        max_crops: Most high-res crops.
        margins: Overlap margins (left, right) in patches.
        pooling: Pooled window (rows, columns) in patches.
        image_token_ids: Every image/frame token id the config names (one attention block).
        frame_size: Side a video frame is resized to (the video processor's ``size``).
        frame_pooling: Pooled window of a frame (rows, columns) in patches.
    """

    crop_size: int
    patch_size: int
    max_crops: int
    margins: tuple[int, int]
    pooling: tuple[int, int]
    image_token_ids: tuple[int, ...]
    frame_size: int
    frame_pooling: tuple[int, int]

    @property
    def crop_patches(self) -> int:
        """Patches per crop side."""
        return self.crop_size // self.patch_size

    @property
    def window_size(self) -> int:
        """Pixels of a crop not shared with its neighbours."""
        return (self.crop_patches - sum(self.margins)) * self.patch_size


def _square(value: Any) -> int:
    """A side from an int, a [h, w] pair or a {height, width} mapping (square only)."""
    if isinstance(value, dict):
        value = [value.get("height"), value.get("width")]
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"non-square size {value} is not supported")
        return int(value[0])
    return int(value)


def _pair(value: Any) -> tuple[int, int]:
    first, second = value
    return int(first), int(second)


@lru_cache(maxsize=1024)
def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, columns) of crop windows the processor picks (ref: image_processing_molmo2.select_tiling).

    Candidates are every grid of at most ``max_crops`` windows, ordered by (count, rows). The
    scale each needs to cover the image is computed in float32 as the processor does; if none
    covers it, the one needing the least downscale wins, else the smallest upscale.
    """
    tilings = sorted(
        (
            (rows, columns)
            for rows in range(1, max_crops + 1)
            for columns in range(1, max_crops + 1)
            if rows * columns <= max_crops
        ),
        key=lambda grid: (grid[0] * grid[1], grid[0]),
    )
    candidates = np.asarray(tilings, dtype=np.int32) * window
    scales = (candidates.astype(np.float32) / np.asarray([height, width], dtype=np.float32)).min(axis=1)
    if np.all(scales < 1):
        return tilings[int(scales.argmax())]
    return tilings[int(np.where(scales < 1.0, np.float32(10e9), scales).argmin())]


class Molmo2(Family):
    """Molmo2 (Molmo2ForConditionalGeneration), e.g. allenai/Molmo2-4B."""

    name = "molmo2"
    title = "Molmo2"
    architectures = ("Molmo2ForConditionalGeneration",)
    model_types = ("molmo2",)
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes(
            "one vision graph over every crop count (a low-res view plus 1..max_crops overlapping "
            "crops); a specialization per (crops, pooled tokens)"
        ),
        chunk_split=bidirectional(
            "every image token (patches, columns, starts, ends) attends to every other one both "
            "ways (mm_token_type_ids block), so a prefill chunk holds an image's whole token span"
        ),
        video=yes(
            "frames through the image graph (one low-res view each, pooled 3x3); a clip's frames and "
            "timestamps stay in one chunk; images and a video are not mixed in one prompt"
        ),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=single_program_not_built(
            "not tried; the vision call has a second input beside the crops (image_token_pooling, "
            "the patches each token pools), which the composed encode branch would have to carry"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: BATCHED_NUM_PATCHES},
        IMAGE_TOKEN_POOLING: {0: symbols.VISION_SIZE, 1: POOLING_WINDOW},
    }
    image_token_key = "image_patch_id"
    # Frames take rows at the same <im_patch> token (Molmo2Config maps video_token_id onto it).
    video_token_key = "image_patch_id"
    layout = (
        # The crop axis of pixel_values [crops, patches, patch_dim] gates the single program's encoder:
        # every image has 2+ crops (the low-res view and at least one window), so a keep
        # specialization's 1 is never an image's.
        SingleProgramGate(encode_axis=0),
        # "Image 2" (at least one token) separates two images' spans in Molmo2's chat template.
        ImageMarkers(between=1),
        # Every image token attends to every other one, across images: a prompt's images share a chunk.
        JoinedImages(),
    )

    # ---- config view ----

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> Molmo2Vision:
        """Crop geometry from the processor config over its defaults; the patch size from the ViT.

        Published configs keep the ViT under ``vit_config`` with ``image_patch_size`` (remote-code
        names that transformers renames on load); converted ones under ``vision_config``.
        """
        top = reader.section(model.config)
        vision: Section = top.sub("vision_config") if top.has("vision_config") else top.sub("vit_config")
        processor = reader.section(model.processor, "preprocessor_config")
        video = reader.section(model.video_processor, "video_preprocessor_config")
        patch = vision.first(
            [(vision, "patch_size"), (vision, "image_patch_size")],
            VISION_DEFAULTS["patch_size"],
            int,
            VISION_SOURCE,
        )
        crop = processor.default("size", PROCESSOR_DEFAULTS["size"], _square, PROCESSOR_SOURCE)
        # The column token is in every image's span; the others may be absent from a config.
        top.required("image_col_id")
        ids = tuple(int(model.config[key]) for key in IMAGE_TOKEN_KEYS if model.config.get(key) is not None)
        return Molmo2Vision(
            crop_size=crop,
            patch_size=patch,
            max_crops=processor.default("max_crops", PROCESSOR_DEFAULTS["max_crops"], int, PROCESSOR_SOURCE),
            margins=processor.default(
                "overlap_margins", PROCESSOR_DEFAULTS["overlap_margins"], _pair, PROCESSOR_SOURCE
            ),
            pooling=processor.default(
                "pooling_size", PROCESSOR_DEFAULTS["pooling_size"], _pair, PROCESSOR_SOURCE
            ),
            image_token_ids=ids,
            frame_size=video.default("size", VIDEO_DEFAULTS["size"], _square, VIDEO_SOURCE),
            frame_pooling=video.default("pooling_size", VIDEO_DEFAULTS["pooling_size"], _pair, VIDEO_SOURCE),
        )

    # ---- token math ----

    def pooled_grids(self, model: ModelDescription, image: ImageSize) -> tuple[int, int, int, int, int]:
        """(low_h, low_w, high_h, high_w, crops) of one image: its ``image_grids`` row and crop count."""
        vision = self.vision(model)
        margin = sum(vision.margins) * vision.patch_size
        rows, columns = select_tiling(
            image.height - margin, image.width - margin, vision.window_size, vision.max_crops
        )
        canvas_h, canvas_w = rows * vision.window_size + margin, columns * vision.window_size + margin
        pool_h, pool_w = vision.pooling
        low_h = math.ceil(vision.crop_patches / pool_h)
        low_w = math.ceil(vision.crop_patches / pool_w)
        high_h = math.ceil(canvas_h // vision.patch_size / pool_h)
        high_w = math.ceil(canvas_w // vision.patch_size / pool_w)
        return low_h, low_w, high_h, high_w, rows * columns + 1

    def frame_grid(self, model: ModelDescription) -> tuple[int, int]:
        """(rows, columns) of one video frame's pooled tokens (every frame at the frame size)."""
        vision = self.vision(model)
        side = vision.frame_size // vision.patch_size
        return math.ceil(side / vision.frame_pooling[0]), math.ceil(side / vision.frame_pooling[1])

    def tokens_before_image(self, model: ModelDescription, number: int) -> int:
        """Tokens of ``Image N``, which Molmo2's chat template writes before each of several images.

        Counted with the checkpoint's ``tokenizer.json`` when it sits beside the config; a pinned
        config snapshot has none, and the text's UTF-8 bytes bound it (a byte-level BPE, Molmo2's
        Qwen tokenizer, never makes more tokens than bytes).
        """
        return _text_tokens(model.source, f"Image {number}")

    def image_extent(self, model: ModelDescription, image: ImageSize) -> int:
        """Tokens of an image's span: each view's rows (a column token after each) between start and end.

        A clip's span is its frames (start, rows without column tokens, end) and, between two frames,
        the next one's timestamp (at most :data:`TIMESTAMP_TOKENS`).
        """
        if image.video:
            rows, columns = self.frame_grid(model)
            return image.frames * (2 + rows * columns) + (image.frames - 1) * TIMESTAMP_TOKENS
        low_h, low_w, high_h, high_w, _ = self.pooled_grids(model, image)
        return (2 + low_h * (low_w + 1)) + (2 + high_h * (high_w + 1))

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; crops must leave a window between their overlap margins."""
        problems = []
        if image.frames != 1 and not image.video:
            problems.append("frames must be 1 for an image (a clip is a vision.videos entry)")
        vision = self.vision(model)
        if vision.window_size <= 0:
            problems.append(
                f"overlap margins {list(vision.margins)} leave no window in a "
                f"{vision.crop_patches}-patch crop"
            )
        return problems

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """The ViT per crop, the crops side by side, blocked for 16 crops (export.CROPS)."""
        heads = tower_value(model, ("num_attention_heads",), 16, section="vit_config")
        vision = self.vision(model)
        rows = (vision.crop_size // vision.patch_size) ** 2
        blocks = policy.vision_count(heads, rows, 16)
        return VisionAttention(heads, rows, rows, int(values[BATCHED_NUM_PATCHES]), blocks)

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """batched_num_patches (crops, or frames), vision_size (pooled tokens) and pooling_window.

        An image is its low-res view and crops, pooled 2x2 on the published processor; a clip is its
        frames, each resized whole to the frame size and pooled 3x3 (Molmo2VideoProcessor).
        """
        vision = self.vision(model)
        if image.video:
            rows, columns = self.frame_grid(model)
            window = vision.frame_pooling[0] * vision.frame_pooling[1]
            return {
                BATCHED_NUM_PATCHES: image.frames,
                symbols.VISION_SIZE: image.frames * rows * columns,
                POOLING_WINDOW: window,
            }
        low_h, low_w, high_h, high_w, crops = self.pooled_grids(model, image)
        return {
            BATCHED_NUM_PATCHES: crops,
            symbols.VISION_SIZE: low_h * low_w + high_h * high_w,
            POOLING_WINDOW: vision.pooling[0] * vision.pooling[1],
        }


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.molmo2.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.molmo2.export import Adapter

    return Adapter


register(Molmo2, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)


@lru_cache(maxsize=8)
def _tokenizer(source: str):
    from pathlib import Path

    path = Path(source)
    path = path if path.is_dir() else path.parent
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: fall back to the bound
        return None


def _text_tokens(source: str, text: str) -> int:
    """Tokens of ``text`` by the tokenizer beside ``source``, else its UTF-8 bytes (an upper bound)."""
    tokenizer = _tokenizer(str(source))
    if tokenizer is None:
        return len(text.encode("utf-8"))
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
