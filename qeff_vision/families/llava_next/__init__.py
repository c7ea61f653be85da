"""LLaVA-NeXT (IBM Granite Vision): any-resolution tiling, unpadded feature grid, one newline per row.

Token math follows transformers v5 (ref: models/llava_next/processing_llava_next.py,
``_get_number_of_features`` / ``_get_unpadded_features``, and image_processing_utils.py,
``select_best_resolution``). An image of H x W picks the grid pinpoint (a multiple of the tower's
image size S) that keeps the most of its pixels and wastes the least; it is resized into that
pinpoint, padded, and cut into ``tile_rows x tile_cols`` tiles of S, plus one base tile (the whole
image resized to S). Each tile gives P x P features (P = S / patch). The tiles' features form a
``tile_rows*P x tile_cols*P`` grid; the rows (or columns) that only cover padding are cropped
("unpadded") to ``feature_height x feature_width``, and an ``image_newline`` embedding ends every
row. Tokens = P*P + feature_height * (feature_width + 1).

The vision program takes what the processor returns (and the Cloud AI vLLM plugin sends):
``pixel_values`` and ``image_sizes``. The graph derives both grids from the ``image_sizes`` values
(see ``export.py``) and gathers the rows into an output whose length depends on the tile count
only (``vision_size``, :meth:`LlavaNext.vision_rows`), so one vision graph serves every grid
pinpoint and image size, and every specialization has static shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.errors import UserError
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
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, pair
from qeff_vision.families.llava_next.tiny import write_tiny_checkpoint  # torch-free until called

#: Tiles of one image, base tile included: QEfficient's name for pixel_values axis 1 (ref:
#: quic/efficient-transformers QEffLlavaNextForConditionalGeneration.get_onnx_dynamic_axes).
NUM_PATCHES = "num_patches"
#: Each image's original (height, width), int64 [batch_size, 2]: the processor's output, which
#: QEfficient's vision program and the vLLM plugin name the same.
IMAGE_SIZES = symbols.IMAGE_SIZES
# LlavaNextConfig's CLIP ViT-L/14-336 vision defaults, used when the config omits them.
DEFAULT_IMAGE_SIZE = 336
DEFAULT_PATCH_SIZE = 14


@dataclass(frozen=True)
class ImageGrid:
    """Where an image lands: its tile grid and the feature grid left after unpadding.

    Attributes:
        tile_rows: Tiles down (the pinpoint's height / tile side).
        tile_cols: Tiles across.
        feature_height: Feature rows kept (each ends with an ``image_newline`` token).
        feature_width: Feature columns kept.
    """

    tile_rows: int
    tile_cols: int
    feature_height: int
    feature_width: int


@dataclass(frozen=True)
class LlavaNextVision:
    """The tiling geometry of a LLaVA-NeXT checkpoint, read once.

    Attributes:
        tile_size: Side of a tile (the tower's image size).
        patch_size: Pixels per patch side.
        pinpoints: The model's grid pinpoints (height, width).
        processor_pinpoints: The image processor's own pinpoints (None when it names none).
    """

    tile_size: int
    patch_size: int
    pinpoints: tuple[tuple[int, int], ...]
    processor_pinpoints: tuple[tuple[int, int], ...] | None


def best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint (height, width) the processor resizes an image into.

    Maximizes the pixels kept at the aspect-preserving scale, then minimizes the wasted area; the
    first pinpoint wins a tie (ref: transformers image_processing_utils.select_best_resolution).
    """
    best, best_effective, best_wasted = None, 0, math.inf
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(pin_height), int(pin_width)), effective, wasted
    if best is None:
        raise UserError("image_grid_pinpoints is empty")
    return best


def unpadded_grid(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """Feature grid (rows, cols) left after cropping the padding of a ``rows x cols`` grid.

    The side the image did not fill loses the same number of rows (columns) at both ends (ref:
    LlavaNextProcessor._get_unpadded_features and modeling_llava_next.unpad_image; the rounding to
    7 decimals is theirs).
    """
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        return rows - 2 * ((rows - new_rows) // 2), cols
    new_cols = int(round(width * (rows / height), 7))
    return rows, cols - 2 * ((cols - new_cols) // 2)


class LlavaNext(Family):
    """LLaVA-NeXT (LlavaNextForConditionalGeneration), e.g. IBM Granite Vision 3.2."""

    name = "llava_next"
    title = "LLaVA-NeXT (Granite Vision)"
    architectures = ("LlavaNextForConditionalGeneration",)
    model_types = ("llava_next",)
    image_token_key = "image_token_index"
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes(
            "one vision graph over every grid pinpoint; a specialization per tile count serves every "
            "image whose pinpoint has that many tiles (any aspect ratio): its output is that count's "
            "largest row total, each image's own rows first; resize other images to a compiled size"
        ),
        chunk_split=yes("causal attention over image tokens"),
        video=no("LLaVA-NeXT takes images only; LLaVA-NeXT-Video is a different architecture"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the tiling CLIP tower composed in, run once per image in the first "
            "chunk (one call per image: each writes its own rows and zeros up to the tile count's "
            "row total); "
            "the fixed tile side is the symbol pixel_side (1 in keep entries); later chunks and "
            "decode read the rows"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    # QEfficient's inputs (get_onnx_dynamic_axes), as the processor returns them: the graph reads
    # the tile grid and the unpadded feature grid from the image_sizes values (export.py).
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 1: NUM_PATCHES},
        IMAGE_SIZES: {0: symbols.BATCH_SIZE},
    }
    former_symbols = {"num_tiles": NUM_PATCHES}
    # The tile_grid / feature_grid shape carriers of the first vision program: their grids are
    # read from the image_sizes values now, so an export or compile binding them is stale.
    retired_symbols = dict.fromkeys(
        ("tile_rows", "tile_cols", "feature_height", "feature_width"), "now read from image_sizes values"
    )

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> LlavaNextVision:
        """Tile and patch sizes over LlavaNextConfig's defaults; the model's and processor's pinpoints.

        The pinpoints are required: the model's, or else the processor's.
        """
        top = reader.section(model.config)
        vision = top.sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        source = "LlavaNextConfig's CLIP ViT-L/14-336 default"
        own = processor.optional("image_grid_pinpoints", list)
        pinpoints = (
            top.optional("image_grid_pinpoints", list) or own or top.required("image_grid_pinpoints", list)
        )
        return LlavaNextVision(
            tile_size=vision.default("image_size", DEFAULT_IMAGE_SIZE, int, source),
            patch_size=vision.default("patch_size", DEFAULT_PATCH_SIZE, int, source),
            pinpoints=tuple(pair(p) for p in pinpoints),
            processor_pinpoints=tuple(pair(p) for p in own) if own else None,
        )

    def tile_size(self, model: ModelDescription) -> int:
        """Side S of a tile: the vision tower's image size."""
        return self.vision(model).tile_size

    def patches_per_side(self, model: ModelDescription) -> int:
        """P: features per tile side (image size / patch size)."""
        return self.tile_size(model) // self.vision(model).patch_size

    def pinpoints(self, model: ModelDescription) -> list[list[int]]:
        """The model's grid pinpoints (height, width); the model unpads with these, not the processor's."""
        return [list(p) for p in self.vision(model).pinpoints]

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """Every tile is ``tile_size`` px square; the graph's symbols are the image and tile counts."""
        return self.tile_size(model)

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; the processor's pinpoints must be the model's."""
        problems = []
        if image.frames != 1:
            problems.append("frames must be 1: LLaVA-NeXT takes images only")
        processor_pinpoints = self.vision(model).processor_pinpoints
        if processor_pinpoints and [list(p) for p in processor_pinpoints] != self.pinpoints(model):
            problems.append("the image processor's image_grid_pinpoints differ from the model config's")
        return problems

    def image_grid(self, model: ModelDescription, image: ImageSize) -> ImageGrid:
        """The tile grid of the pinpoint the processor picks and the unpadded feature grid."""
        tile, side = self.tile_size(model), self.patches_per_side(model)
        pin_height, pin_width = best_resolution(image.height, image.width, self.pinpoints(model))
        rows, cols = math.ceil(pin_height / tile), math.ceil(pin_width / tile)
        feature_height, feature_width = unpadded_grid(image.height, image.width, rows * side, cols * side)
        return ImageGrid(rows, cols, feature_height, feature_width)

    def vision_rows(self, model: ModelDescription, tiles: int) -> int:
        """Output rows of the vision program for ``tiles`` tiles per image (base tile included).

        The most any image those tiles hold produces: the base tile's P*P, plus the largest
        pinpoint grid of at most ``tiles - 1`` tiles uncropped, with a newline per row. The
        graph computes the same from the tile axis (``export.most_rows``), so a specialization's
        output shape is fixed; an image's own rows come first, zeros after.
        """
        tile, side = self.tile_size(model), self.patches_per_side(model)
        grids = [
            (height // tile * side) * (width // tile * side + 1)
            for height, width in self.pinpoints(model)
            if (height // tile) * (width // tile) <= tiles - 1
        ]
        return side * side + max(grids, default=0)

    def image_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """P*P + feature_height * (feature_width + 1): the processor's count for this size."""
        grid, side = self.image_grid(model, image), self.patches_per_side(model)
        return side * side + grid.feature_height * (grid.feature_width + 1)

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """The tower per tile (patches + CLS), the tiles side by side, not blocked."""
        heads = tower_value(model, ("num_attention_heads",), 12)  # CLIPVisionConfig default
        vision = self.vision(model)
        rows = (vision.tile_size // vision.patch_size) ** 2 + 1
        return VisionAttention(heads, rows, rows, int(values[NUM_PATCHES]))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """num_patches (the tiles, base tile included) and vision_size, the rows that tile count outputs.

        Both depend on the tile count only: every image whose pinpoint has as many tiles (any
        aspect ratio) runs in one specialization; :meth:`image_tokens` counts its own rows.
        """
        grid = self.image_grid(model, image)
        tiles = grid.tile_rows * grid.tile_cols + 1
        return {NUM_PATCHES: tiles, symbols.VISION_SIZE: self.vision_rows(model, tiles)}


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.llava_next.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.llava_next.export import Adapter

    return Adapter


register(LlavaNext, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
