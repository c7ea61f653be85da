"""Llama 3.2 Vision (mllama): a tiled vision encoder feeding cross-attention layers (cross-attention kind).

The decoder does not merge image rows into the token sequence. Every image is one ``<|image|>``
token; dedicated cross-attention layers attend to the vision states of all the request's images,
and the processor's ``cross_attention_mask`` [batch, tokens, images, tiles] says which image (and
which of its real tiles) each text token sees (ref: transformers v5
models/mllama/processing_mllama.py, ``get_cross_attention_token_mask``: a token sees the images
from the last ``<|image|>`` run before it; tokens before the first image see none).

Tiling (ref: models/mllama/image_processing_mllama.py, ``get_optimal_tiled_canvas``): the canvas is
the tile arrangement (at most ``max_num_tiles`` tiles of ``image_size`` px) that upscales the image
least, or else downscales it least; ties go to the smaller canvas. Whatever the arrangement, the
vision program always takes ``max_num_tiles`` tiles per image (padding tiles masked by
``aspect_ratio_mask``), so its shapes depend only on how many images a request may carry: the
cross-attention states of one image are max_num_tiles * (patches + 1) rows (4 * 1,601 = 6,404 for
Llama 3.2 11B Vision), independent of the image size.

The vision program therefore produces, for every cross-attention layer, the key and value states
[batch, kv_heads, max_num_images * max_num_tiles * (patches + 1), head_dim]; the language program
takes them as retained state, so they cross to the device once per request and every prefill chunk
and decode step reuses them. There is no ``vision_size`` axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.contract.language_io import KV_ROLES, DType, Fixed, IORow, Role
from qeff_vision.contract.states import CrossAttention, FullAttention, LayerState
from qeff_vision.families import register
from qeff_vision.families.base import (
    CROSS_ATTENTION,
    DISAGGREGATED_PROGRAMS,
    NO_DEEPSTACK,
    NO_VIDEO_PRUNING,
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
from qeff_vision.families.config_view import ConfigReader, merged_text_config
from qeff_vision.families.mllama.tiny import write_tiny_checkpoint  # torch-free until called

# QEfficient's names (models/mllama/modeling_mllama.py, get_onnx_dynamic_axes).
MAX_NUM_IMAGES = symbols.MAX_NUM_IMAGES
ASPECT_RATIO_IDS = "aspect_ratio_ids"
ASPECT_RATIO_MASK = "aspect_ratio_mask"
CROSS_ATTENTION_MASK = symbols.CROSS_ATTENTION_MASK
# Rows of the cross-attention K/V: max_num_images * max_num_tiles * (patches + 1). QEfficient pins
# it at export; here it is a symbol so one export serves any max_images.
CROSS_STATES = "cross_states"
# Tiles per image: static in the graph (every image is padded to max_num_tiles).
MAX_NUM_TILES = Fixed("max_num_tiles")

# ref: transformers v5 MllamaVisionConfig defaults (image_size 448 there; Llama 3.2 Vision sets 560).
VISION_DEFAULTS: dict[str, Any] = {"image_size": 448, "patch_size": 14, "max_num_tiles": 4}


def supported_aspect_ratios(max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) arrangements of at most ``max_tiles`` tiles, in transformers' order; id = index + 1."""
    return [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1) if w * h <= max_tiles]


@lru_cache(maxsize=1024)
def tiled_canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """(canvas height, canvas width) the processor resizes an image of ``height`` x ``width`` into.

    transformers treats each arrangement's first number as the canvas height (the set is symmetric).
    """
    canvases = [(a * tile, b * tile) for a, b in supported_aspect_ratios(max_tiles)]
    scales = [min(ch / height, cw / width) for ch, cw in canvases]
    upscales = [s for s in scales if s >= 1]
    chosen = min(upscales) if upscales else max(s for s in scales if s < 1)
    candidates = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(candidates, key=lambda c: c[0] * c[1])


@dataclass(frozen=True)
class MllamaVision:
    """The tiling geometry and cross-attention layers of a Llama 3.2 Vision checkpoint, read once.

    Attributes:
        image_size: Side of one tile in pixels.
        patch_size: Pixels per patch side.
        max_num_tiles: Tiles per image (every image is padded to this many).
        cross_layers: Indices of the decoder's cross-attention layers.
    """

    image_size: int
    patch_size: int
    max_num_tiles: int
    cross_layers: tuple[int, ...]


def _images_seen_after_first_token(shape: tuple[int, ...], values, image_token_id: int) -> np.ndarray:
    """Trace example of the cross-attention mask: every token but the first sees the images.

    Both branches of the mask (a token that sees images, one that sees none) exist in the graph.
    """
    mask = np.zeros(shape, dtype=np.int64)
    mask[:, 1:] = 1
    return mask


class Mllama(Family):
    """Llama 3.2 Vision (MllamaForConditionalGeneration), e.g. meta-llama/Llama-3.2-11B-Vision-Instruct."""

    name = "mllama"
    title = "Llama 3.2 Vision"
    architectures = ("MllamaForConditionalGeneration",)
    model_types = ("mllama",)
    decoder_kind = CROSS_ATTENTION
    image_token_key = "image_token_index"
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes("dual program: vision -> cross-attention K/V, retained by the language program"),
        dynamic_vision_size=no(
            "cross-attention decoder: images enter as the cross-attention layers' key/value states, "
            "never as rows in the token sequence, so the language program has no vision_size axis"
        ),
        multi_resolution=yes("any size: up to 4 tiles of 560 px, padded to 4 with an aspect-ratio id"),
        chunk_split=yes("one <|image|> token per image; every chunk attends to whole images"),
        video=no("Llama 3.2 Vision takes images only"),
        # QEfficient (pinned quic/efficient-transformers models/mllama/modeling_mllama.py) defines no
        # continuous-batching IO for mllama; ours is its generic one (batch_index, full_batch_size
        # on every cache's dim 0) applied to the cross K/V too (docs/design.md).
        continuous_batching=yes(
            "cross-attention K/V held per KV slot (dim 0 full_batch_size); the host writes a request's "
            "image states into its slot, each row reads its own"
        ),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the tiled tower composed in, run once per prompt in the first chunk "
            "over all its images, writing their cross-attention K/V into the retained caches; the "
            "tile side is the symbol pixel_side (1 in keep entries); later chunks and decode read them"
        ),
        deepstack=NO_DEEPSTACK,
        comp_ctx_lengths=no("not supported for the cross-attention decoder kind yet"),
    )
    # The vision graph's batch is the language batch; its image count is max_num_images.
    layout = (SingleProgramGate(images_symbol=MAX_NUM_IMAGES),)
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 1: MAX_NUM_IMAGES},
        ASPECT_RATIO_IDS: {0: symbols.BATCH_SIZE, 1: MAX_NUM_IMAGES},
        ASPECT_RATIO_MASK: {0: symbols.BATCH_SIZE, 1: MAX_NUM_IMAGES},
    }
    # Which image (and tile) each token sees; no vision_embeds / image_idx (decoder_kind).
    extra_language_inputs = (
        IORow(
            CROSS_ATTENTION_MASK,
            Role.CROSS_MASK,
            DType.INT64,
            (symbols.BATCH_SIZE, symbols.SEQ_LEN, MAX_NUM_IMAGES, MAX_NUM_TILES),
            example=_images_seen_after_first_token,
        ),
    )

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> MllamaVision:
        """Tile geometry over ``MllamaVisionConfig``'s defaults; the cross-attention layer list."""
        vision = reader.section(model.config).sub("vision_config")
        text = reader.section(merged_text_config(model.config, self.text_config_key), self.text_config_key)
        source = "transformers' MllamaVisionConfig default"
        return MllamaVision(
            image_size=vision.default("image_size", VISION_DEFAULTS["image_size"], int, source),
            patch_size=vision.default("patch_size", VISION_DEFAULTS["patch_size"], int, source),
            max_num_tiles=vision.default("max_num_tiles", VISION_DEFAULTS["max_num_tiles"], int, source),
            cross_layers=tuple(int(i) for i in text.required("cross_attention_layers", list)),
        )

    def tiles(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """(tile rows, tile columns) of one image: its aspect-ratio arrangement."""
        vision = self.vision(model)
        tile = vision.image_size
        canvas_h, canvas_w = tiled_canvas(image.height, image.width, vision.max_num_tiles, tile)
        return canvas_h // tile, canvas_w // tile

    def aspect_ratio_id(self, model: ModelDescription, image: ImageSize) -> int:
        """The processor's ``aspect_ratio_ids`` value for this image (1-based; 0 pads)."""
        return supported_aspect_ratios(self.vision(model).max_num_tiles).index(self.tiles(model, image)) + 1

    def states_per_image(self, model: ModelDescription) -> int:
        """Cross-attention rows of one image: max_num_tiles * (patches + 1), whatever its size."""
        vision = self.vision(model)
        patches = (vision.image_size // vision.patch_size) ** 2 + 1
        return vision.max_num_tiles * patches

    def image_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """One ``<|image|>`` token per image, whatever its size."""
        return 1

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """Every tile's rows (patches + CLS, padded to 8) attend to all tiles', in query blocks."""
        heads = tower_value(model, ("attention_heads", "num_attention_heads"), 16)
        vision = self.vision(model)
        patches = (vision.image_size // vision.patch_size) ** 2 + 1
        tile = patches + (8 - patches % 8) % 8  # families/mllama/export.py tile_rows
        rows = tile * vision.max_num_tiles
        parallel = count_symbol(values, MAX_NUM_IMAGES)
        return VisionAttention(
            heads, rows, rows, parallel, policy.vision_count(heads, rows, 2)
        )  # export.IMAGES

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """One image per vision call; its cross states; vision_size 1 (its one placeholder)."""
        return {MAX_NUM_IMAGES: 1, CROSS_STATES: self.states_per_image(model), symbols.VISION_SIZE: 1}

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """The tile side: fixed in the vision graph (``deployment: single`` makes it a symbol)."""
        return self.vision(model).image_size

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only."""
        return [] if image.frames == 1 else ["frames must be 1: Llama 3.2 Vision takes images only"]

    def layer_caches(self, model: ModelDescription) -> list[LayerState]:
        """Cross-attention layers keep the vision K/V (``cross_states`` rows), the others ``ctx_len``."""
        cross = set(self.vision(model).cross_layers)
        return [
            CrossAttention(CROSS_STATES) if i in cross else FullAttention()
            for i in range(len(self.layer_types(model)))
        ]

    def kv_cache_lengths(self, model: ModelDescription, ctx_len: int) -> dict[str, int]:
        """ctx_len, and one image's cross states (the host concatenates one block per image)."""
        return {symbols.CTX_LEN: ctx_len, CROSS_STATES: self.states_per_image(model)}

    def request_symbols(self, model: ModelDescription, max_images: int) -> dict[str, int]:
        """max_num_images, and the cross states of that many images (QEfficient pins both at export)."""
        return {MAX_NUM_IMAGES: max_images, CROSS_STATES: max_images * self.states_per_image(model)}

    def vision_outputs(self, model: ModelDescription) -> dict[str, dict[int, str]]:
        """Key and value states of every cross-attention layer, QEfficient's names."""
        cross = set(self.vision(model).cross_layers)
        return {
            row.name: row.axes for row in self.language_table(model).rows(*KV_ROLES) if row.layer in cross
        }

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """Tiles per image: the static last axis of ``cross_attention_mask``."""
        return {MAX_NUM_TILES: self.vision(model).max_num_tiles}


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.mllama.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.mllama.export import Adapter

    return Adapter


register(Mllama, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
