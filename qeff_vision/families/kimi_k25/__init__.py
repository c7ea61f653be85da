"""Kimi-K2.5: a MoonViT patch-sequence tower, a patch-merging projector, a DeepSeek-V3 decoder.

Token math (ref: transformers v5.23 models/kimi_k25/image_processing_kimi_k25.py, ``navit_resize``
and ``patchify``): the processor scales an image down (never up) until its patch count is at most
``max_patches`` and neither side exceeds ``size.max_height`` patches, then pads each side up to a
multiple of ``merge_size * patch_size`` pixels and sends the patches in raster order
([patches, 3, patch, patch]). The tower merges each 2x2 block of patches into one token, so an
image is ``grid_h * grid_w / 4`` placeholders (``<|media_pad|>``), wrapped in media markers.

The vision program takes QEfficient's inputs (ref: quic/efficient-transformers
QEfficient/transformers/models/kimi_k25/modeling_kimi_k25.py, ``QEffKimiK25EncoderWrapper``):
``pixel_values`` [num_patches, 3, P, P] and two int64 vectors ``h_shape`` [h] and ``w_shape`` [w]
whose lengths carry the patch grid, so one graph serves every resolution.

The decoder is DeepSeek-V3's (ref: transformers v5.23 models/deepseek_v3/modeling_deepseek_v3.py):
multi-head latent attention whose cache is, per position, the compressed KV (``kv_lora_rank``) and
the rotary key part (``qk_rope_head_dim``) shared by all heads, and a routed mixture of experts
(sigmoid scores, grouped top-k, a shared expert) after ``first_k_dense_replace`` dense layers.
The export (:mod:`qeff_vision.families.kimi_k25.export`) computes attention in the absorbed form,
so every call reads the latent cache only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.contract.states.latent import KV_LORA_RANK, QK_ROPE_HEAD_DIM, Absorption, LatentAttention
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
    single_program_not_built,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, ConfigView
from qeff_vision.families.kimi_k25.sizing import sizing_note
from qeff_vision.families.kimi_k25.tiny import write_tiny_checkpoint  # torch-free until called

#: QEfficient's vision symbols: patches of one call, patch rows and columns of its images.
NUM_PATCHES = "num_patches"
GRID_ROWS = "h"
GRID_COLUMNS = "w"
H_SHAPE = "h_shape"
W_SHAPE = "w_shape"

# Kimi_K25ImageProcessor's class defaults (ref: image_processing_kimi_k25.py), used when a config
# snapshot has no processor config: 16,384 patches, 512 patches per side.
DEFAULT_MAX_PATCHES = 16384
DEFAULT_MAX_SIDE = 512
PROCESSOR_DEFAULTS = "Kimi_K25ImageProcessor default"
# Kimi_K25VisionConfig / Kimi_K25Config defaults (ref: configuration_kimi_k25.py).
DEFAULT_PATCH_SIZE = 14
DEFAULT_MERGE = (2, 2)
DEFAULT_IMAGE_TOKEN = 163605
CONFIG_DEFAULTS = "Kimi_K25Config default"


@dataclass(frozen=True)
class KimiVision:
    """The vision geometry and the processor's resize budget of a Kimi-K2.5 checkpoint.

    Attributes:
        patch_size: Pixels per patch side.
        merge: Patches merged into one token along (rows, columns).
        max_patches: The processor's patch budget of one image.
        max_side: The processor's largest side, in patches.
    """

    patch_size: int
    merge: tuple[int, int]
    max_patches: int
    max_side: int


@dataclass(frozen=True)
class LatentDims:
    """The per-position latent cache of multi-head latent attention, read from the text config.

    Attributes:
        kv_lora_rank: Width of the compressed KV (``compressed_kv``).
        rope_dim: Width of the rotary key part shared by all heads (``k_pe``).
    """

    kv_lora_rank: int
    rope_dim: int

    @property
    def width(self) -> int:
        """Elements kept per position and layer."""
        return self.kv_lora_rank + self.rope_dim


class KimiK25(Family):
    """Kimi-K2.5 (moonshotai/Kimi-K2.5): MoonViT, a patch-merging projector and DeepSeek-V3 with MLA."""

    name = "kimi_k25"
    title = "Kimi-K2.5"
    architectures = ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration")
    model_types = ("kimi_k25",)
    image_token_default = DEFAULT_IMAGE_TOKEN
    features = Features(
        export=yes(
            "multi-head latent attention in the absorbed form (every call reads the latent cache "
            "only); experts routed: min(tokens x top_k, experts) slices per call"
        ),
        dynamic_vision_size=yes(),
        multi_resolution=yes("one vision graph; h_shape / w_shape carry the patch grid"),
        chunk_split=yes("causal attention over image tokens"),
        video=no("not exported yet: clips are frame chunks with timestamps (Kimi_K25VideoProcessor)"),
        video_pruning=NO_VIDEO_PRUNING,
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=single_program_not_built(
            "an encode entry of n images binds h and w to their sums (2 images of 8x12 "
            "patches gave 16x24), but h_shape / w_shape must carry one image's grid"
        ),
    )
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: NUM_PATCHES},
        H_SHAPE: {0: GRID_ROWS},
        W_SHAPE: {0: GRID_COLUMNS},
    }

    # ---- configs ----

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> KimiVision:
        """Patch size and merge kernel of the tower; the processor's patch budget."""
        vision = reader.section(model.config).sub("vision_config")
        processor = reader.section(model.processor, "preprocessor_config")
        merge = vision.default("merge_kernel_size", DEFAULT_MERGE, tuple, CONFIG_DEFAULTS)
        return KimiVision(
            patch_size=vision.default("patch_size", DEFAULT_PATCH_SIZE, int, CONFIG_DEFAULTS),
            merge=(int(merge[0]), int(merge[1])),
            max_patches=processor.default("max_patches", DEFAULT_MAX_PATCHES, int, PROCESSOR_DEFAULTS),
            max_side=processor.sub("size").default("max_height", DEFAULT_MAX_SIDE, int, PROCESSOR_DEFAULTS),
        )

    def latent_dims(self, model: ModelDescription) -> LatentDims:
        """Latent cache widths of every layer (``kv_lora_rank``, ``qk_rope_head_dim``)."""
        text = ConfigReader(model.source).section(self.text_config(model), self.text_config_key)
        return LatentDims(text.required("kv_lora_rank"), text.required("qk_rope_head_dim"))

    def config_view(self, model: ModelDescription) -> ConfigView:
        """The typed view, with what the checkpoint needs to compile (parameters, MXFP6, devices)."""
        view = super().config_view(model)
        return replace(
            view, notes=(*view.notes, sizing_note(model.config, self.latent_dims(model).width, model.source))
        )

    # ---- per-layer state ----

    def layer_caches(self, model: ModelDescription) -> list[LatentAttention]:
        """Every layer keeps the MLA latent cache, ``compressed_kv.{i}`` and ``k_pe.{i}``.

        Read in the absorbed form computed per call (QEfficient's ``mla_absorption`` with
        ``cache_compressed``, ``absorption`` and ``online``): the export never expands the cache
        into per-head keys and values.
        """
        return [LatentAttention(absorption=Absorption.ONLINE)] * self.text_dims(model).num_layers

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """The latent rows' widths: ``kv_lora_rank`` and ``qk_rope_head_dim``."""
        latent = self.latent_dims(model)
        return {KV_LORA_RANK: latent.kv_lora_rank, QK_ROPE_HEAD_DIM: latent.rope_dim}

    # ---- token math ----

    def grid(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """(patch rows, patch columns) of ``image`` after the processor's resize and padding."""
        vision = self.vision(model)
        patch = vision.patch_size
        rows, columns = max(1.0, image.height // patch), max(1.0, image.width // patch)
        scale = min(
            1.0,
            math.sqrt(vision.max_patches / (rows * columns)),
            vision.max_side * patch / image.height,
            vision.max_side * patch / image.width,
        )
        height = min(max(1, int(image.height * scale)), vision.max_side * patch)
        width = min(max(1, int(image.width * scale)), vision.max_side * patch)
        factor_h, factor_w = vision.merge[0] * patch, vision.merge[1] * patch
        padded_h = height + (factor_h - height % factor_h) % factor_h
        padded_w = width + (factor_w - width % factor_w) % factor_w
        return padded_h // patch, padded_w // patch

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Still images only (clips are not exported yet)."""
        if image.frames != 1 or image.video:
            return ["frames must be 1: the kimi_k25 family exports still images only"]
        return []

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """MoonViT: every patch of the call (masked per image), blocked for any image."""
        heads = tower_value(model, ("vt_num_attention_heads", "num_attention_heads"), 16)
        rows = int(values[NUM_PATCHES])
        return VisionAttention(heads, rows, rows, 1, policy.vision_count(heads))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """Patch count, grid rows and columns, and the merged tokens (vision_size) of one image."""
        rows, columns = self.grid(model, image)
        merge = self.vision(model).merge
        return {
            NUM_PATCHES: rows * columns,
            GRID_ROWS: rows,
            GRID_COLUMNS: columns,
            symbols.VISION_SIZE: rows * columns // (merge[0] * merge[1]),
        }


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.kimi_k25.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.kimi_k25.export import Adapter

    return Adapter


register(KimiK25, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
