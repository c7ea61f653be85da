"""LLaVA-1.5: a CLIP ViT tower at one fixed resolution, a two-layer MLP projector, a Llama decoder.

Token math (ref: transformers v5 models/llava/modeling_llava.py, ``LlavaModel.get_image_features``,
and processing_llava.py, ``LlavaProcessor.replace_image_token``): the processor resizes and
center-crops every image to the tower's ``image_size``, the tower makes one token per
``patch_size`` square plus a CLS token, and ``vision_feature_select_strategy: default`` drops the
CLS token. So every image becomes ``(image_size / patch_size)^2`` placeholders (336 / 14 -> 576),
whatever its original resolution, and one vision specialization serves every image.
``vision_feature_layer`` (a layer or a list of layers, concatenated on the hidden axis) changes
the features but not their count.
"""

from __future__ import annotations

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
    ImageSize,
    ModelDescription,
    count_symbol,
    no,
    tower_value,
    yes,
)
from qeff_vision.families.config_view import ConfigReader
from qeff_vision.families.llava.tiny import write_tiny_checkpoint  # torch-free until called

# QEfficient's name for the (square) spatial side of pixel_values, kept so our vision QPC's
# specialization reads like theirs (ref: quic/efficient-transformers
# QEfficient/transformers/models/llava/modeling_llava.py, ``get_onnx_dynamic_axes``).
IMG_SIZE = "img_size"
DEFAULT_STRATEGY = "default"  # drop the CLS token; "full" keeps it
STRATEGIES = (DEFAULT_STRATEGY, "full")
# The exported tower is CLIP's (class token, pre-layernorm); LlavaForConditionalGeneration
# checkpoints with other towers (SigLIP, Pixtral) are refused rather than exported wrongly.
VISION_MODEL_TYPES = ("clip_vision_model",)

# LlavaConfig's vision sub-config defaults (CLIP ViT-L/14 at 336 px), used when the config omits them.
DEFAULT_IMAGE_SIZE = 336
DEFAULT_PATCH_SIZE = 14
DEFAULTS_SOURCE = "LlavaConfig's CLIP ViT-L/14-336 default"
# Published LLaVA-1.5 configs keep only a few fields of the Vicuna text config; transformers fills
# the rest from LlamaConfig's defaults (ref: transformers v5 models/llama/configuration_llama.py).
LLAMA_DEFAULTS = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True)
class LlavaVision:
    """The vision geometry of a LLaVA-1.5 checkpoint, read once.

    Attributes:
        image_size: The tower's (square) input side.
        patch_size: Pixels per patch side.
        strategy: ``vision_feature_select_strategy``.
        tower: The vision sub-config's ``model_type``.
        crop: The processor's center crop (height, width), None when it does not crop.
    """

    image_size: int
    patch_size: int
    strategy: str
    tower: str
    crop: tuple[int, int] | None


class Llava(Family):
    """LLaVA-1.5 (llava-hf/llava-1.5-7b-hf, -13b-hf): LlavaForConditionalGeneration with a CLIP tower."""

    name = "llava"
    title = "LLaVA-1.5"
    architectures = ("LlavaForConditionalGeneration",)
    model_types = ("llava",)
    image_token_key = "image_token_index"
    features = Features(
        video_pruning=NO_VIDEO_PRUNING,
        export=yes(),
        dynamic_vision_size=yes(),
        multi_resolution=no(
            "not applicable: the processor resizes and center-crops every image to the tower's "
            "image_size (336 px in LLaVA-1.5), so one vision specialization serves every image"
        ),
        chunk_split=yes("causal attention over image tokens"),
        video=no("LLaVA-1.5 has no video input"),
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program: the CLIP tower composed in, run once per image in the first chunk; "
            "later chunks and decode read the retained rows"
        ),
        deepstack=NO_DEEPSTACK,
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )
    vision_input_axes = {symbols.PIXEL_VALUES: {0: symbols.BATCH_SIZE, 2: IMG_SIZE, 3: IMG_SIZE}}

    text_defaults = LLAMA_DEFAULTS
    text_defaults_source = "LlamaConfig default"

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> LlavaVision:
        """Tower geometry, feature strategy and the processor's crop."""
        top = reader.section(model.config)
        vision = top.sub("vision_config")
        image_size = vision.default("image_size", DEFAULT_IMAGE_SIZE, int, DEFAULTS_SOURCE)
        processor = reader.section(model.processor, "preprocessor_config")
        crop_section = processor.sub("crop_size")
        crop = None
        if (
            processor.default("do_center_crop", True, bool, "CLIPImageProcessor default")
            and crop_section.data
        ):
            crop = (
                crop_section.default("height", image_size, int, "the tower's image_size"),
                crop_section.default("width", image_size, int, "the tower's image_size"),
            )
        return LlavaVision(
            image_size=image_size,
            patch_size=vision.default("patch_size", DEFAULT_PATCH_SIZE, int, DEFAULTS_SOURCE),
            strategy=top.default(
                "vision_feature_select_strategy", DEFAULT_STRATEGY, str, "LlavaConfig default"
            ),
            tower=vision.default("model_type", VISION_MODEL_TYPES[0], str, "LlavaConfig default"),
            crop=crop,
        )

    def geometry(self, model: ModelDescription) -> tuple[int, int, str]:
        """(image_size, patch_size, vision_feature_select_strategy) of the checkpoint."""
        vision = self.vision(model)
        return vision.image_size, vision.patch_size, vision.strategy

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Any image size is fine (the processor resizes); the tower and processor must agree."""
        image_size, patch_size, strategy = self.geometry(model)
        problems = []
        tower = self.vision(model).tower
        if tower not in VISION_MODEL_TYPES:
            problems.append(f"vision tower {tower!r} is not supported; the llava family exports CLIP towers")
        if image.frames != 1:
            problems.append("frames must be 1: LLaVA-1.5 takes still images only")
        if image_size % patch_size:
            problems.append(f"vision image_size {image_size} is not a multiple of patch_size {patch_size}")
        if strategy not in STRATEGIES:
            problems.append(
                f"vision_feature_select_strategy {strategy!r} is not one of {', '.join(STRATEGIES)}"
            )
        cropped = self.vision(model).crop
        if cropped is not None:
            if cropped != (image_size, image_size):
                problems.append(
                    f"the image processor crops to {cropped[0]}x{cropped[1]} but the vision tower takes "
                    f"{image_size}x{image_size}"
                )
        return problems

    def tokens_per_image(self, model: ModelDescription) -> int:
        """Placeholders of every image: one per patch, plus the CLS token unless ``default`` drops it."""
        image_size, patch_size, strategy = self.geometry(model)
        cls_token = 0 if strategy == DEFAULT_STRATEGY else 1
        return (image_size // patch_size) ** 2 + cls_token

    def vision_attention(self, model: ModelDescription, values, policy) -> VisionAttention:
        """CLIP over the fixed crop (patches + CLS): one image, small, not blocked."""
        heads = tower_value(model, ("num_attention_heads",), 12)  # CLIPVisionConfig default
        vision = self.vision(model)
        rows = (vision.image_size // vision.patch_size) ** 2 + 1
        return VisionAttention(heads, rows, rows, count_symbol(values, symbols.BATCH_SIZE))

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """img_size (the tower's fixed side) and vision_size (the same for every image)."""
        image_size, _, _ = self.geometry(model)
        return {IMG_SIZE: image_size, symbols.VISION_SIZE: self.tokens_per_image(model)}


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.llava.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.llava.export import Adapter

    return Adapter


register(Llava, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
