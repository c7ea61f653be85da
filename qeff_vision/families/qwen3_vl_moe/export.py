"""Qwen3-VL-MoE export: Qwen3-VL's adapter with the experts written as dense, traceable tensor math.

transformers' eager experts (ref: transformers v5 models/qwen3_vl_moe/modeling_qwen3_vl_moe.py,
``Qwen3VLMoeTextExperts.forward``) loop over the experts that the batch's router picked
(``nonzero`` over a one-hot mask) and index-add each expert's rows; tracing would keep only the
experts the example tokens hit. Here every expert runs on every token ([experts, tokens, ...]
batched matmuls) and the outputs are summed with the router's top-k weights scattered to a dense
[tokens, experts] table, zero for experts not chosen: the same sum, so the same logits up to
float32 summation order, with no shape that depends on the routing. The router itself
(softmax, ``topk``, renormalisation) is traced as transformers writes it.

Only the exporter's own model (:meth:`Adapter.empty_model`, placeholders on which transformers'
grouped kernels cannot run anyway) gets the dense form; a loaded model handed to
:meth:`Adapter.decoder_parts` (a test's transformers reference) keeps transformers' experts.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.families.qwen3_vl.export import Adapter as Qwen3_VLAdapter


def dense_experts(experts: nn.Module):
    """A forward for ``experts`` (``Qwen3VLMoeTextExperts``) as dense, routing-independent tensor math."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # [tokens, experts]: the router weight of each chosen expert, zero elsewhere.
        chosen = top_k_index.unsqueeze(-1) == torch.arange(experts.num_experts)
        routing = (chosen.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(1)
        # [experts, tokens, 2 * moe_intermediate] -> [experts, tokens, hidden]
        gate, up = torch.matmul(hidden_states, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        outputs = torch.matmul(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))
        return (outputs * routing.t().unsqueeze(-1).to(outputs.dtype)).sum(0)

    return forward


class Adapter(Qwen3_VLAdapter):
    """Torch side of the Qwen3-VL-MoE family: Qwen3-VL's, with dense experts in the exported decoder."""

    def empty_model(self, model_dir, dtype: torch.dtype) -> nn.Module:
        """The exporter's placeholder model with every sparse block's experts written densely."""
        model = super().empty_model(model_dir, dtype)
        for layer in model.model.language_model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                experts.forward = dense_experts(experts)
        return model
