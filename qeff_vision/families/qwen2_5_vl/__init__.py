"""Qwen2.5-VL: dynamic-resolution ViT with window attention and 2-D rotary positions, M-RoPE decoder.

Token math follows the Qwen2-VL image processor's ``smart_resize``
(ref: transformers v5 models/qwen2_vl/image_processing_qwen2_vl.py, ``smart_resize``): both sides
are rounded to a multiple of ``patch_size * merge_size`` (28), the pixel count is clamped to
[min_pixels, max_pixels], and every 2x2 group of 14-pixel patches becomes one vision token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.contract.video_pruning import kept_rows
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    EVS_VIDEO_PRUNING,
    NO_DEEPSTACK,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    Family,
    Features,
    ImageSize,
    ModelDescription,
    PatchBuckets,
    SingleProgramGate,
    count_symbol,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.qwen2_5_vl.patches import Geometry
from qeff_vision.families.qwen2_5_vl.tiny import write_tiny_checkpoint  # torch-free until called

GRID_H = "grid_h"
GRID_W = "grid_w"
GRID_HEIGHT = "grid_height"
GRID_WIDTH = "grid_width"
IMAGE_GRID_THW = "image_grid_thw"
# Temporal patches on image_grid_thw's axis 1 (QEfficient's name): 1 for an image, frames / 2 for a clip.
TIME = "time"
# Patch-bucket vision program (see patches.py): per-patch ids and the window layout.
PATCH_IDS = "patch_ids"
WINDOW_LAYOUT = "window_layout"
WINDOW_BLOCKS = "window_blocks"

# The published checkpoints' preprocessor_config.json (used when only a config snapshot is given).
DEFAULT_MIN_PIXELS = 4 * 28 * 28
DEFAULT_MAX_PIXELS = 16384 * 28 * 28
# Qwen2VLVideoProcessor's class defaults (ref: transformers v5
# models/qwen2_vl/video_processing_qwen2_vl.py), used when neither a video processor config nor an
# image processor config names the pixel bounds.
DEFAULT_VIDEO_MIN_PIXELS = 128 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_ASPECT_RATIO = 200
CHANNELS = 3
# Qwen2_5_VLVisionConfig's defaults (ref: transformers v5 models/qwen2_5_vl/configuration_qwen2_5_vl.py).
VISION_DEFAULTS = {
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "tokens_per_second": 4,
}


@dataclass(frozen=True)
class QwenVision:
    """The vision geometry and processor bounds of a Qwen-VL checkpoint, read once.

    Description, host and patch packing all read these; each default is stated once, in the
    family's ``VISION_DEFAULTS`` and pixel-bound constants.

    Attributes:
        patch_size: Pixels per patch side.
        merge: ``spatial_merge_size``: patches per vision-token side.
        temporal: ``temporal_patch_size``: frames per temporal patch.
        window_size: Window-attention side in pixels (Qwen2.5-VL's tower).
        tokens_per_second: M-RoPE temporal spacing of a clip's patches per second.
        deepstack_layers: Vision blocks whose features feed the decoder (Qwen3-VL; empty otherwise).
        pixel_limits: (min_pixels, max_pixels) of the image processor.
        video_pixel_limits: (min_pixels, max_pixels) of the video processor.
    """

    patch_size: int
    merge: int
    temporal: int
    window_size: int
    tokens_per_second: float
    deepstack_layers: tuple[int, ...]
    pixel_limits: tuple[int, int]
    video_pixel_limits: tuple[int, int]

    @property
    def factor(self) -> int:
        """Pixels per vision-token side: patch_size * merge (28 for Qwen2.5-VL)."""
        return self.patch_size * self.merge

    @property
    def window(self) -> int:
        """Window side in merged tokens."""
        return self.window_size // self.merge // self.patch_size


class QwenPatchBuckets(PatchBuckets):
    """Qwen-VL patch buckets: grid_height is the bucket's patch count; a call packs any images that fit."""

    input_axes = {
        symbols.PIXEL_VALUES: {0: GRID_HEIGHT, 1: GRID_WIDTH},
        PATCH_IDS: {0: GRID_HEIGHT},
        WINDOW_LAYOUT: {0: WINDOW_BLOCKS},
    }
    output_axes = {symbols.VISION_EMBEDS: {1: symbols.VISION_SIZE}}

    def _geometry(self, model: ModelDescription) -> Geometry:
        vision = self.family.vision(model)
        return Geometry(vision.merge, vision.window)

    def patch_count(self, model: ModelDescription, image: ImageSize) -> int:
        """Patches of an image at its own (processor-resized) resolution."""
        return self.family.vision_symbols(model, image)[GRID_HEIGHT]

    def bucket_symbols(self, model: ModelDescription, patches: int) -> dict[str, int]:
        """grid_height (the bucket), grid_width, window_blocks and vision_size of a patch bucket."""
        vision = self.family.vision(model)
        patch, temporal = vision.patch_size, vision.temporal
        geometry = self._geometry(model)
        return {
            GRID_HEIGHT: patches,
            GRID_WIDTH: CHANNELS * temporal * patch * patch,
            WINDOW_BLOCKS: geometry.window_blocks(patches),
            symbols.VISION_SIZE: patches // (geometry.merge * geometry.merge),
        }

    def bucket_problems(self, model: ModelDescription, patches: int) -> list[str]:
        """A bucket holds whole merged tokens: a multiple of merge^2 patches, at least one token."""
        group = self._geometry(model).merge ** 2
        if patches % group:
            return [f"{patches} patches is not a multiple of {group} (one merged token is {group} patches)"]
        return []

    def fit_to_patches(self, model: ModelDescription, image: ImageSize, patches: int) -> tuple[int, int]:
        """The processor's resize with ``max_pixels`` set to ``patches`` patches (aspect ratio kept)."""
        family = self.family
        patch = family.vision(model).patch_size
        min_pixels, max_pixels = family.pixel_limits(model)
        limit = min(max_pixels, patches * patch * patch)
        return family._smart_resize(image.height, image.width, family._factor(model), min_pixels, limit)

    def max_patches(self, model: ModelDescription) -> int:
        """Patches of the largest image the processor produces (its ``max_pixels``)."""
        patch = self.family.vision(model).patch_size
        return self.family.pixel_limits(model)[1] // (patch * patch)


class Qwen2_5_VL(Family):
    """Qwen2.5-VL (3B/7B/32B/72B Instruct)."""

    name = "qwen2_5_vl"
    title = "Qwen2.5-VL"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    model_types = ("qwen2_5_vl",)
    position_id_rows = 4
    video_token_key = "video_token_id"
    patch_bucket_capability = QwenPatchBuckets  # optional capability: images packed on patch counts
    features = Features(
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes("one vision graph; a specialization per resolution or per patch bucket"),
        chunk_split=yes("causal attention over image tokens"),
        video=yes("2 frames per temporal patch; a vision specialization per (resolution, frames)"),
        video_pruning=EVS_VIDEO_PRUNING,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the patch-sequence tower composed in, gated on the patch count "
            "(the placeholder has 1 patch); one encode call per run of same-resolution images in the "
            "first chunk (the grid rides on image_grid_thw's shape); images only (clips and patch "
            "buckets serve dual)"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    # The grid dims ride on the *shape* of image_grid_thw [batch, 1, grid_h, grid_w], so one graph
    # serves every resolution and the compiler sees them as specialization symbols (QEfficient's
    # layout, which vLLM's qaic backend feeds).
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: GRID_HEIGHT, 1: GRID_WIDTH},
        IMAGE_GRID_THW: {0: symbols.BATCH_SIZE, 1: TIME, 2: GRID_H, 3: GRID_W},
    }
    # deployment single: the patch axis gates the encoder (an image has >= min_pixels / 14^2 = 16
    # patches, the keep placeholder 1); a call's images are concatenated on it.
    layout = (SingleProgramGate(encode_axis=0),)
    #: Whose defaults ``VISION_DEFAULTS`` and the pixel bounds are, for notes.
    defaults_source = "Qwen2.5-VL default"
    vision_defaults = VISION_DEFAULTS
    default_pixel_limits = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    default_video_pixel_limits = (DEFAULT_VIDEO_MIN_PIXELS, DEFAULT_VIDEO_MAX_PIXELS)

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> QwenVision:
        """The tower's geometry over :attr:`vision_defaults`; the image and video processors' bounds."""
        vision = reader.section(model.config).sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        video = reader.section(model.video_processor, "video_preprocessor_config")

        def default(key: str, kind=int):
            return vision.default(key, self.vision_defaults[key], kind, self.defaults_source)

        return QwenVision(
            patch_size=default("patch_size"),
            merge=default("spatial_merge_size"),
            temporal=default("temporal_patch_size"),
            window_size=default("window_size"),
            tokens_per_second=default("tokens_per_second", float),
            deepstack_layers=tuple(int(i) for i in vision.optional("deepstack_visual_indexes", list) or ()),
            pixel_limits=self.read_pixel_limits(processor),
            video_pixel_limits=self.read_video_pixel_limits(video, processor),
        )

    def read_pixel_limits(self, processor: Section) -> tuple[int, int]:
        """(min_pixels, max_pixels) from the processor config, or the published defaults."""
        size = processor.sub("size")
        low, high = self.default_pixel_limits
        source = f"the published {self.title} preprocessor_config.json"
        return (
            processor.first([(processor, "min_pixels"), (size, "shortest_edge")], low, int, source),
            processor.first([(processor, "max_pixels"), (size, "longest_edge")], high, int, source),
        )

    def read_video_pixel_limits(self, video: Section, processor: Section) -> tuple[int, int]:
        """(min_pixels, max_pixels) of the video processor.

        transformers reads the video processor from its own config when the checkpoint has one and
        otherwise from preprocessor_config.json (the published Qwen2.5-VL checkpoints), so the
        image bounds apply there; the class defaults when neither names them.
        """
        for config in (video, processor):
            size = config.sub("size")
            low = config.optional("min_pixels") or size.optional("shortest_edge")
            high = config.optional("max_pixels") or size.optional("longest_edge")
            if low and high:
                return int(low), int(high)
        return self.default_video_pixel_limits

    def pixel_limits(self, model: ModelDescription) -> tuple[int, int]:
        """(min_pixels, max_pixels) from the processor config, or the published defaults."""
        return self.vision(model).pixel_limits

    def video_pixel_limits(self, model: ModelDescription) -> tuple[int, int]:
        """(min_pixels, max_pixels) of the video processor (see :meth:`read_video_pixel_limits`)."""
        return self.vision(model).video_pixel_limits

    def _factor(self, model: ModelDescription) -> int:
        return self.vision(model).factor

    def resized(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """Height and width after the processor's smart resize (the video processor's for a clip)."""
        factor = self._factor(model)
        limits = self.video_pixel_limits(model) if image.video else self.pixel_limits(model)
        return self._smart_resize(image.height, image.width, factor, *limits)

    @staticmethod
    def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
        """Transformers' ``smart_resize`` of the Qwen2-VL image and video processors."""
        # No floor at one factor here: a side under factor / 2 rounds to 0, and the min_pixels branch
        # below then scales both sides up, as transformers does.
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > max_pixels:
            beta = math.sqrt((height * width) / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Qwen's processor rejects extreme aspect ratios; a clip has whole temporal patches."""
        problems = []
        if max(image.height, image.width) / min(image.height, image.width) > MAX_ASPECT_RATIO:
            problems.append(f"aspect ratio of {image.height}x{image.width} exceeds {MAX_ASPECT_RATIO}")
        temporal = self.vision(model).temporal
        if image.video and (image.frames < temporal or image.frames % temporal):
            problems.append(
                f"a {self.title} clip needs a multiple of {temporal} frames "
                f"(one temporal patch per {temporal}), got {image.frames}"
            )
        if not image.video and image.frames != 1:
            problems.append("an image has 1 frame; list clips under vision.videos")
        return problems

    def language_rows(
        self, model: ModelDescription, image: ImageSize, video_pruning_rate: float = 0.0
    ) -> int:
        """A pruned clip's rows: ``kept_rows(grid_t, rows per temporal patch, rate)``; else its tokens.

        EVS keeps the first temporal patch and the highest-scoring later rows up to that count
        (ref: vLLM v0.33.0 ``compute_retained_tokens_count``, used by its Qwen2.5-VL and Qwen3-VL
        prompt replacements).
        """
        tokens = self.image_tokens(model, image)
        if not image.video or not video_pruning_rate:
            return tokens
        frames = self.temporal_patches(model, image)
        return kept_rows(frames, tokens // frames, video_pruning_rate)

    def temporal_patches(self, model: ModelDescription, image: ImageSize) -> int:
        """grid_t: 1 for an image, frames / temporal_patch_size for a clip (2 frames per patch)."""
        if not image.video:
            return 1
        return image.frames // self.vision(model).temporal

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """The full-attention layers: every patch of a frame (grid_h x grid_w), blocked for any image."""
        heads = tower_value(model, ("num_heads",), 16)
        if GRID_H not in values:  # a patch bucket: every packed patch (masked per image)
            rows = int(values[GRID_HEIGHT])
            return VisionAttention(heads, rows, rows, 1, policy.vision_count(heads))
        rows = int(values[GRID_H]) * int(values[GRID_W])
        parallel = count_symbol(values, symbols.BATCH_SIZE) * count_symbol(values, TIME)
        return VisionAttention(heads, rows, rows, parallel, policy.vision_count(heads))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """grid_h, grid_w (patches), grid_height (patch rows), grid_width (patch features), vision_size."""
        vision = self.vision(model)
        patch, merge, temporal = vision.patch_size, vision.merge, vision.temporal
        height, width = self.resized(model, image)
        grid_h, grid_w = height // patch, width // patch
        grid_t = self.temporal_patches(model, image)
        return {
            GRID_H: grid_h,
            GRID_W: grid_w,
            TIME: grid_t,
            GRID_HEIGHT: grid_t * grid_h * grid_w,
            GRID_WIDTH: CHANNELS * temporal * patch * patch,
            symbols.VISION_SIZE: grid_t * grid_h * grid_w // (merge * merge),
        }


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.qwen2_5_vl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.qwen2_5_vl.export import Adapter

    return Adapter


register(Qwen2_5_VL, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
