"""LLaVA-1.5 export: the CLIP tower up to the selected feature layer, CLS dropped, then the projector.

transformers asks the CLIP tower for its hidden states and picks ``vision_feature_layer`` from them
(ref: transformers v5 models/llava/modeling_llava.py, ``LlavaModel.get_image_features``). Hidden
state 0 is the embedding output after ``pre_layrnorm`` and state i the output of layer i - 1, so
with the published ``-2`` the last layer's output is never used: the exported tower stops before
it instead of computing and discarding it. The decoder is transformers' Llama model reused by the
generic :class:`~qeff_vision.export.decoder.LanguageDecoder`.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.errors import UserError
from qeff_vision.export.adapter import FixedResolutionAdapter
from qeff_vision.families.llava import DEFAULT_STRATEGY, VISION_MODEL_TYPES


class VisionEncoder(nn.Module):
    """pixel_values [batch, 3, img_size, img_size] -> vision_embeds [batch, vision_size, text hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        if config.vision_config.model_type not in VISION_MODEL_TYPES:
            raise UserError(
                f"vision tower {config.vision_config.model_type!r} is not supported; "
                "the llava family exports CLIP towers"
            )
        tower = model.model.vision_tower
        self.embeddings = tower.embeddings
        self.pre_layrnorm = tower.pre_layrnorm
        layer_count = len(tower.encoder.layers)
        selected = config.vision_feature_layer
        selected = [selected] if isinstance(selected, int) else list(selected)
        # Hidden states 0..layer_count; negative indices count from the last one.
        self.feature_states = [index % (layer_count + 1) for index in selected]
        self.layers = tower.encoder.layers[: max(self.feature_states)]
        self.drop_cls = config.vision_feature_select_strategy == DEFAULT_STRATEGY
        self.projector = model.model.multi_modal_projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode a batch of images at the tower's resolution."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values.to(self.pre_layrnorm.weight.dtype)))
        states = [hidden]
        for layer in self.layers:
            hidden = layer(hidden, None)
            states.append(hidden)
        features = [states[index] for index in self.feature_states]
        if self.drop_cls:
            features = [state[:, 1:] for state in features]
        return self.projector(torch.cat(features, dim=-1))


class Adapter(FixedResolutionAdapter):
    """Torch side of the LLaVA-1.5 family."""

    single_mask = True  # Llama builds its causal mask from one 4-D input
    # Any sizes work (the processor resizes and crops); both orientations and a square one.
    test_image_sizes = ((100, 150), (224, 224), (300, 120))

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The tower truncated at the feature layer, CLS selection and projector."""
        return VisionEncoder(model).eval()

    def hf_image_features(self, model, processed):
        """Transformers' own image features, one [tokens, hidden] tensor per image."""
        with torch.no_grad():
            output = model.model.get_image_features(pixel_values=torch.as_tensor(processed["pixel_values"]))
        return list(output.pooler_output)
