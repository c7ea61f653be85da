"""GLM-4.1V: a Qwen-style patch tower with a bicubic-resampled position table, M-RoPE GLM-4 decoder.

Ref: transformers v5 models/glm4v (``Glm4vForConditionalGeneration``).

* Token math: ``smart_resize`` of ``image_processing_glm4v.py`` counts the temporal factor in the
  pixel bounds (an image is resized as ``temporal_patch_size`` frames: ``t_bar * h_bar * w_bar``
  against ``size`` ``shortest_edge`` 112*112 .. ``longest_edge`` 28*28*15000), and scales a side
  under one factor up first; then 14-pixel patches, every 2x2 becomes one vision token, as Qwen.
* Placeholders: one ``<|image|>`` id per vision token; a clip's frames use the same id inside
  ``<|begin_of_video|>`` / ``<|end_of_video|>`` (``processing_glm4v.py``), so the brackets decide
  the modality. This family takes images only (see ``features.video``).
* Positions: ``Glm4vModel.get_rope_index`` places an image of merged grid (h, w) starting at s at
  (s, s + row, s + column) and resumes text at s + max(h, w), Qwen2-VL's rule; the text model
  takes [4, batch, seq] positions (row 0 the text slot).

Registered at import like every family; its spec(s) under ``specs/glm4v/`` read the pinned config
``specs/configs/GLM-4.1V-9B-Thinking/`` (DERIVED from transformers' ``Glm4vConfig`` defaults, which
are documented as this checkpoint's, see specs/configs/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    ImageSize,
    ModelDescription,
    SingleProgramGate,
    count_symbol,
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.glm4v.tiny import write_tiny_checkpoint  # torch-free until called

GRID_H = "grid_h"
GRID_W = "grid_w"
GRID_HEIGHT = "grid_height"
GRID_WIDTH = "grid_width"
IMAGE_GRID_THW = "image_grid_thw"
TIME = "time"
CHANNELS = 3
MAX_ASPECT_RATIO = 200
# Glm4vImageProcessor's class defaults (ref: transformers v5 models/glm4v/image_processing_glm4v.py:
# size {shortest_edge: 112 * 112, longest_edge: 28 * 28 * 15000}), used when the checkpoint's
# processor config names no bounds.
DEFAULT_MIN_PIXELS = 112 * 112
DEFAULT_MAX_PIXELS = 28 * 28 * 15000
# Glm4vVisionConfig's defaults (ref: transformers v5 models/glm4v/configuration_glm4v.py).
VISION_DEFAULTS = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_heads": 12}
DEFAULTS_SOURCE = "GLM-4.1V default"


@dataclass(frozen=True)
class GlmVision:
    """The vision geometry and processor bounds of a GLM-4.1V checkpoint, read once.

    Attributes:
        patch_size: Pixels per patch side.
        merge: ``spatial_merge_size``: patches per vision-token side.
        temporal: ``temporal_patch_size``: frames per temporal patch (an image counts as this many).
        heads: Vision attention heads.
        pixel_limits: (min_pixels, max_pixels) of the image processor, frames included.
    """

    patch_size: int
    merge: int
    temporal: int
    heads: int
    pixel_limits: tuple[int, int]

    @property
    def factor(self) -> int:
        """Pixels per vision-token side: patch_size * merge (28)."""
        return self.patch_size * self.merge


class Glm4v(Family):
    """GLM-4.1V (GLM-4.1V-9B-Thinking, GLM-4.1V-9B-Base)."""

    name = "glm4v"
    title = "GLM-4.1V"
    architectures = ("Glm4vForConditionalGeneration",)
    model_types = ("glm4v",)
    position_id_rows = 4
    features = Features(
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes("one vision graph, a specialization per resolution"),
        chunk_split=yes("causal attention over image tokens"),
        video=no(
            "frames share the image placeholder id (brackets decide the modality); the "
            "bracket-ordered host is not written yet"
        ),
        video_pruning=NO_VIDEO_PRUNING,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the patch-sequence tower composed in, gated on the patch count; one "
            "encode call per run of same-resolution images in the first chunk"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    # The grid rides on the *shape* of image_grid_thw [batch, 1, grid_h, grid_w] (QEfficient's
    # layout for its Qwen-VL towers), so one graph serves every resolution.
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: GRID_HEIGHT, 1: GRID_WIDTH},
        IMAGE_GRID_THW: {0: symbols.BATCH_SIZE, 1: TIME, 2: GRID_H, 3: GRID_W},
    }
    # deployment single: the patch axis gates the encoder (an image has >= 4 patches, the keep
    # placeholder 1); a call's images are concatenated on it.
    layout = (SingleProgramGate(encode_axis=0),)

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> GlmVision:
        """The tower's geometry over :data:`VISION_DEFAULTS`; the image processor's pixel bounds."""
        vision = reader.section(model.config).sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")

        def default(key: str) -> int:
            return vision.default(key, VISION_DEFAULTS[key], int, DEFAULTS_SOURCE)

        return GlmVision(
            patch_size=default("patch_size"),
            merge=default("spatial_merge_size"),
            temporal=default("temporal_patch_size"),
            heads=default("num_heads"),
            pixel_limits=_pixel_limits(processor),
        )

    def resized(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """Height and width after ``image_processing_glm4v.smart_resize`` (an image as 2 frames)."""
        vision = self.vision(model)
        factor, frames = vision.factor, vision.temporal
        min_pixels, max_pixels = vision.pixel_limits
        height, width = image.height, image.width
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if frames * h_bar * w_bar > max_pixels:
            beta = math.sqrt((frames * height * width) / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """The processor rejects aspect ratios over 200; this family takes stills only."""
        problems = []
        if max(image.height, image.width) / min(image.height, image.width) > MAX_ASPECT_RATIO:
            problems.append(f"aspect ratio of {image.height}x{image.width} exceeds {MAX_ASPECT_RATIO}")
        if image.video or image.frames != 1:
            problems.append(f"{self.title} is served for images only: {self.features.video.note}")
        return problems

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """Every block attends over all patches of an image (grid_h x grid_w), blocked for any image."""
        heads = tower_value(model, ("num_heads",), VISION_DEFAULTS["num_heads"])
        rows = int(values[GRID_H]) * int(values[GRID_W])
        parallel = count_symbol(values, symbols.BATCH_SIZE) * count_symbol(values, TIME)
        return VisionAttention(heads, rows, rows, parallel, policy.vision_count(heads))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """grid_h, grid_w (patches), time (1), grid_height (rows), grid_width (features), vision_size."""
        vision = self.vision(model)
        patch, merge = vision.patch_size, vision.merge
        height, width = self.resized(model, image)
        grid_h, grid_w = height // patch, width // patch
        return {
            GRID_H: grid_h,
            GRID_W: grid_w,
            TIME: 1,
            GRID_HEIGHT: grid_h * grid_w,
            GRID_WIDTH: CHANNELS * vision.temporal * patch * patch,
            symbols.VISION_SIZE: grid_h * grid_w // (merge * merge),
        }


def _pixel_limits(processor: Section) -> tuple[int, int]:
    """(min_pixels, max_pixels) from the processor config's ``size``, or the class defaults."""
    size = processor.sub("size")
    source = "Glm4vImageProcessor's class defaults"
    low = [(size, "shortest_edge"), (processor, "min_pixels")]
    high = [(size, "longest_edge"), (processor, "max_pixels")]
    return (
        processor.first(low, DEFAULT_MIN_PIXELS, int, source),
        processor.first(high, DEFAULT_MAX_PIXELS, int, source),
    )


def _host():
    """The host protocol class (numpy only)."""
    from qeff_vision.families.glm4v.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.glm4v.export import Adapter

    return Adapter


register(Glm4v, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
