"""The torch side of a family: what the generic exporter and runtime ask of each family module.

A family registers a loader of its subclass of :class:`ExportAdapter` (see
:func:`qeff_vision.families.register`); the adapter is built with the family it serves. The
generic code never branches on a family name; it calls these methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.contract.language_io import LanguageIO
from qeff_vision.errors import UserError
from qeff_vision.export.decoder import FULL_ATTENTION, DecoderParts, LanguageDecoder
from qeff_vision.hf_logging import quiet_transformers
from qeff_vision.transformers_version import require_supported_transformers

if TYPE_CHECKING:  # the family sits above export/ (its adapter subclasses ExportAdapter)
    from qeff_vision.families.base import Family, ModelDescription


class ExportAdapter:
    """Base class of a family's torch-side adapter. Subclasses override the marked methods.

    Args:
        family: The registered family this adapter exports.
    """

    #: Image sizes (height, width) the parity tests feed the tiny checkpoint: several aspect ratios
    #: for multi-resolution towers; any sizes for fixed-resolution ones (the processor resizes).
    test_image_sizes: Sequence[tuple[int, int]] = ((100, 150), (224, 224), (300, 120))
    #: ``*RMSNorm`` class name -> offset added to its weight before scaling (Gemma's ``1 + weight``
    #: form); every other RMSNorm scales by its weight (see :mod:`qeff_vision.export.rms_norm`).
    rms_norm_weight_offsets: Mapping[str, float] = {}
    #: Dotted path from a text decoder layer to its stacked mixture-of-experts module
    #: (``mlp.experts``), or None. The exporter's own model (:meth:`empty_model`) runs those experts
    #: in the routed form (:func:`~qeff_vision.export.experts.routed_experts`: the decode step
    #: reads only the chosen experts); a loaded reference model keeps transformers' experts.
    sparse_experts: str | None = None

    def __init__(self, family: Family):
        self.family = family

    # ---- loading ----

    def load(self, model_dir: str | Path) -> nn.Module:
        """Load the checkpoint in float32 with eager attention (what the exporter traces)."""
        from transformers import AutoModelForImageTextToText

        require_supported_transformers()
        quiet_transformers()
        model, info = AutoModelForImageTextToText.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        # transformers fills missing weights with random values and only warns: refuse instead.
        missing = list(info.get("missing_keys") or []) + list(info.get("mismatched_keys") or [])
        if missing:
            shown = ", ".join(str(key) for key in missing[:3])
            raise UserError(
                f"{model_dir}: {len(missing)} weight(s) missing or mismatched in the checkpoint ({shown} ...)"
            )
        return model.eval()

    def empty_model(self, model_dir: str | Path, dtype: torch.dtype) -> nn.Module:
        """The checkpoint's model in ``dtype`` with eager attention and every parameter on meta.

        The exporter fills the parameters with placeholders and streams their values from the
        checkpoint (:mod:`qeff_vision.export.weights`); buffers computed at construction are real.
        A family declaring :attr:`sparse_experts` gets those experts in the routed form.
        """
        from transformers import AutoConfig, AutoModelForImageTextToText

        from qeff_vision.export.experts import route_sparse_experts
        from qeff_vision.export.weights import parameters_on_meta

        quiet_transformers()
        config = AutoConfig.from_pretrained(str(model_dir))
        with parameters_on_meta():
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="eager")
        if self.sparse_experts:
            route_sparse_experts(model.model.language_model.layers, self.sparse_experts)
        return model.eval()

    def write_tiny_checkpoint(self, out_dir: str | Path, seed: int = 0) -> Path:
        """Write a tiny random-weight checkpoint with the family's registered builder."""
        return self.family.write_tiny_checkpoint(out_dir, seed)

    # ---- vision program ----

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """Module whose forward takes the vision inputs (in ``family.vision_input_axes`` order)."""
        raise NotImplementedError

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Small example inputs to trace with: export memory must not depend on image resolution."""
        raise NotImplementedError

    def hf_image_features(self, model: nn.Module, processed: Mapping[str, Any]) -> list[torch.Tensor]:
        """Transformers' own per-image features [tokens, hidden] for the processor outputs (parity)."""
        raise NotImplementedError

    def hf_stacked_rows(
        self, model: nn.Module, processed: Mapping[str, Any]
    ) -> dict[str, list[torch.Tensor]]:
        """Transformers' rows [depth, tokens, hidden] per image of each stacked vision-row input."""
        return {}

    def hf_pruned_encoder_outputs(
        self, model: nn.Module, processed: Mapping[str, Any], keep: Any
    ) -> dict[str, Any]:
        """Transformers' encoder outputs for ``processed`` with each clip cut to the rows ``keep`` marks.

        What ``generate(mm_encoder_outputs=...)`` takes for a prompt whose clips were pruned
        (EVS): transformers does not prune, so the reference is given our retention masks
        (``keep``: bool over every clip row of the prompt, in order). Families that declare
        ``video_pruning`` implement it.
        """
        raise NotImplementedError(f"{self.family.title} does not prune video")

    def vision_parity_pairs(
        self, outputs: Mapping[str, Any], features: Sequence[torch.Tensor], model: ModelDescription
    ) -> list[tuple[Any, Any]]:
        """(ours, transformers') array pairs that must match for one image (``verify``).

        ``outputs``: the vision program's outputs for the image; ``features``: what
        :meth:`hf_image_features` returned for it. The default compares its embedding rows.
        """
        return [(outputs[symbols.VISION_EMBEDS][0], features[0].numpy())]

    # The patch-bucket program (``patch_bucket_encoder``, ``patch_bucket_example_inputs``) exists
    # only on the adapters of families with the optional PatchBuckets capability.

    # ---- language program ----

    #: The text model takes one 4-D mask instead of ``{layer_type: mask}`` (Llama, Granite: they
    #: pass a 4-D mask through ``create_causal_mask`` unchanged).
    single_mask: bool = False

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The pieces of the HF model the generic :class:`LanguageDecoder` needs.

        The default reads the layout every supported ``*ForConditionalGeneration`` shares:
        ``model.model.language_model``, ``model.lm_head``, ``config.image_token_id`` and the text
        config's ``layer_types`` / ``sliding_window`` / ``attention_chunk_size`` (all full attention
        when absent).
        """
        text_config = model.config.text_config
        layer_types = (
            getattr(text_config, "layer_types", None) or [FULL_ATTENTION] * text_config.num_hidden_layers
        )
        return DecoderParts(
            embed_tokens=model.get_input_embeddings(),
            text_model=model.model.language_model,
            lm_head=model.lm_head,
            image_token_id=model.config.image_token_id,
            layer_types=list(layer_types),
            sliding_window=getattr(text_config, "sliding_window", None),
            attention_chunk_size=getattr(text_config, "attention_chunk_size", None),
            position_rows=self.family.position_id_rows,
            bidirectional_images=self.family.bidirectional_images,  # declared once, by chunk_split
            mask_per_layer_type=not self.single_mask,
            video_token_id=(
                getattr(model.config, self.family.video_token_key)
                if self.family.video_token_key and self.family.features.video.supported
                else None
            ),
        )

    def language_decoder(self, model: nn.Module, parts: DecoderParts, io: LanguageIO) -> nn.Module:
        """The language program's module over the rows of ``io``: the token-merge decoder by default.

        A family of another decoder kind overrides it (a cross-attention decoder reads image
        states as retained K/V).
        """
        return LanguageDecoder(parts, io).eval()


class FixedResolutionAdapter(ExportAdapter):
    """Adapter base for towers that take ``pixel_values [batch, channels, side, side]`` at one size.

    The processor resizes every image to the tower's ``image_size``, so the vision inputs are one
    ``pixel_values`` row per image and the trace example is one image at that size.
    """

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One random image at the tower's only resolution."""
        config = model.config.vision_config
        generator = torch.Generator().manual_seed(0)
        shape = (1, config.num_channels, config.image_size, config.image_size)
        return {symbols.PIXEL_VALUES: torch.randn(*shape, generator=generator)}
