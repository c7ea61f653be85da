"""Gemma 3 export: SigLIP tower + pooled projector as one program; the text model with bidirectional images.

The vision program is transformers' own modules (ref: transformers v5 models/gemma3/modeling_gemma3.py,
``Gemma3Model.get_image_features``): nothing in them depends on Python loops over the input, and
the resolution is fixed by the checkpoint, so they trace as they are.

The language program is the generic decoder with two Gemma-specific settings:
  * two-way image attention (declared once, as the family's ``chunk_split = bidirectional(...)``):
    transformers builds the prefill mask from ``token_type_ids`` so the
    placeholders of one image see each other both ways, on full layers OR(causal, same image) and
    on sliding layers AND(window, OR(causal, same image)) (``create_masks_for_vision_model``).
    The generic position-built masks compose the same way; images are never split across chunks.
  * no final-logit soft-capping: ``Gemma3ForConditionalGeneration.forward`` returns the raw
    ``lm_head`` output even when ``text_config.final_logit_softcapping`` is set (only the text-only
    ``Gemma3ForCausalLM`` caps), and transformers' generate is the reference.
The scaled token embedding (x sqrt(hidden)) is the text model's own ``embed_tokens``; image rows are
merged after it, unscaled, as transformers does. Each layer type gets its rotary table (local base
frequency on sliding layers) from the text model itself, which the decoder calls with the
per-layer-type mask dict and the positions.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.export.adapter import FixedResolutionAdapter
from qeff_vision.export.blocked_attention import query_blocked

# Most images of one call the tower's blocks are sized for.
IMAGES = 4


class VisionEncoder(nn.Module):
    """pixel_values [batch, 3, img_size, img_size] -> vision_embeds [batch, mm_tokens_per_image, text]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """SigLIP patch features, average-pooled and projected to the text width."""
        # The checkpoint fixes the image (896 px: 4,096 patches, 512 MiB of fp16 scores per layer
        # at 16 heads): in query blocks sized for IMAGES images a call (a single program's encode
        # entries take several; qeff_vision/export/blocked_attention.py).
        config = self.tower.config
        with query_blocked(config, rows=(config.image_size // config.patch_size) ** 2, batch=IMAGES):
            return self.projector(self.tower(pixel_values=pixel_values).last_hidden_state)


class Adapter(FixedResolutionAdapter):
    """Torch side of the Gemma 3 family."""

    # Gemma3RMSNorm scales by (1 + weight) (ref: transformers v5 models/gemma3/modeling_gemma3.py).
    rms_norm_weight_offsets = {"Gemma3RMSNorm": 1.0}

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """Tower and projector, unchanged."""
        return VisionEncoder(model).eval()

    def hf_image_features(self, model, processed):
        """The reference features: transformers' ``get_image_features``, one tensor per image."""
        pixel_values = torch.as_tensor(processed["pixel_values"])
        with torch.no_grad():
            return list(model.model.get_image_features(pixel_values).pooler_output)
