"""Gemma 4: patch-list vision tower with a position-driven pooler; a decoder with per-layer cache shapes.

Token math (ref: transformers v5.23 models/gemma4/image_processing_gemma4.py,
``get_aspect_ratio_preserving_size``): the processor resizes an image, keeping its aspect ratio,
to the largest size whose sides are multiples of ``pooling_kernel_size * patch_size`` and whose
patch count is at most ``max_soft_tokens * pooling_kernel_size**2``; it sends the patches as a list
([patches, 3 * patch_size**2]) padded to that budget, with ``image_position_ids`` (x, y) per patch
and (-1, -1) on padding. The tower pools every k x k block of patches into one soft token, so an
image is ``patches / k**2`` placeholders, between a begin- and an end-of-image token.

The host strips the padding (:mod:`qeff_vision.families.gemma4.host`), so the vision program
sees exactly an image's patches: one specialization per resolution (symbol ``num_patches``), and
the tower's boolean-mask stripping of padded rows, which does not trace, never has rows to strip.

The decoder breaks three assumptions of one-shape caches (:meth:`Gemma4.layer_caches`): full
layers have a wider head (``global_head_dim``) and, with ``attention_k_eq_v``, their own KV-head
count (``num_global_key_value_heads``); the last ``num_kv_shared_layers`` layers compute no K/V and
read the cache of the last earlier layer of their type, so they have no cache rows at all.
Every raw config read of the family is in :class:`Gemma4Config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_vision import symbols
from qeff_vision.contract.language_io import Fixed, LayerCache
from qeff_vision.errors import UserError
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    FULL_ATTENTION,
    NO_DEEPSTACK,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    SINGLE_PROGRAM_NOT_BUILT,
    SLIDING_ATTENTION,
    Family,
    Features,
    ImageSize,
    ModelDescription,
    TextDims,
    no,
    yes,
)
from qeff_vision.families.gemma4.tiny import write_tiny_checkpoint  # torch-free until called

#: Patches of one image (the vision program's patch-list axis; one value per resolution).
NUM_PATCHES = "num_patches"
IMAGE_POSITION_IDS = "image_position_ids"
#: Model dimensions of the full layers' caches.
GLOBAL_KV_HEADS = Fixed("num_global_kv_heads")
GLOBAL_HEAD_DIM = Fixed("global_head_dim")
#: The processor's image budgets (ref: image_processing_gemma4.py, ``_SUPPORTED_SOFT_TOKENS``).
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# Defaults of transformers v5.23 ``Gemma4ImageProcessor`` / ``Gemma4VisionConfig`` (a pinned
# config snapshot has no processor config).
PATCH_SIZE, POOLING_KERNEL_SIZE, MAX_SOFT_TOKENS = 16, 3, 280


@dataclass(frozen=True)
class Gemma4Config:
    """The family's view of a checkpoint: every raw config.json read, over transformers' defaults.

    Defaults are those of transformers v5.23 ``Gemma4TextConfig`` / ``Gemma4Config`` (ref:
    models/gemma4/configuration_gemma4.py). A config saved by transformers has
    ``per_layer_config`` (layer -> head_dim / num_key_value_heads overrides); a published one
    has ``global_head_dim`` and ``num_global_key_value_heads``, which ``__post_init__`` turns into
    the same overrides of the full layers.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...]
    num_kv_shared_layers: int
    bidirectional: str | None  # use_bidirectional_attention: None, "vision" or "all"
    image_token_id: int
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int

    @classmethod
    def read(cls, model: ModelDescription) -> Gemma4Config:
        """The view of ``model`` (a user error naming a missing or impossible value)."""
        try:
            return cls._read(model)
        except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type
            raise UserError(f"{model.source}: unusable Gemma 4 config value ({exc})") from None

    @classmethod
    def _read(cls, model: ModelDescription) -> Gemma4Config:
        config = model.config
        text = dict(config.get("text_config") or {})
        layers = int(text.get("num_hidden_layers", 30))
        types = list(text.get("layer_types") or [])
        if not types:  # every 6th layer is full (Gemma4TextConfig.__post_init__)
            types = [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(layers)]
        types[-1] = FULL_ATTENTION  # transformers forces the last layer to full attention
        if text.get("use_bidirectional_attention") == "all":
            raise UserError(
                f"{model.source}: use_bidirectional_attention 'all' (every token both ways, a halved "
                "window) is not a causal decoder; only None and 'vision' are supported"
            )
        if len(types) != layers:
            raise UserError(f"{model.source}: {len(types)} layer_types for {layers} layers")
        kv_heads = int(text.get("num_key_value_heads", 4))
        head_dim = int(text.get("head_dim", 256))
        overrides = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
        if not overrides:
            full = {"head_dim": int(text.get("global_head_dim") or 512)}
            global_kv = text.get("num_global_key_value_heads")
            if text.get("attention_k_eq_v") and global_kv is not None:
                full["num_key_value_heads"] = int(global_kv)
            overrides = {i: full for i, kind in enumerate(types) if kind == FULL_ATTENTION}
        every = range(layers)
        processor, vision = model.processor, dict(config.get("vision_config") or {})
        return cls(
            hidden_size=int(text.get("hidden_size", 2304)),
            num_layers=layers,
            num_heads=int(text.get("num_attention_heads", 8)),
            kv_heads=tuple(int(overrides.get(i, {}).get("num_key_value_heads", kv_heads)) for i in every),
            head_dims=tuple(int(overrides.get(i, {}).get("head_dim", head_dim)) for i in every),
            vocab_size=int(text.get("vocab_size", 262_144)),
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            sliding_window=int(text.get("sliding_window", 512)),
            layer_types=tuple(types),
            num_kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
            bidirectional=text.get("use_bidirectional_attention"),
            image_token_id=int(config.get("image_token_id", 258_880)),
            patch_size=int(processor.get("patch_size") or vision.get("patch_size") or PATCH_SIZE),
            pooling_kernel_size=int(vision.get("pooling_kernel_size") or POOLING_KERNEL_SIZE),
            max_soft_tokens=int(processor.get("max_soft_tokens") or MAX_SOFT_TOKENS),
        )

    def reads(self, layer: int) -> int | None:
        """The layer whose cache ``layer`` reads, or None when it has its own.

        The last ``num_kv_shared_layers`` layers read the last earlier non-shared layer of their
        type (ref: configuration_gemma4.py, ``Gemma4TextConfig.kv_sharing_modes``).
        """
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer]
        producers = [i for i in range(first_shared) if self.layer_types[i] == kind]
        if not producers:
            raise UserError(f"shared layer {layer} ({kind}) has no earlier {kind} layer to read")
        return producers[-1]

    def full_layer(self) -> int:
        """The first full-attention layer (its cache shape is every full layer's)."""
        return self.layer_types.index(FULL_ATTENTION)


class Gemma4(Family):
    """Gemma 4 (E2B, E4B, 26B-A4B and 31B instruction-tuned and pretrained checkpoints)."""

    name = "gemma4"
    title = "Gemma 4"
    architectures = ("Gemma4ForConditionalGeneration",)
    model_types = ("gemma4",)
    features = Features(
        export=yes("per-layer cache shapes; shared-KV layers keep no cache; MoE experts computed densely"),
        dynamic_vision_size=yes(),
        multi_resolution=yes("aspect-preserving resize: one vision specialization per resolution"),
        chunk_split=yes(
            "per checkpoint: E2B/E4B attend causally and split images; with use_bidirectional_attention "
            "'vision' (26B-A4B, 31B) an image attends both ways on sliding layers and moves whole"
        ),
        video=no("video frames are not exported yet (images only; audio is refused)"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=SINGLE_PROGRAM_NOT_BUILT,
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 1: NUM_PATCHES},
        IMAGE_POSITION_IDS: {0: symbols.BATCH_SIZE, 1: NUM_PATCHES},
    }
    # <|image> and <image|> always separate two images' soft tokens.
    tokens_between_images = 2
    # The image budget (spec key vision.image_processor.max_soft_tokens).
    image_processor_options = {"max_soft_tokens": SOFT_TOKEN_BUDGETS}

    # ---- config normalization (all through Gemma4Config) ----

    def config(self, model: ModelDescription) -> Gemma4Config:
        """The family's view of ``model``'s config."""
        return Gemma4Config.read(model)

    def text_dims(self, model: ModelDescription) -> TextDims:
        """Dimensions of the sliding layers (the full layers' own are in :meth:`layer_caches`)."""
        view = self.config(model)
        kinds = view.layer_types
        sliding = kinds.index(SLIDING_ATTENTION) if SLIDING_ATTENTION in kinds else 0
        return TextDims(
            hidden_size=view.hidden_size,
            num_layers=view.num_layers,
            num_attention_heads=view.num_heads,
            num_kv_heads=view.kv_heads[sliding],
            head_dim=view.head_dims[sliding],
            vocab_size=view.vocab_size,
            max_position_embeddings=view.max_position_embeddings,
        )

    def image_token_id(self, model: ModelDescription) -> int:
        """``image_token_id`` (258880 when the config leaves it out)."""
        return self.config(model).image_token_id

    def layer_types(self, model: ModelDescription) -> list[str]:
        """``layer_types``, or every sixth layer full; the last is always full."""
        return list(self.config(model).layer_types)

    def kv_cache_symbols(self, model: ModelDescription) -> list[str]:
        """Sliding layers keep a ring of ``sliding_window`` slots, full layers the whole context."""
        return [
            symbols.SLIDING_WINDOW if kind == SLIDING_ATTENTION else symbols.CTX_LEN
            for kind in self.layer_types(model)
        ]

    def kv_cache_lengths(self, model: ModelDescription, ctx_len: int) -> dict[str, int]:
        """``ctx_len`` and the window (never longer than the context)."""
        window = min(self.config(model).sliding_window, ctx_len)
        return {symbols.CTX_LEN: ctx_len, symbols.SLIDING_WINDOW: window}

    def layer_caches(self, model: ModelDescription) -> list[LayerCache]:
        """Sliding layers: ``num_kv_heads`` x ``head_dim``; full layers: their own heads and width.

        A shared layer (the last ``num_kv_shared_layers``) reads its producer's cache: no rows.
        """
        view = self.config(model)
        caches = []
        for layer, symbol in enumerate(self.kv_cache_symbols(model)):
            if view.layer_types[layer] == FULL_ATTENTION:
                caches.append(LayerCache(symbol, GLOBAL_KV_HEADS, GLOBAL_HEAD_DIM, view.reads(layer)))
            else:
                caches.append(LayerCache(symbol, reads=view.reads(layer)))
        return caches

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """The full layers' KV heads and head dim (model dimensions of their cache rows)."""
        view = self.config(model)
        if FULL_ATTENTION not in view.layer_types:
            return {}
        full = view.full_layer()
        return {GLOBAL_KV_HEADS: view.kv_heads[full], GLOBAL_HEAD_DIM: view.head_dims[full]}

    def splits_images(self, model: ModelDescription) -> bool:
        """Causal image attention (E2B/E4B) splits; ``use_bidirectional_attention`` keeps images whole."""
        return self.config(model).bidirectional is None

    # ---- token math ----

    def resized(self, model: ModelDescription, image: ImageSize) -> tuple[int, int]:
        """The processor's aspect-preserving resize into the ``max_soft_tokens`` budget.

        ref: transformers v5.23 models/gemma4/image_processing_gemma4.py,
        ``get_aspect_ratio_preserving_size``.
        """
        view = self.config(model)
        patch, kernel = view.patch_size, view.pooling_kernel_size
        max_patches = view.max_soft_tokens * kernel * kernel
        side = kernel * patch
        factor = (max_patches * patch * patch / (image.height * image.width)) ** 0.5
        height = int(factor * image.height // side) * side
        width = int(factor * image.width // side) * side
        longest = (max_patches // (kernel * kernel)) * side
        if height == 0 and width == 0:
            raise UserError(f"{image.height}x{image.width} resizes to nothing")
        if height == 0:
            height, width = side, min(int(image.width // image.height) * side, longest)
        elif width == 0:
            width, height = side, min(int(image.height // image.width) * side, longest)
        return height, width

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Images only, a budget the processor accepts, and a resize that leaves some patches."""
        problems = []
        if image.frames != 1 or image.video:
            problems.append("frames must be 1: Gemma 4 is exported for images only")
        budget = self.config(model).max_soft_tokens
        if budget not in SOFT_TOKEN_BUDGETS:
            problems.append(f"max_soft_tokens {budget} is not one of {SOFT_TOKEN_BUDGETS}")
        try:
            self.resized(model, image)
        except UserError as exc:
            problems.append(str(exc))
        return problems

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """``num_patches`` of the resized image and its soft tokens (``vision_size``)."""
        view = self.config(model)
        height, width = self.resized(model, image)
        patches = (height // view.patch_size) * (width // view.patch_size)
        return {NUM_PATCHES: patches, symbols.VISION_SIZE: patches // view.pooling_kernel_size**2}


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.gemma4.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.gemma4.export import Adapter

    return Adapter


register(Gemma4, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
