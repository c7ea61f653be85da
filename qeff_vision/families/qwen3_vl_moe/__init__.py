"""Qwen3-VL-MoE: Qwen3-VL's vision tower and deepstack over a mixture-of-experts text model.

Everything the token math, the vision program and the deepstack rows depend on is Qwen3-VL's
(ref: transformers v5 models/qwen3_vl_moe/modeling_qwen3_vl_moe.py, whose vision model and
``_deepstack_process`` are copies of Qwen3-VL's), so the family only changes its names. The text
model differs in its feed-forward: a top-k router over ``num_experts`` experts
(``Qwen3VLMoeTextSparseMoeBlock``) in every layer not listed in ``mlp_only_layers``. Its export
(:mod:`qeff_vision.families.qwen3_vl_moe.export`) reads min(tokens x top_k, experts) expert slices
per call (:mod:`qeff_vision.export.experts`), because transformers' loop over the experts a batch
happens to hit is data-dependent control flow that tracing would freeze to the example's routing.
"""

from __future__ import annotations

from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    EVS_VIDEO_PRUNING,
    GENERATE,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    Features,
    yes,
)
from qeff_vision.families.qwen3_vl import Qwen3_VL
from qeff_vision.families.qwen3_vl_moe.tiny import write_tiny_checkpoint  # torch-free until called


class Qwen3_VL_MoE(Qwen3_VL):
    """Qwen3-VL-30B-A3B and 235B-A22B (Instruct and Thinking; mixture-of-experts text models)."""

    name = "qwen3_vl_moe"
    title = "Qwen3-VL-MoE"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    model_types = ("qwen3_vl_moe",)
    # No published embedding or reranker checkpoint of this architecture: generate only.
    tasks = (GENERATE,)
    features = Features(
        export=yes("experts routed: min(tokens x top_k, experts) slices per call (k per token at decode)"),
        dynamic_vision_size=yes("deepstack_features sliced like vision_embeds"),
        multi_resolution=yes("one vision graph, a specialization per resolution"),
        chunk_split=yes("causal attention over image tokens"),
        video=yes("2 frames per temporal patch; frames as timestamped placeholder runs"),
        video_pruning=EVS_VIDEO_PRUNING,
        disaggregated=DISAGGREGATED_PROGRAMS,
        single_program=yes(
            "one lang program, as Qwen3-VL's: the patch-sequence tower composed in, gated on the "
            "patch count; vision_embeds and deepstack_features rows retained; one encode call per "
            "run of same-resolution images; images only"
        ),
        deepstack=yes("deepstack_features rows sliced per chunk like vision_embeds"),
        continuous_batching=QEFFICIENT_CONTINUOUS_BATCHING,
        comp_ctx_lengths=QEFFICIENT_CCL,
    )


def _host():
    """The host protocol class (numpy only; its module reads this package's constants)."""
    from qeff_vision.families.qwen3_vl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.qwen3_vl_moe.export import Adapter

    return Adapter


register(Qwen3_VL_MoE, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
