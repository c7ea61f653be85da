"""GLM-4.1V export: a vision tower whose grid, position table and rotary positions follow symbolic shapes.

transformers reads the grid values (``grid_thw.tolist()`` for the rotary positions and the
``cu_seqlens`` splits; ref: transformers v5 vision_utils.py ``get_vision_position_ids`` /
``get_vision_attention_seqlens``), which tracing freezes into constants of the example image. Here
every index comes from the *shape* of ``image_grid_thw`` [batch, 1, grid_h, grid_w], so one graph
serves every resolution:

* patches are in the processor's block-major order (2x2 merge blocks, row-major over the merged
  grid); row and column of each patch are decoded from its index;
* the learned square position table is resampled at each patch's centre by ``grid_sample``
  (bicubic, ``align_corners=False``, border padding: ``Glm4vVisionEmbeddings``), which exports as
  ONNX ``GridSample`` (opset 16+);
* attention stays within an image: a segment mask in query blocks instead of ``cu_seqlens`` splits;
* the 2x2 merge is ``Glm4vVisionModel``'s conv downsample over each block, then its gated merger.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked_attention
from qeff_vision.export.decoder import DecoderParts
from qeff_vision.families.glm4v import IMAGE_GRID_THW
from qeff_vision.families.qwen3_vl.export import block_major_grid


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionEncoder(nn.Module):
    """pixel_values [B*gh*gw, C*T*P*P], image_grid_thw [B, 1, gh, gw] -> vision_embeds [B, tokens, D]."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual
        config = visual.config
        self.merge = config.spatial_merge_size
        self.out_hidden = config.out_hidden_size

    def _grid_indices(self, image_grid_thw: torch.Tensor):
        """Per-patch (image, row, column, grid_h, grid_w): the Qwen2-VL block-major patch order."""
        return block_major_grid(image_grid_thw, self.merge)

    def _position_table(self, row, col, heights, widths) -> torch.Tensor:
        """``Glm4vVisionEmbeddings``: the square table sampled bicubically at each patch centre."""
        weight = self.visual.embeddings.position_embedding.weight
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
        norm_w = (col.float() + 0.5) / widths.float() * 2 - 1
        norm_h = (row.float() + 0.5) / heights.float() * 2 - 1
        grid = torch.stack((norm_w, norm_h), dim=-1).unsqueeze(0).unsqueeze(2)
        sampled = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled.squeeze(0).squeeze(-1).permute(1, 0).to(weight.dtype)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode a batch of same-resolution images."""
        visual = self.visual
        image, row, col, heights, widths = self._grid_indices(image_grid_thw)
        hidden = visual.post_conv_layernorm(visual.patch_embed(pixel_values))
        cos, sin = visual.rotary_pos_emb(hidden, torch.stack([row, col], dim=-1))
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
        hidden = hidden + self._position_table(row, col, heights, widths).to(hidden.dtype)
        for block in visual.blocks:
            hidden = hidden + self._attention(block.attn, block.norm1(hidden), cos, sin, image)
            hidden = hidden + block.mlp(block.norm2(hidden))
        hidden = visual.post_layernorm(hidden)
        hidden = hidden.view(-1, self.merge, self.merge, hidden.shape[-1]).permute(0, 3, 1, 2)
        hidden = visual.downsample(hidden).view(-1, self.out_hidden)
        return visual.merger(hidden).reshape(image_grid_thw.shape[0], -1, self.out_hidden)

    @staticmethod
    def _attention(attn: nn.Module, hidden, cos, sin, segment) -> torch.Tensor:
        """Attention among the patches of one image (``segment`` [N]), in query blocks (scores bounded)."""
        length = hidden.shape[0]
        qkv = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 2, 0, 3)
        query, key, value = qkv[0], qkv[1], qkv[2]  # [heads, N, head_dim]
        cos_h, sin_h = cos.transpose(0, 1), sin.transpose(0, 1)
        query = (query.float() * cos_h + _rotate_half(query.float()) * sin_h).to(value.dtype)
        key = (key.float() * cos_h + _rotate_half(key.float()) * sin_h).to(value.dtype)
        output = query_blocked_attention(query, key, value, attn.scaling, segments=segment)
        return attn.proj(output.transpose(0, 1).reshape(length, -1))


def _traceable_recomposition(rotary: nn.Module):
    """``Glm4vTextRotaryEmbedding.recomposition_frequencies`` without ``repeat_interleave``.

    The TorchScript exporter's ``repeat_interleave`` symbolic rewrites its ``dim=-1`` constant in
    place to the positive axis, and the tracer pools that ``-1`` with every other one in the graph
    (the merge's ``reshape(-1, hidden)``, the rotary ``flatten(-2, -1)``), which then read 2. Each
    frequency repeated twice in a row, as stack + reshape: same values.
    """
    sections = list(rotary.mrope_section)

    def recomposition(freq: torch.Tensor) -> torch.Tensor:
        freq = torch.cat([part[i % 3] for i, part in enumerate(freq.split(sections, dim=-1))], dim=-1)
        pairs = torch.stack((freq, freq), dim=freq.dim())
        return pairs.reshape(freq.shape[0], freq.shape[1], 2 * freq.shape[2])

    return recomposition


class Adapter(ExportAdapter):
    """Torch side of the GLM-4.1V family (the language program is the generic token-merge decoder)."""

    # Glm4vTextModel builds one causal mask with create_causal_mask; a 4-D mask passes through.
    single_mask = True

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The symbolic-grid vision tower."""
        return VisionEncoder(model.model.visual).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One 4x6-patch image: not square, so rows and columns are traced apart."""
        config = model.config.vision_config
        grid_h, grid_w = 2 * config.spatial_merge_size, 3 * config.spatial_merge_size
        features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        generator = torch.Generator().manual_seed(0)
        return {
            symbols.PIXEL_VALUES: torch.randn(grid_h * grid_w, features, generator=generator),
            IMAGE_GRID_THW: torch.zeros(1, 1, grid_h, grid_w, dtype=torch.int64),
        }

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The shared layout, the text rotary's frequency layout written without ``repeat_interleave``."""
        parts = super().decoder_parts(model)
        rotary = parts.text_model.rotary_emb
        rotary.recomposition_frequencies = _traceable_recomposition(rotary)
        return parts

    def hf_image_features(self, model, processed):
        """Transformers' vision tower on the processor outputs, split per image."""
        grid = torch.as_tensor(processed["image_grid_thw"])
        with torch.no_grad():
            output = model.model.visual(torch.as_tensor(processed["pixel_values"]), grid_thw=grid)
        counts = (grid.prod(dim=-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        return list(torch.split(output.pooler_output, counts))
