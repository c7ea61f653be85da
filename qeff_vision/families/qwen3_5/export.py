"""Qwen3.5 export: Qwen3-VL's symbolic vision tower without deepstack, Gated DeltaNet on retained state.

The vision program is Qwen3-VL's (:class:`~qeff_vision.families.qwen3_vl.export.VisionEncoder`
with no deepstack layers). In the language program, every ``Qwen3_5GatedDeltaNet`` runs
:func:`linear_attention_forward` when the generic decoder hands it our retained cache (other
callers, e.g. a test's ``generate`` on the same model, keep transformers' forward). Against
transformers' layer (ref: transformers v5.23 models/qwen3_5/modeling_qwen3_5.py,
``Qwen3_5GatedDeltaNet.forward``):

* the causal convolution reads ``[conv_state ; chunk]`` with no padding (transformers pads
  ``kernel - 1`` zeros on a first prefill, which is the zero state a sequence starts from);
* the gated delta rule is :class:`~qeff_vision.export.gated_delta.GatedDeltaRuleFunction` (an
  exact ONNX Scan over chunks) for prefill and decode alike, with padding tokens' decay and beta
  zeroed so they leave the state unchanged (transformers' layer only left-pads);
* the gated RMSNorm ``norm(x) * silu(z)`` normalizes with the compiler-known ``CustomRMSNorm``
  (:mod:`qeff_vision.export.rms_norm`), the gate a multiplication after it; the ``(1 + w)``
  RMSNorms export as ``CustomRMSNorm`` with a weight offset of 1 (``rms_norm_weight_offsets``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.decoder import DecoderParts
from qeff_vision.export.gated_delta import GatedDeltaRuleFunction
from qeff_vision.export.rms_norm import CustomRMSNormFunction
from qeff_vision.families.qwen2_5_vl.export import Adapter as Qwen2_5_VLAdapter
from qeff_vision.families.qwen3_vl.export import Adapter as Qwen3_VLAdapter
from qeff_vision.families.qwen3_vl.export import VisionEncoder

# ref: transformers' l2norm (FLA's epsilon), applied to queries and keys before the rule.
L2_EPSILON = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPSILON)


def linear_attention_forward(layer: nn.Module, hidden_states: torch.Tensor, states) -> torch.Tensor:
    """One Gated DeltaNet layer over the chunk (or decode step) with retained ``states``.

    Args:
        layer: A ``Qwen3_5GatedDeltaNet`` (or the MoE model's identical layer).
        hidden_states: [batch, seq, hidden].
        states: The call's :class:`~qeff_vision.export.recurrent_state.RecurrentStates`.
    """
    batch, seq_len, _ = hidden_states.shape
    index = layer.layer_idx
    mixed = layer.in_proj_qkv(hidden_states).transpose(1, 2)  # [batch, conv_dim, seq]
    gate = layer.in_proj_z(hidden_states).reshape(batch, seq_len, -1, layer.head_v_dim)
    window = states.conv_window(index, mixed)  # [batch, conv_dim, kernel + seq]
    weight = layer.conv1d.weight  # [conv_dim, 1, kernel], depthwise
    convolved = F.conv1d(window.to(weight.dtype), weight, layer.conv1d.bias, groups=layer.conv_dim)
    # Output j reads window[j : j + kernel]; token t is output t + 1 (output 0 ends at the state).
    mixed = F.silu(convolved[:, :, 1:]).to(hidden_states.dtype).transpose(1, 2)
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, layer.head_k_dim)
    key = key.reshape(batch, seq_len, -1, layer.head_k_dim)
    value = value.reshape(batch, seq_len, -1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).float().sigmoid()
    decay = -layer.A_log.float().exp() * F.softplus(
        layer.in_proj_a(hidden_states).float() + layer.dt_bias.float()
    )
    decay, beta = states.inert_gates(decay, beta)
    # Grouped value heads: each query/key head serves value_heads / key_heads consecutive value heads.
    groups = layer.num_v_heads // layer.num_k_heads
    query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    query, key, value = (x.transpose(1, 2).float() for x in (query, key, value))
    query = _l2norm(query) * layer.head_k_dim**-0.5
    key = _l2norm(key)
    output, state = GatedDeltaRuleFunction.apply(
        query, key, value, decay.transpose(1, 2), beta.transpose(1, 2), states.state(index)
    )
    states.update_state(index, state)
    output = output.transpose(1, 2).to(hidden_states.dtype).reshape(-1, layer.head_v_dim)
    norm = layer.norm
    normed = CustomRMSNormFunction.apply(output, norm.weight, norm.variance_epsilon)
    gated = (normed.float() * F.silu(gate.reshape(-1, layer.head_v_dim).float())).to(hidden_states.dtype)
    return layer.out_proj(gated.reshape(batch, seq_len, -1))


def _on_retained_state(layer: nn.Module):
    """The layer's forward: ours on the decoder's retained cache, transformers' otherwise."""
    original = type(layer).forward.__get__(layer)

    def forward(hidden_states, attention_mask=None, **kwargs):
        # The decoder layer passes the cache as ``cache_params`` (transformers 5.23) or ``cache`` (5.24).
        cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("cache_params")
        # Our retained cache hands each recurrent layer a view of the call's RecurrentStates.
        lookup = getattr(cache, "layer_state", None)
        view = lookup(layer.layer_idx) if lookup is not None else None
        if view is None:
            return original(hidden_states, attention_mask=attention_mask, **kwargs)
        return linear_attention_forward(layer, hidden_states, view.states)

    return forward


def use_retained_linear_attention(text_model: nn.Module) -> int:
    """Route every linear-attention layer of ``text_model`` through :func:`linear_attention_forward`."""
    patched = 0
    for decoder_layer in text_model.layers:
        layer = getattr(decoder_layer, "linear_attn", None)
        if layer is not None:
            layer.forward = _on_retained_state(layer)
            patched += 1
    return patched


class Adapter(Qwen3_VLAdapter):
    """Torch side of the Qwen3.5 family."""

    # The text model takes {layer_type: mask}: full_attention and linear_attention (ignored by ours).
    single_mask = False
    rms_norm_weight_offsets = {"Qwen3_5RMSNorm": 1.0}

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """Qwen3-VL's symbolic-grid tower returning vision_embeds only."""
        return VisionEncoder(model.model.visual, deepstack=()).eval()

    def hf_stacked_rows(self, model, processed):
        """None: no deepstack."""
        return {}

    # No deepstack rows to cut either: a pruned clip is its merged rows only.
    _cut_video_features = staticmethod(Qwen2_5_VLAdapter._cut_video_features)

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The shared layout; linear-attention layers run on the retained states."""
        parts = ExportAdapter.decoder_parts(self, model)
        use_retained_linear_attention(parts.text_model)
        return parts
