"""Qwen3-VL: patch-16 ViT with interpolated learned positions, deepstack features, interleaved M-RoPE.

Token math is Qwen2.5-VL's ``smart_resize`` with a 32-pixel factor (patch 16 x merge 2; ref:
transformers v5 models/qwen2_vl/image_processing_qwen2_vl.py, which Qwen3-VL's processor uses with
``patch_size`` 16), so the family reuses :class:`Qwen2_5_VL`'s resize and changes the defaults.

Deepstack (ref: transformers v5 models/qwen3_vl/modeling_qwen3_vl.py, ``Qwen3VLVisionModel`` and
``Qwen3VLTextModel._deepstack_process``): the vision tower also merges the hidden states of a few
intermediate blocks (``deepstack_visual_indexes``) into decoder-width rows, and the decoder adds
the k-th of them to the output of its k-th layer at the image positions. Both programs carry them
as ``deepstack_features`` [num_feature_layers, batch, vision_size, hidden] (QEfficient's name and
axes), sliced per chunk exactly like ``vision_embeds``.
"""

from __future__ import annotations

import math

from qeff_vision import symbols
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    EMBED,
    EVS_VIDEO_PRUNING,
    GENERATE,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    SCORE,
    Features,
    ImageSize,
    ModelDescription,
    PlaceholderRuns,
    SingleProgramGate,
    yes,
)
from qeff_vision.families.config_view import Section
from qeff_vision.families.qwen2_5_vl import (
    CHANNELS,
    GRID_H,
    GRID_HEIGHT,
    GRID_W,
    GRID_WIDTH,
    IMAGE_GRID_THW,
    TIME,
    VISION_DEFAULTS,
    Qwen2_5_VL,
)
from qeff_vision.families.qwen3_vl.tiny import write_tiny_checkpoint  # torch-free until called

DEEPSTACK_FEATURES = "deepstack_features"
# QEfficient's symbol for the stack of deepstack layers.
NUM_FEATURE_LAYERS = "num_feature_layers"

# The published checkpoints' preprocessor_config.json: size {shortest_edge: 65536,
# longest_edge: 16777216} (256^2 .. 4096^2 pixels), used when only a config snapshot is given.
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
# Qwen3VLVideoProcessor's class defaults (ref: transformers v5
# models/qwen3_vl/video_processing_qwen3_vl.py), used when the checkpoint has no video processor config.
DEFAULT_VIDEO_MIN_PIXELS = 128 * 32 * 32
DEFAULT_VIDEO_MAX_PIXELS = 768 * 32 * 32


class Qwen3_VL(Qwen2_5_VL):
    """Qwen3-VL (2B/4B/8B/32B Instruct and Thinking; dense text models)."""

    name = "qwen3_vl"
    title = "Qwen3-VL"
    architectures = ("Qwen3VLForConditionalGeneration",)
    model_types = ("qwen3_vl",)
    position_id_rows = 4
    # Qwen3-VL-Embedding and Qwen3-VL-Reranker are this architecture (config.json
    # Qwen3VLForConditionalGeneration) read by a pooling head (contract/tasks.py).
    tasks = (GENERATE, EMBED, SCORE)
    # vLLM loads an original Qwen3(-VL) reranker as a yes/no sequence classifier
    # (vllm/model_executor/models/config.py, Qwen3VLForSequenceClassificationConfig).
    vllm_score_overrides = {
        "architectures": ["Qwen3VLForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    features = Features(
        export=yes(),
        dynamic_vision_size=yes("deepstack_features sliced like vision_embeds"),
        multi_resolution=yes("one vision graph, a specialization per resolution"),
        chunk_split=yes("causal attention over image tokens"),
        video=yes("2 frames per temporal patch; frames as timestamped placeholder runs"),
        video_pruning=EVS_VIDEO_PRUNING,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the patch-sequence tower composed in, gated on the patch count; the "
            "first chunk writes vision_embeds and deepstack_features rows into their retained "
            "buffers; one encode call per run of same-resolution images; images only"
        ),
        deepstack=yes("deepstack_features rows sliced per chunk like vision_embeds"),
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    # A clip is one placeholder run per temporal patch, each after its "<t seconds>" text.
    layout = (SingleProgramGate(encode_axis=0), PlaceholderRuns())
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: GRID_HEIGHT, 1: GRID_WIDTH},
        IMAGE_GRID_THW: {0: symbols.BATCH_SIZE, 1: TIME, 2: GRID_H, 3: GRID_W},
    }
    stacked_vision_rows = {DEEPSTACK_FEATURES: NUM_FEATURE_LAYERS}

    defaults_source = "Qwen3-VL default"
    # Qwen3VLVisionConfig: 16-px patches (ref: transformers v5 models/qwen3_vl/configuration_qwen3_vl.py).
    vision_defaults = {**VISION_DEFAULTS, "patch_size": 16}
    default_pixel_limits = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    default_video_pixel_limits = (DEFAULT_VIDEO_MIN_PIXELS, DEFAULT_VIDEO_MAX_PIXELS)

    def read_video_pixel_limits(self, video: Section, processor: Section) -> tuple[int, int]:
        """(min_pixels, max_pixels) of the video processor (its own config, else its class defaults)."""
        size = video.sub("size")
        low, high = size.optional("shortest_edge"), size.optional("longest_edge")
        if low and high:
            return int(low), int(high)
        return self.default_video_pixel_limits

    def resized(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """The image processor's smart resize, or for a clip the video processor's.

        The video budget covers all frames (ref: video_processing_qwen3_vl.py ``smart_resize``).
        """
        if not image.video:
            return super().resized(model, image)
        factor, temporal = self._factor(model), self.vision(model).temporal
        min_pixels, max_pixels = self.video_pixel_limits(model)
        frames, height, width = image.frames, image.height, image.width
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        t_bar = round(frames / temporal) * temporal
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt((frames * height * width) / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """``num_feature_layers``: how many deepstack layers the vision tower feeds the decoder."""
        return {NUM_FEATURE_LAYERS: len(self.vision(model).deepstack_layers)}

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """Qwen2.5-VL's grid symbols plus ``time`` (temporal patches) and ``num_feature_layers``."""
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
            **self.language_symbols(model),
        }


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.qwen3_vl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.qwen3_vl.export import Adapter

    return Adapter


register(Qwen3_VL, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
