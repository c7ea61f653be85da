"""Qwen3-VL-MoE export: Qwen3-VL's adapter with experts that read only the routed slices at decode.

transformers' eager experts (ref: transformers v5 models/qwen3_vl_moe/modeling_qwen3_vl_moe.py,
``Qwen3VLMoeTextExperts.forward``) loop over the experts that the batch's router picked
(``nonzero`` over a one-hot mask) and index-add each expert's rows; tracing would keep only the
experts the example tokens hit. Here the experts read min(tokens x top_k, experts) slices of the
stacked ``gate_up_proj`` / ``down_proj``: the routed ones for a decode step, every expert once
for a prefill chunk, chosen by the call's static shapes
(:func:`~qeff_vision.export.experts.routed_experts`). The router (softmax, ``topk``,
renormalisation) is traced as transformers writes it.

Only the exporter's own model (``ExportAdapter.empty_model`` with :attr:`Adapter.sparse_experts`,
placeholders on which transformers' grouped kernels cannot run anyway) gets the routed form; a
loaded model handed to :meth:`Adapter.decoder_parts` (a test's transformers reference) keeps
transformers' experts.
"""

from __future__ import annotations

from qeff_vision.families.qwen3_vl.export import Adapter as Qwen3_VLAdapter


class Adapter(Qwen3_VLAdapter):
    """Torch side of the Qwen3-VL-MoE family: Qwen3-VL's, with routed experts in the exported decoder."""

    # The exporter's own model routes each sparse block's experts (ExportAdapter.empty_model).
    sparse_experts = "mlp.experts"
