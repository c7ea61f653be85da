"""Mistral 3 (Pixtral tower): variable resolution, 2-D rotary patches, 2x2 patch merger, row breaks.

Token math follows transformers v5 (ref: models/pixtral/image_processing_pixtral.py,
``get_resize_output_image_size``; models/pixtral/processing_pixtral.py, ``replace_image_token``).
The processor shrinks an image whose longer side exceeds ``longest_edge`` (keeping the aspect
ratio, sides floored), then rounds each side up to a multiple of patch_size * spatial_merge_size
(28 px). An image of H x W pixels is (H/28) rows of (W/28) ``[IMG]`` tokens, each row followed by
``[IMG_BREAK]`` except the last, which ends with ``[IMG_END]``: rows * (cols + 1) tokens, of which
rows * cols are placeholders (= embedding rows). The breaks are ordinary text tokens, so one
image's placeholders are several runs (``placeholders_in_runs``).

The vision program takes ``pixel_values`` [batch, 3, image_height, image_width]: the patch grid,
the rotary positions and the merge all follow the input's shape, so one graph serves every
resolution and each resolution is one vision specialization.
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
    ImageMarkers,
    ImageSize,
    ModelDescription,
    PlaceholderRuns,
    count_symbol,
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader
from qeff_vision.families.mistral3.tiny import write_tiny_checkpoint  # torch-free until called

IMAGE_HEIGHT = "image_height"
IMAGE_WIDTH = "image_width"

# ref: transformers v5 Mistral3Config (spatial_merge_size 2) and PixtralVisionConfig (patch 16;
# Mistral 3 checkpoints set 14); PixtralImageProcessor default longest_edge 1024 (Mistral Small
# 3.1's preprocessor_config.json sets 1540).
DEFAULT_MERGE = 2
DEFAULT_PATCH = 16
DEFAULT_LONGEST_EDGE = 1024


@dataclass(frozen=True)
class Mistral3Vision:
    """The token grid of a Mistral 3 checkpoint, read once (description and host alike).

    Attributes:
        patch_size: Pixels per patch side.
        merge: ``spatial_merge_size``: patches per image-token side.
        longest_edge: The processor's longest side before an image is shrunk.
    """

    patch_size: int
    merge: int
    longest_edge: int

    @property
    def token_side(self) -> int:
        """Pixels per image token side (28 for Mistral 3)."""
        return self.patch_size * self.merge


class Mistral3(Family):
    """Mistral 3 (Mistral3ForConditionalGeneration), e.g. Mistral-Small-3.1-24B-Instruct-2503."""

    name = "mistral3"
    title = "Mistral 3 (Pixtral)"
    architectures = ("Mistral3ForConditionalGeneration",)
    model_types = ("mistral3",)
    image_token_key = "image_token_index"
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes("one vision graph, a specialization per resolution (multiples of 28 px)"),
        chunk_split=yes("causal attention over image tokens; a chunk may end inside a row or after a break"),
        video=no("Mistral 3 takes images only"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the Pixtral tower composed in, run once per image in the first chunk "
            "(one call per run of same-size images: the patch grid is the pixels' shape); later "
            "chunks and decode read the rows"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 2: IMAGE_HEIGHT, 3: IMAGE_WIDTH}}
    layout = (ImageMarkers(between=1), PlaceholderRuns())  # [IMG_END] closes every image

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> Mistral3Vision:
        """Patch and merge sizes over transformers' defaults; the processor's longest edge."""
        top = reader.section(model.config)
        size = reader.section(model.processor, "preprocessor_config").sub("size")
        return Mistral3Vision(
            patch_size=top.sub("vision_config").default(
                "patch_size", DEFAULT_PATCH, int, "transformers' PixtralVisionConfig default"
            ),
            merge=top.default(
                "spatial_merge_size", DEFAULT_MERGE, int, "transformers' Mistral3Config default"
            ),
            longest_edge=size.default(
                "longest_edge", DEFAULT_LONGEST_EDGE, int, "transformers' PixtralImageProcessor default"
            ),
        )

    def token_side(self, model: ModelDescription) -> int:
        """Pixels per image token side: patch_size * spatial_merge_size (28 for Mistral 3)."""
        return self.vision(model).token_side

    def longest_edge(self, model: ModelDescription) -> int:
        """The processor's longest side before the image is shrunk."""
        return self.vision(model).longest_edge

    def resized(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """Height and width of ``pixel_values`` after the processor's resize."""
        longest, side = self.longest_edge(model), self.token_side(model)
        height, width = image.height, image.width
        ratio = max(height / longest, width / longest)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return math.ceil(height / side) * side, math.ceil(width / side) * side

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; the shrunk image keeps a pixel a side (transformers fails otherwise)."""
        problems = ["frames must be 1: Mistral 3 takes images only"] if image.frames != 1 else []
        longest = self.longest_edge(model)
        ratio = max(image.height / longest, image.width / longest)
        if ratio > 1 and min(math.floor(image.height / ratio), math.floor(image.width / ratio)) < 1:
            problems.append(
                f"{image.height}x{image.width} shrinks to nothing along its short side at {longest} px"
            )
        return problems

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """Pixtral: every patch of an image, blocked for any image."""
        heads = tower_value(model, ("num_attention_heads",), 16)
        patch = tower_value(model, ("patch_size",), 14)
        rows = (int(values[IMAGE_HEIGHT]) // patch) * (int(values[IMAGE_WIDTH]) // patch)
        parallel = count_symbol(values, symbols.BATCH_SIZE)
        return VisionAttention(heads, rows, rows, parallel, policy.vision_count(heads))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """image_height, image_width (pixels, multiples of 28) and vision_size (rows x columns of tokens)."""
        height, width = self.resized(model, image)
        side = self.token_side(model)
        return {
            IMAGE_HEIGHT: height,
            IMAGE_WIDTH: width,
            symbols.VISION_SIZE: (height // side) * (width // side),
        }

    def prompt_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """All tokens one image adds to the prompt: each row of placeholders plus its break/end token."""
        height, width = self.resized(model, image)
        side = self.token_side(model)
        return (height // side) * (width // side + 1)

    def image_extent(self, model: ModelDescription, image: ImageSize) -> int:
        """First to last ``[IMG]``: every token but the final ``[IMG_END]``."""
        return self.prompt_tokens(model, image) - 1


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.mistral3.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.mistral3.export import Adapter

    return Adapter


register(Mistral3, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
