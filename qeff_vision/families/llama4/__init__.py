"""Llama 4 (Scout, Maverick): tiled images with separators, chunked-attention RoPE layers, NoPE layers.

Token math follows transformers v5 (ref: models/llama4/image_processing_llama4.py,
``find_supported_resolutions`` / ``get_best_fit``; models/llama4/processing_llama4.py,
``_prompt_split_image``). An image is resized without distortion onto the best canvas of
``rows x cols`` tiles of ``tile`` px (``rows * cols <= max_patches``), split into those tiles, and,
when there is more than one, a global tile of the whole image is added last. Each tile becomes
``(tile / patch)^2 / 4`` tokens after the pixel shuffle (144 for 336 px tiles of 14 px patches).
The prompt reads ``<|image_start|>``, per tile row the row's tiles with ``<|tile_x_separator|>``
between them and ``<|tile_y_separator|>`` after the row, then ``<|image|>`` and the global tile,
then ``<|image_end|>``: one image is several runs of ``<|patch|>`` placeholders
(``placeholders_in_runs``), and the vision rows are the tiles' in that order.

The vision program takes one image's tiles, ``pixel_values`` [max_num_tiles, 3, tile, tile]; a
vision specialization per tile count. Its rows stay [vision_batch_size, vision_size, hidden] as
for every family (QEfficient's Llama 4 programs use rank-2 ``vision_embeds`` and a batchless
vision program instead).

Decoder: every ``no_rope_layer_interval``-th layer is a NoPE global layer over the whole context;
the others are RoPE layers with chunked attention (``layer_types`` ``chunked_attention``), kept in
a ring of ``min(ctx_len, attention_chunk_size)`` slots by the generic contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.families import register
from qeff_vision.families.base import (
    CHUNKED_ATTENTION,
    DISAGGREGATED_PROGRAMS,
    FULL_ATTENTION,
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
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.llama4.tiny import write_tiny_checkpoint  # torch-free until called

# Tiles of one image in a vision call (QEfficient's name for the same axis).
MAX_NUM_TILES = "max_num_tiles"

# ref: transformers v5 Llama4ImageProcessor (max_patches 16), Llama4VisionConfig (patch_size 14,
# pixel_shuffle_ratio 0.5), Llama4Config (boi_token_index, eoi_token_index) and Llama4TextConfig
# (no_rope_layer_interval 4: every fourth layer is NoPE; attention_chunk_size 8192).
PROCESSOR_DEFAULTS: dict[str, Any] = {"max_patches": 16}
VISION_DEFAULTS: dict[str, Any] = {"patch_size": 14, "pixel_shuffle_ratio": 0.5}
CONFIG_DEFAULTS: dict[str, Any] = {"boi_token_index": 200080, "eoi_token_index": 200081}
TEXT_DEFAULTS: dict[str, Any] = {"no_rope_layer_interval": 4, "attention_chunk_size": 8192}
DEFAULTS_SOURCE = "transformers' Llama4Config / Llama4ImageProcessor default"


@dataclass(frozen=True)
class Llama4View:
    """The vision and token geometry of a Llama 4 checkpoint, read once (:meth:`Llama4.read_vision`).

    Attributes:
        tile: Tile side in pixels (the tower's ``image_size``; the image processor's tile size).
        max_tiles: Most tiles per image before the global tile (``max_patches``).
        patch: Patch side of the tower.
        shuffle_ratio: The vision adapter's pixel-shuffle ratio (tokens = patches * ratio^2).
        image_start: Id of ``<|image_start|>`` (``boi_token_index``).
        image_end: Id of ``<|image_end|>`` (``eoi_token_index``).
        processor_size: The processor's ``size`` setting as written (empty when absent).
    """

    tile: int
    max_tiles: int
    patch: int
    shuffle_ratio: float
    image_start: int
    image_end: int
    processor_size: dict[str, Any]

    @property
    def tokens_per_tile(self) -> int:
        """Placeholders (= vision rows) of one tile after the pixel shuffle (144 for Scout)."""
        return int((self.tile // self.patch) ** 2 * self.shuffle_ratio**2)

    def canvases(self) -> list[tuple[int, int]]:
        """(rows, cols) of every tile grid, in transformers' ``find_supported_resolutions`` order."""
        by_ratio: dict[float, list[tuple[int, int]]] = {}
        for count in range(self.max_tiles, 0, -1):
            factors = sorted({f for f in range(1, count + 1) if count % f == 0})
            for rows in factors:
                by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
        return [grid for grids in by_ratio.values() for grid in grids]

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of ``height`` x ``width`` pixels is split into.

        transformers' ``get_best_fit`` without ``resize_to_max_canvas``: the smallest upscale
        among the canvases that fit without distortion, else the least downscale; ties go to the
        smallest area, then to the first in order. float32 as its torch division computes.
        """
        grids = self.canvases()
        sides = np.array(grids, dtype=np.int64) * self.tile
        scale_h = sides[:, 0].astype(np.float32) / np.float32(height)
        scale_w = sides[:, 1].astype(np.float32) / np.float32(width)
        scales = np.where(scale_h > scale_w, scale_w, scale_h)
        upscale = scales[scales >= 1]
        chosen = upscale.min() if upscale.size else scales[scales < 1].max()
        candidates = [i for i in range(len(grids)) if scales[i] == chosen]
        best = reduce(lambda a, b: b if sides[b].prod() < sides[a].prod() else a, candidates)
        return grids[best]

    def tiles(self, height: int, width: int) -> int:
        """Tiles the vision program encodes for one image: the grid, plus a global tile if > 1."""
        rows, cols = self.tile_grid(height, width)
        return rows * cols + (1 if rows * cols > 1 else 0)


class Llama4(Family):
    """Llama 4 (Llama4ForConditionalGeneration): Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E."""

    name = "llama4"
    title = "Llama 4"
    architectures = ("Llama4ForConditionalGeneration",)
    model_types = ("llama4",)
    image_token_key = "image_token_index"  # <|patch|>; <|image|> only marks the global tile
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(
            "chunked RoPE layers keep rings of min(ctx_len, attention_chunk_size) slots; "
            "RoPE as real cos/sin; MoE experts routed (k slices per token at decode)"
        ),
        dynamic_vision_size=yes(
            "vision_embeds stays [vision_batch_size, vision_size, hidden]; QEfficient's Llama 4 "
            "programs use rank-2 vision_embeds and a batchless vision program"
        ),
        multi_resolution=yes("tiles of 336 px plus a global tile; a vision specialization per tile count"),
        chunk_split=yes(
            "causal attention over image tokens; a chunk may end inside a tile or at a separator"
        ),
        video=no("Llama 4 takes images only"),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the tiling ViT composed in, run once per prompt in the first chunk "
            "over the tiles of all its images (tile counts may differ); the fixed tile side is the "
            "symbol pixel_side (1 in keep entries); later chunks and decode read the rows"
        ),
    )
    vision_input_axes = {symbols.PIXEL_VALUES: {0: MAX_NUM_TILES}}
    layout = (ImageMarkers(between=2), PlaceholderRuns())  # <|image_end|> and the next <|image_start|>

    text_defaults = {"attention_chunk_size": TEXT_DEFAULTS["attention_chunk_size"]}
    text_defaults_source = "transformers' Llama4TextConfig default"

    # ---- config view ----

    def default_layer_types(self, text: Section, num_layers: int) -> Sequence[str]:
        """RoPE layers are ``chunked_attention``, NoPE layers ``full_attention`` (no ``layer_types``).

        transformers' derivation (``Llama4TextConfig.__post_init__``): ``no_rope_layers[i]`` is 1
        on RoPE layers, by default all but every ``no_rope_layer_interval``-th. Checkpoints saved
        before ``layer_types`` existed (Scout's and Maverick's config.json) have only the flags.
        """
        rope = text.optional("no_rope_layers", list)
        if not rope:  # the interval is read (and its default noted) only when the flags are absent
            interval = text.default(
                "no_rope_layer_interval",
                TEXT_DEFAULTS["no_rope_layer_interval"],
                int,
                self.text_defaults_source,
            )
            rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        return [CHUNKED_ATTENTION if flag else FULL_ATTENTION for flag in rope]

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> Llama4View:
        """Tiles, patches, pixel shuffle and the image markers' ids.

        ``vision_config.image_size`` (the tile side) is required: the processor cuts tiles of the
        tower's size, and no default fits every checkpoint.
        """
        top = reader.section(model.config)
        vision = top.sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        return Llama4View(
            tile=vision.required("image_size"),
            max_tiles=processor.default(
                "max_patches", PROCESSOR_DEFAULTS["max_patches"], int, DEFAULTS_SOURCE
            ),
            patch=vision.default("patch_size", VISION_DEFAULTS["patch_size"], int, DEFAULTS_SOURCE),
            shuffle_ratio=vision.default(
                "pixel_shuffle_ratio", VISION_DEFAULTS["pixel_shuffle_ratio"], float, DEFAULTS_SOURCE
            ),
            image_start=top.default(
                "boi_token_index", CONFIG_DEFAULTS["boi_token_index"], int, DEFAULTS_SOURCE
            ),
            image_end=top.default(
                "eoi_token_index", CONFIG_DEFAULTS["eoi_token_index"], int, DEFAULTS_SOURCE
            ),
            processor_size=dict(processor.sub("size").data),
        )

    # ---- token math ----

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only; the processor must cut tiles of the tower's size."""
        problems = ["frames must be 1: Llama 4 takes images only"] if image.frames != 1 else []
        view = self.vision(model)
        size = view.processor_size
        wanted = {int(size[k]) for k in ("height", "width") if k in size}
        if wanted and wanted != {view.tile}:
            problems.append(f"the processor cuts tiles of {size}, but the vision tower takes {view.tile} px")
        return problems

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """Every tile is ``tile`` px square; the vision graph's only symbol is the tile count."""
        return self.vision(model).tile

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """The tower per tile (patches + CLS), the tiles side by side, not blocked."""
        heads = tower_value(model, ("num_attention_heads",), 16)  # Llama4VisionConfig default
        view = self.vision(model)
        rows = (view.tile // view.patch) ** 2 + 1
        return VisionAttention(heads, rows, rows, int(values[MAX_NUM_TILES]))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """max_num_tiles (the grid plus the global tile) and vision_size (their tokens)."""
        view = self.vision(model)
        tiles = view.tiles(image.height, image.width)
        return {MAX_NUM_TILES: tiles, symbols.VISION_SIZE: tiles * view.tokens_per_tile}

    def image_extent(self, model: ModelDescription, image: ImageSize) -> int:
        """First ``<|patch|>`` to the last: the tiles, their separators, then ``<|image|>`` + global tile."""
        view = self.vision(model)
        rows, cols = view.tile_grid(image.height, image.width)
        per_tile = view.tokens_per_tile
        if rows * cols == 1:
            return per_tile
        # Each row: its tiles, cols - 1 x-separators and one y-separator; then <|image|> and the global tile.
        return rows * (cols * per_tile + cols) + 1 + per_tile


def _host():
    """The host protocol class (numpy only)."""
    from qeff_vision.families.llama4.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.llama4.export import Adapter

    return Adapter


register(Llama4, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
