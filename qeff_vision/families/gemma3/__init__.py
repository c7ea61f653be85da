"""Gemma 3: fixed-resolution SigLIP tower, average-pooled projector, Gemma decoder with sliding windows.

Token math (ref: transformers v5 models/gemma3/modeling_gemma3.py, ``Gemma3MultiModalProjector``;
processing_gemma3.py, ``Gemma3Processor``): the processor resizes every image to
``vision_config.image_size`` square; SigLIP makes (image_size / patch_size)^2 patch features; the
projector average-pools them to ``mm_tokens_per_image`` (256 for the published checkpoints, a 4x4
pool of 64x64 patches). The processor expands each ``<start_of_image>`` of the prompt into a blank
line, ``<start_of_image>``, that many ``<image_soft_token>``, ``<end_of_image>`` and a blank line, so
every image is the same number of placeholder tokens whatever its size.

Published ``config.json`` files name few keys and rely on transformers' defaults for the rest
(gemma-3-4b-it's text config has no head counts, no head_dim, no vocab_size); the defaults below
are those of transformers v5 ``Gemma3TextConfig``, ``Gemma3Config`` and ``SiglipVisionConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    FULL_ATTENTION,
    NO_DEEPSTACK,
    NO_VIDEO_PRUNING,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    SLIDING_ATTENTION,
    Family,
    Features,
    ImageMarkers,
    ImageSize,
    ModelDescription,
    bidirectional,
    count_symbol,
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.gemma3.tiny import write_tiny_checkpoint  # torch-free until called

#: Side of the square ``pixel_values`` (one value per checkpoint: the processor's resize target).
#: QEfficient's name (ref: quic/efficient-transformers QEffGemma3ForConditionalGeneration
#: .get_onnx_dynamic_axes, pixel_values {0: batch_size, 2: img_size, 3: img_size}).
IMG_SIZE = "img_size"

# ref: transformers v5 models/gemma3/configuration_gemma3.py (Gemma3Config, Gemma3TextConfig defaults)
# and models/siglip/configuration_siglip.py (SiglipVisionConfig defaults).
CONFIG_DEFAULTS: dict[str, Any] = {"image_token_index": 262_144, "mm_tokens_per_image": 256}
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
}
VISION_DEFAULTS: dict[str, Any] = {"image_size": 224, "patch_size": 16}
DEFAULTS_SOURCE = "transformers' Gemma3Config / SiglipVisionConfig default"


@dataclass(frozen=True)
class GemmaVision:
    """The vision geometry of a Gemma 3 checkpoint, read once.

    Attributes:
        image_size: The SigLIP tower's side (the processor's resize target).
        patch_size: Pixels per patch side.
        tokens_per_image: ``mm_tokens_per_image`` (pooled soft tokens of every image).
        processor_size: The processor's ``size`` setting as written (empty when absent).
        pan_and_scan: The processor crops images into a variable number of crops.
    """

    image_size: int
    patch_size: int
    tokens_per_image: int
    processor_size: dict[str, Any]
    pan_and_scan: bool


class Gemma3(Family):
    """Gemma 3 (4B/12B/27B instruction-tuned and pretrained checkpoints with a vision tower)."""

    name = "gemma3"
    title = "Gemma 3"
    architectures = ("Gemma3ForConditionalGeneration",)
    model_types = ("gemma3",)
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=no(
            "fixed resolution: every image, and every pan-and-scan crop, is resized to "
            "vision_config.image_size (896 px, 256 tokens); specs assume pan-and-scan off (the "
            "processor's default), since its crop count varies per image"
        ),
        chunk_split=bidirectional(
            "the tokens of one image attend to each other both ways (token_type_ids mask), so a "
            "prefill chunk must hold a whole image; the planner moves it into the next chunk"
        ),
        video=no("Gemma 3 has no video input"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the SigLIP tower composed in, run once per image in the first chunk; "
            "later chunks and decode read the retained rows"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 2: IMG_SIZE, 3: IMG_SIZE}}
    former_symbols = {"image_size": IMG_SIZE}
    image_token_key = "image_token_index"
    # <end_of_image> and <start_of_image> always separate two images' soft tokens (the processor
    # adds newlines too, whose token count depends on the tokenizer: 2 is the safe lower bound).
    layout = (ImageMarkers(between=2),)

    text_defaults = TEXT_DEFAULTS
    text_defaults_source = "transformers' Gemma3TextConfig default"
    image_token_default = CONFIG_DEFAULTS["image_token_index"]

    # ---- config view ----

    def default_layer_types(self, text: Section, num_layers: int) -> Sequence[str]:
        """Every ``sliding_window_pattern``-th layer is global, the rest sliding (unless listed).

        ref: transformers v5 models/gemma3/configuration_gemma3.py (``Gemma3TextConfig``: pattern
        6 by default; published configs such as gemma-3-4b-it name neither key).
        """
        pattern = text.default("sliding_window_pattern", 6, int, "Gemma3TextConfig default")
        return [SLIDING_ATTENTION if (layer + 1) % pattern else FULL_ATTENTION for layer in range(num_layers)]

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> GemmaVision:
        """The SigLIP geometry and pooled tokens; the processor's resize and pan-and-scan settings.

        ``image_size`` is required: SigLIP's 224 px default matches no Gemma 3 checkpoint (all
        publish 896), so a config without it is refused rather than specialized wrongly.
        """
        top = reader.section(model.config)
        vision = top.sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        size = processor.sub("size")
        return GemmaVision(
            image_size=vision.required("image_size"),
            patch_size=vision.default("patch_size", VISION_DEFAULTS["patch_size"], int, DEFAULTS_SOURCE),
            tokens_per_image=top.default(
                "mm_tokens_per_image", CONFIG_DEFAULTS["mm_tokens_per_image"], int, DEFAULTS_SOURCE
            ),
            processor_size=dict(size.data),
            pan_and_scan=bool(processor.optional("do_pan_and_scan", bool)),
        )

    # ---- token math ----

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; the pooling must divide the patch grid; the processor must resize to image_size."""
        problems = []
        if image.frames != 1:
            problems.append("frames must be 1: Gemma 3 takes images only")
        vision = self.vision(model)
        tokens = vision.tokens_per_image
        side = math.isqrt(tokens)
        patches = vision.image_size // vision.patch_size
        if side * side != tokens or side == 0 or patches % side:
            problems.append(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                f"{patches}x{patches} patch grid"
            )
        size = vision.processor_size
        wanted = {int(size[k]) for k in ("height", "width") if k in size}
        if wanted and wanted != {vision.image_size}:
            problems.append(
                f"the processor resizes to {size}, but the vision tower takes {vision.image_size} px"
            )
        if vision.pan_and_scan:
            problems.append("do_pan_and_scan is on: its crop count depends on each image; turn it off")
        return problems

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """SigLIP over the fixed image ((image_size / patch)^2 patches), blocked for that length."""
        heads = tower_value(model, ("num_attention_heads",), 12)  # SiglipVisionConfig default
        vision = self.vision(model)
        rows = (vision.image_size // vision.patch_size) ** 2
        parallel = count_symbol(values, symbols.BATCH_SIZE)
        return VisionAttention(
            heads, rows, rows, parallel, policy.vision_count(heads, rows, 4)
        )  # export.IMAGES

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """img_size (the processor's resize target) and vision_size (mm_tokens_per_image), any image."""
        return {
            IMG_SIZE: self.vision(model).image_size,
            symbols.VISION_SIZE: self.vision(model).tokens_per_image,
        }


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.gemma3.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.gemma3.export import Adapter

    return Adapter


register(Gemma3, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
