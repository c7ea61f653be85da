"""InternVL (InternVL3 ``-hf`` conversions): 448 px tiles plus a thumbnail, pixel-shuffle projector.

Token math follows transformers v5 (ref: models/got_ocr2/image_processing_got_ocr2.py,
``get_optimal_tiled_canvas`` / ``get_number_of_image_patches``, and
models/internvl/processing_internvl.py, ``replace_image_token``). The processor picks the tile
grid (columns x rows, between ``min_patches`` and ``max_patches`` tiles) whose aspect ratio is
closest to the image's; on a tie it takes the larger grid while the image covers more than half
of it. The image is resized onto that grid and cut into tiles of the tower's image size; when
there is more than one tile a thumbnail (the whole image at tile size) is appended. Every tile
becomes (image_size / patch)^2 patches, pixel-shuffled by ``downsample_ratio`` (0.5: 2x2 patches
into one token), so a tile is always the same number of tokens (256 for 448 px tiles of 14 px
patches). The prompt wraps them in ``<img>`` ... ``</img>``.

The vision program takes one image's tiles, ``pixel_values`` [batched_num_patches, 3, S, S]
(QEfficient's layout and axis name, which the vllm-qaic plugin sends), and returns ``vision_embeds``
[1, tiles * tokens_per_tile, hidden]: the tile count is its only varying dimension, and each
tile count is one vision specialization.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader
from qeff_vision.families.internvl.tiny import write_tiny_checkpoint  # torch-free until called

#: Tiles in one call (QEfficient's name: ref quic/efficient-transformers
#: QEffInternVLModel.get_onnx_dynamic_axes); one image's tiles in dual, all a prompt's in single.
BATCHED_NUM_PATCHES = "batched_num_patches"

# ref: transformers v5 GotOcr2ImageProcessor class defaults (min_patches 1, max_patches 12) and
# InternVLProcessor's images_kwargs default crop_to_patches=True; InternVLVisionConfig defaults
# (image_size 448, patch_size 14) and InternVLConfig (downsample_ratio 0.5).
PROCESSOR_DEFAULTS: dict[str, Any] = {"min_patches": 1, "max_patches": 12, "crop_to_patches": True}
VISION_DEFAULTS: dict[str, Any] = {"image_size": 448, "patch_size": 14}
DEFAULT_DOWNSAMPLE_RATIO = 0.5


@dataclass(frozen=True)
class InternVLVision:
    """The vision geometry and tiling of an InternVL checkpoint, read once.

    Attributes:
        tile_size: Side of one tile in pixels (the tower's image size).
        patch_size: Pixels per patch side.
        downsample_ratio: Pixel-shuffle ratio per direction.
        min_patches: Fewest canvas tiles.
        max_patches: Most canvas tiles.
        crop_to_patches: The processor tiles images (otherwise one tile each).
        processor_size: The processor's ``size`` setting as written (empty when absent).
    """

    tile_size: int
    patch_size: int
    downsample_ratio: float
    min_patches: int
    max_patches: int
    crop_to_patches: bool
    processor_size: dict[str, Any]


def _side(value: Any) -> int:
    """InternVL configs store image and patch sizes as [h, w] pairs; the tower is square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"non-square size {value} is not supported")
        return int(value[0])
    return int(value)


@lru_cache(maxsize=1024)
def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile canvas the processor picks for an image of ``height`` x ``width``.

    Candidates are every grid with min_tiles <= columns * rows <= max_tiles, ordered by tile count
    (a stable sort of the column-major enumeration). The closest aspect ratio wins; on an exact tie
    the later (larger) grid wins while the image area exceeds half of that grid's area.
    """
    grids = sorted(
        (
            (columns, rows)
            for columns in range(1, max_tiles + 1)
            for rows in range(1, max_tiles + 1)
            if min_tiles <= columns * rows <= max_tiles
        ),
        key=lambda grid: grid[0] * grid[1],
    )
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


class InternVL(Family):
    """InternVL (InternVLForConditionalGeneration), e.g. OpenGVLab/InternVL3-8B-hf."""

    name = "internvl"
    title = "InternVL 3"
    architectures = ("InternVLForConditionalGeneration",)
    model_types = ("internvl",)
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=yes(
            "one vision graph over every tile count (1..max_patches tiles plus a thumbnail); a "
            "specialization per tile count, every tile is 448 px"
        ),
        chunk_split=yes("causal attention over image tokens"),
        video=no("video frames are not exported yet; images only"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the InternViT tower composed in, run once per prompt in the first "
            "chunk over the tiles of all its images (tile counts may differ); the fixed tile side "
            "is the symbol pixel_side (1 in keep entries); later chunks and decode read the rows"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    # ref: QEfficient QEffInternVLModel.get_onnx_dynamic_axes (pixel_values {0: batched_num_patches});
    # vllm-qaic's qaic_multimodal.py splits pixel_values_flat per image into [tiles, 3, S, S].
    vision_input_axes = {symbols.PIXEL_VALUES: {0: BATCHED_NUM_PATCHES}}
    former_symbols = {"num_tiles": BATCHED_NUM_PATCHES}
    # "</img>" and "<img>" always separate the context tokens of two images.
    layout = (ImageMarkers(between=2),)

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> InternVLVision:
        """Tower sizes over ``InternVLVisionConfig``'s defaults; tiling over the processor's."""
        top = reader.section(model.config)
        vision = top.sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        tower = "transformers' InternVLVisionConfig default"
        tiling = "transformers' GotOcr2ImageProcessor default"
        return InternVLVision(
            tile_size=vision.default("image_size", VISION_DEFAULTS["image_size"], _side, tower),
            patch_size=vision.default("patch_size", VISION_DEFAULTS["patch_size"], _side, tower),
            downsample_ratio=top.default(
                "downsample_ratio", DEFAULT_DOWNSAMPLE_RATIO, float, "InternVLConfig default"
            ),
            min_patches=processor.default("min_patches", PROCESSOR_DEFAULTS["min_patches"], int, tiling),
            max_patches=processor.default("max_patches", PROCESSOR_DEFAULTS["max_patches"], int, tiling),
            crop_to_patches=processor.default(
                "crop_to_patches", PROCESSOR_DEFAULTS["crop_to_patches"], bool, tiling
            ),
            processor_size=dict(processor.sub("size").data),
        )

    def tile_size(self, model: ModelDescription) -> int:
        """Side of one tile in pixels (the tower's image size)."""
        return self.vision(model).tile_size

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """Every tile is ``tile_size`` px square; the vision graph's only symbol is the tile count."""
        return self.tile_size(model)

    def tokens_per_tile(self, model: ModelDescription) -> int:
        """(image_size / patch)^2 patches, pixel-shuffled by downsample_ratio in each direction."""
        vision = self.vision(model)
        side = int(vision.tile_size // vision.patch_size * vision.downsample_ratio)
        return side * side

    def tiling(self, model: ModelDescription) -> dict[str, Any]:
        """The image processor's tiling settings over its defaults."""
        vision = self.vision(model)
        return {
            "min_patches": vision.min_patches,
            "max_patches": vision.max_patches,
            "crop_to_patches": vision.crop_to_patches,
        }

    def num_tiles(self, model: ModelDescription, image: ImageSize) -> int:
        """Tiles of one image: the canvas tiles, plus a thumbnail when there is more than one."""
        tiling = self.tiling(model)
        if not tiling["crop_to_patches"] or int(tiling["max_patches"]) <= 1:
            return 1
        tile = self.tile_size(model)
        columns, rows = tile_grid(
            image.height, image.width, tile, int(tiling["min_patches"]), int(tiling["max_patches"])
        )
        canvas = columns * rows
        return canvas + 1 if canvas > 1 else 1

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; the processor's tile size must be the tower's."""
        problems = []
        if image.frames != 1:
            problems.append("frames must be 1: InternVL video export is not supported yet")
        size = self.vision(model).processor_size
        wanted = {int(size[k]) for k in ("height", "width") if k in size}
        if wanted and wanted != {self.tile_size(model)}:
            problems.append(
                f"the processor tiles at {size}, but the vision tower takes {self.tile_size(model)} px"
            )
        return problems

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """InternViT per tile (patches + CLS), the tiles side by side, blocked for 16 tiles."""
        heads = tower_value(model, ("num_attention_heads",), 16)
        vision = self.vision(model)
        rows = (vision.tile_size // vision.patch_size) ** 2 + 1
        blocks = policy.vision_count(heads, rows, 16)  # families/internvl/export.py TILES
        return VisionAttention(heads, rows, rows, int(values[BATCHED_NUM_PATCHES]), blocks)

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """batched_num_patches (the tiles) and vision_size (tiles * tokens per tile)."""
        tiles = self.num_tiles(model, image)
        return {BATCHED_NUM_PATCHES: tiles, symbols.VISION_SIZE: tiles * self.tokens_per_tile(model)}


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.internvl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.internvl.export import Adapter

    return Adapter


register(InternVL, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
