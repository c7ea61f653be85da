"""Qwen3.5-MoE export: Qwen3.5's adapter with the experts in the routed form (reads the chosen experts).

transformers' eager experts (ref: transformers v5.23 models/qwen3_5_moe/modeling_qwen3_5_moe.py,
``Qwen3_5MoeExperts.forward``) loop over the experts the batch's router hit, as Qwen3-VL-MoE's do,
so the exporter's own model (:meth:`Adapter.empty_model`) runs
:func:`~qeff_vision.export.experts.routed_experts` instead (same weights layout:
``gate_up_proj`` [experts, 2 x moe_intermediate, hidden], ``down_proj`` [experts, hidden,
moe_intermediate]): min(tokens x top_k, experts) expert slices per call, the routed ones at decode.
The router and the sigmoid-gated shared expert are traced as written.
"""

from __future__ import annotations

from qeff_vision.families.qwen3_5.export import Adapter as Qwen3_5Adapter


class Adapter(Qwen3_5Adapter):
    """Torch side of the Qwen3.5-MoE family."""

    rms_norm_weight_offsets = {"Qwen3_5MoeRMSNorm": 1.0}

    # The exporter's own model runs these experts in the routed form (ExportAdapter.empty_model).
    sparse_experts = "mlp.experts"
