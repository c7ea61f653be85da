"""Qwen3-VL-MoE export: Qwen3-VL's adapter with experts that read only the routed slices at decode.

transformers' eager experts (ref: transformers v5 models/qwen3_vl_moe/modeling_qwen3_vl_moe.py,
``Qwen3VLMoeTextExperts.forward``) loop over the experts that the batch's router picked
(``nonzero`` over a one-hot mask) and index-add each expert's rows; tracing would keep only the
experts the example tokens hit. Here the experts read min(tokens x top_k, experts) slices of the
stacked ``gate_up_proj`` / ``down_proj``: the routed ones for a decode step, every expert once
for a prefill chunk, chosen by the call's static shapes (:func:`routed_experts`). The router
(softmax, ``topk``, renormalisation) is traced as transformers writes it.

Only the exporter's own model (:meth:`Adapter.empty_model`, placeholders on which transformers'
grouped kernels cannot run anyway) gets the routed form; a loaded model handed to
:meth:`Adapter.decoder_parts` (a test's transformers reference) keeps transformers' experts.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.export.experts import expert_slices, routed_sum, routing_table, slice_weights
from qeff_vision.families.qwen3_vl.export import Adapter as Qwen3_VLAdapter


def routed_experts(experts: nn.Module):
    """A forward for ``experts`` (``Qwen3VLMoeTextExperts`` and its Qwen3.5-MoE / Gemma 4 twins).

    Same call as transformers' (states [T, H], the router's ``top_k_index`` and ``top_k_weights``
    [T, k]) and the same stacked layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    reads min(T x k, E) expert slices (:mod:`qeff_vision.export.experts`).
    """

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ids, owners = expert_slices(top_k_index, experts.num_experts)
        weights = slice_weights(routing_table(top_k_index, top_k_weights, experts.num_experts), ids, owners)
        return routed_sum(
            hidden_states,
            experts.gate_up_proj,
            experts.down_proj,
            experts.act_fn,
            ids,
            weights,
            top_k=top_k_index.shape[-1],
        )

    return forward


def route_sparse_blocks(layers) -> None:
    """Give every ``layer.mlp.experts`` of ``layers`` the routed forward (dense MLP layers have none)."""
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.forward = routed_experts(experts)


class Adapter(Qwen3_VLAdapter):
    """Torch side of the Qwen3-VL-MoE family: Qwen3-VL's, with routed experts in the exported decoder."""

    def empty_model(self, model_dir, dtype: torch.dtype) -> nn.Module:
        """The exporter's placeholder model with every sparse block's experts in the routed form."""
        model = super().empty_model(model_dir, dtype)
        route_sparse_blocks(model.model.language_model.layers)
        return model
