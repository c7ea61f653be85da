"""Qwen3.5-MoE: Qwen3.5 (hybrid Gated DeltaNet / full-attention decoder, Qwen3-VL tower) with sparse MLPs.

Everything the token math, the vision program, the recurrent state rows and the host depend on is
Qwen3.5's (ref: transformers v5.23 models/qwen3_5_moe/modeling_qwen3_5_moe.py, whose vision model,
``Qwen3_5MoeGatedDeltaNet`` and attention are copies of Qwen3.5's), so the family only changes its
names. The text model's feed-forward is a top-k router over ``num_experts`` experts plus a gated
shared expert (``Qwen3_5MoeSparseMoeBlock``); its export routes the experts as Qwen3-VL-MoE's
does (:mod:`qeff_vision.families.qwen3_5_moe.export`).
"""

from __future__ import annotations

from qeff_vision.families import register
from qeff_vision.families.base import Features, yes
from qeff_vision.families.qwen3_5 import FEATURES, Qwen3_5
from qeff_vision.families.qwen3_5_moe.tiny import write_tiny_checkpoint  # torch-free until called


class Qwen3_5_MoE(Qwen3_5):
    """Qwen3.5 mixture-of-experts models (e.g. Qwen3.5-122B-A10B)."""

    name = "qwen3_5_moe"
    title = "Qwen3.5-MoE"
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    model_types = ("qwen3_5_moe",)
    features = Features(
        export=yes(
            "Gated DeltaNet as an ONNX Scan; experts routed: min(tokens x top_k, experts) slices per call"
        ),
        **FEATURES,
    )


def _host():
    """Qwen3-VL's host protocol class (numpy only), as Qwen3.5's."""
    from qeff_vision.families.qwen3_vl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.qwen3_5_moe.export import Adapter

    return Adapter


register(Qwen3_5_MoE, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
