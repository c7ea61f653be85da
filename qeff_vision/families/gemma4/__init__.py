"""Gemma 4: patch-list vision tower with a position-driven pooler; a decoder with per-layer cache shapes.

Token math (ref: transformers v5.23 models/gemma4/image_processing_gemma4.py,
``get_aspect_ratio_preserving_size``): the processor resizes an image, keeping its aspect ratio,
to the largest size whose sides are multiples of ``pooling_kernel_size * patch_size`` and whose
patch count is at most ``max_soft_tokens * pooling_kernel_size**2``; it sends the patches as a list
([patches, 3 * patch_size**2]) padded to that budget, with ``image_position_ids`` (x, y) per patch
and (-1, -1) on padding. The tower pools every k x k block of patches into one soft token, so an
image is ``patches / k**2`` placeholders, between a begin- and an end-of-image token.

The vision program takes the padded list as the processor makes it and vLLM sends it: symbol
``max_patches`` (QEfficient's name for the same axis) binds the budget, so one specialization
serves every resolution; padded patches are masked (:mod:`qeff_vision.families.gemma4.export`) and
the output's ``vision_size`` = ``max_soft_tokens`` rows hold the image's own soft tokens first.
The prompt takes only those (:meth:`Gemma4.image_tokens`; the host's ``own_rows``), as
transformers strips the rest with a boolean mask that does not trace.

The decoder breaks three assumptions of one-shape caches (:meth:`Gemma4.layer_caches`): full
layers have a wider head (``global_head_dim``) and, with ``attention_k_eq_v``, their own KV-head
count (``num_global_key_value_heads``); the last ``num_kv_shared_layers`` layers compute no K/V and
read the cache of the last earlier layer of their type, so they have no cache rows at all.
Every raw config read of the family is in its typed view,
:class:`~qeff_vision.families.gemma4.config.Gemma4Config`.
"""

from __future__ import annotations

from collections.abc import Sequence

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import VisionAttention
from qeff_vision.contract.states import FullAttention, LayerState, SharedKV, SlidingRing
from qeff_vision.errors import UserError
from qeff_vision.families import register
from qeff_vision.families.base import (
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
    SingleProgramGate,
    count_symbol,
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.gemma4.config import (
    IMAGE_TOKEN_DEFAULT,
    TEXT_DEFAULTS,
    TEXT_DEFAULTS_SOURCE,
    Gemma4Config,
    default_layer_types,
    read_gemma4_config,
)
from qeff_vision.families.gemma4.tiny import write_tiny_checkpoint  # torch-free until called

#: Patches of one image's list, padded to the budget (the vision program's patch-list axis). QEfficient's
#: name and value (ref: quic/efficient-transformers QEffGemma4ForConditionalGeneration.get_onnx_dynamic_axes),
#: so vllm-qaic, which sends the processor's padded list, and QEfficient tooling see the same binding.
MAX_PATCHES = "max_patches"
IMAGE_POSITION_IDS = "image_position_ids"
#: The processor's image budgets (ref: image_processing_gemma4.py, ``_SUPPORTED_SOFT_TOKENS``).
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


class Gemma4(Family):
    """Gemma 4 (E2B, E4B, 26B-A4B and 31B instruction-tuned and pretrained checkpoints)."""

    name = "gemma4"
    title = "Gemma 4"
    architectures = ("Gemma4ForConditionalGeneration",)
    model_types = ("gemma4",)
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(
            "per-layer cache shapes; shared-KV layers keep no cache; MoE experts routed (k slices per "
            "token at decode)"
        ),
        dynamic_vision_size=yes(),
        multi_resolution=yes(
            "aspect-preserving resize into a padded patch list: one vision specialization (the "
            "max_soft_tokens budget) serves every resolution"
        ),
        chunk_split=yes(
            "per checkpoint: E2B/E4B attend causally and split images; with use_bidirectional_attention "
            "'vision' (26B-A4B, 31B) an image attends both ways on sliding layers and moves whole"
        ),
        video=no("video frames are not exported yet (images only; audio is refused)"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the patch-sequence tower composed in, gated on the patch count (the "
            "placeholder has 1 patch); one encode call per image in the first chunk (its output is "
            "padded to the patch budget, the next image written over the padding)"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {
        symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 1: MAX_PATCHES},
        IMAGE_POSITION_IDS: {0: symbols.BATCH_SIZE, 1: MAX_PATCHES},
    }
    former_symbols = {"num_patches": MAX_PATCHES}
    # deployment single: the patch axis gates the encoder (an image has at least one pooled cell of
    # pooling_kernel_size^2 = 9 patches, the keep placeholder 1).
    # <|image> and <image|> always separate two images' soft tokens.
    layout = (SingleProgramGate(encode_axis=1), ImageMarkers(between=2))
    # The image budget (spec key vision.image_processor.max_soft_tokens).
    image_processor_options = {"max_soft_tokens": SOFT_TOKEN_BUDGETS}

    text_defaults = TEXT_DEFAULTS
    text_defaults_source = TEXT_DEFAULTS_SOURCE
    image_token_default = IMAGE_TOKEN_DEFAULT
    last_layer_type = FULL_ATTENTION  # Gemma4TextConfig forces the last layer to full attention

    # ---- config view (every raw read in gemma4/config.py) ----

    def default_layer_types(self, text: Section, num_layers: int) -> Sequence[str]:
        """Every sixth layer full (Gemma4TextConfig's rule when ``layer_types`` is not listed)."""
        return default_layer_types(num_layers)

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> Gemma4Config:
        """The family's typed view: per-layer caches, KV sharing, image attention and geometry."""
        return read_gemma4_config(
            reader, model.config, model.processor, self.text_geometry(model), model.source
        )

    def config(self, model: ModelDescription) -> Gemma4Config:
        """The family's typed view of ``model``'s config (read once)."""
        return self.vision(model)

    def layer_caches(self, model: ModelDescription) -> list[LayerState]:
        """Sliding layers keep a ``sliding_window`` ring, full layers a ``ctx_len`` cache of their own.

        Each state carries its layer's KV heads and head dim (the view's ``kv_heads`` /
        ``head_dims``): a full layer's are ``num_global_key_value_heads`` x ``global_head_dim``,
        a ring's the config's ``num_key_value_heads`` x ``head_dim``. A shared layer (the last
        ``num_kv_shared_layers``) reads its producer's cache: no rows.
        """
        view = self.config(model)
        states: list[LayerState] = []
        for layer, layer_type in enumerate(view.layer_types):
            shape = (view.kv_heads[layer], view.head_dims[layer])
            if view.reads(layer) is not None:
                states.append(SharedKV(view.reads(layer)))
            elif layer_type == FULL_ATTENTION:
                states.append(FullAttention(symbols.CTX_LEN, *shape))
            else:
                states.append(SlidingRing(symbols.SLIDING_WINDOW, *shape, span=view.sliding_window))
        return states

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

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """The padded patch list (max_patches) attends to itself, blocked for any image."""
        heads = tower_value(model, ("num_attention_heads",), 12)  # Gemma4VisionConfig default
        rows = int(values[MAX_PATCHES])
        parallel = count_symbol(values, symbols.BATCH_SIZE)
        return VisionAttention(heads, rows, rows, parallel, policy.vision_count(heads))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """``max_patches`` of the padded list and ``vision_size`` rows: the same for every image.

        ``max_patches`` is the budget's patches (the processor pads every image's list to it, and
        vLLM sends it so); ``vision_size`` the output's rows, ``max_soft_tokens`` (the resize keeps
        every image inside the budget).
        """
        view = self.config(model)
        kernel_area = view.pooling_kernel_size**2
        return {MAX_PATCHES: view.max_soft_tokens * kernel_area, symbols.VISION_SIZE: view.max_soft_tokens}

    def image_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """Soft tokens of the resized image (its real patches over the kernel's area).

        The placeholders it takes, and its leading rows of the vision output.
        """
        view = self.config(model)
        height, width = self.resized(model, image)
        patches = (height // view.patch_size) * (width // view.patch_size)
        return patches // view.pooling_kernel_size**2


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.gemma4.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.gemma4.export import Adapter

    return Adapter


register(Gemma4, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
