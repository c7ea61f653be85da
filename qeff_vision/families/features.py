"""The feature matrix of a family: every feature declared once, "no (not declared)" by default."""

from __future__ import annotations

from dataclasses import dataclass

from qeff_vision.contract.deployment_programs import MODES


@dataclass(frozen=True)
class Support:
    """Whether a feature is supported, and why not when it is not.

    Attributes:
        supported: The feature works.
        note: A remark, or the reason it does not.
        bidirectional_images: (``chunk_split`` only) the split is refused because the tokens of one
            image attend to each other both ways, which the exported decoder's mask implements:
            one declaration drives both the planner and the export (see :func:`bidirectional`).
    """

    supported: bool
    note: str = ""
    bidirectional_images: bool = False

    def cell(self) -> str:
        """Short table cell: ``yes``, or ``no (reason)``."""
        if self.supported:
            return "yes" + (f" ({self.note})" if self.note else "")
        return f"no ({self.note})"


def yes(note: str = "") -> Support:
    """A supported feature, with an optional remark."""
    return Support(True, note)


def no(reason: str) -> Support:
    """An unsupported feature; the reason is mandatory and shown to users."""
    return Support(False, reason)


def single_program_not_built(reason: str) -> Support:
    """``deployment: single`` not built for the declaring family, for the family's own ``reason``.

    The single program composes a vision graph of [..., C, H, W] images or a patch sequence with a
    declared patch axis, whose outputs are retained language inputs (compile/single_program.py);
    a family outside that, or not tried, says why here (generic code lists no family).
    """
    return no(f"not built for this family: {reason}")


def bidirectional(reason: str) -> Support:
    """``chunk_split``: no, because one image's placeholders attend to each other both ways (Gemma 3).

    The exported decoder builds that two-way mask from this declaration, and the planner keeps
    every image inside one chunk.
    """
    return Support(False, reason, bidirectional_images=True)


#: A feature the family has not declared: unsupported until the family says otherwise.
NOT_DECLARED = Support(False, "not declared")
#: Shared declarations (each family states them; nothing defaults to "yes").
NO_DEEPSTACK = no("the architecture has no deepstack layers")
NO_VIDEO_PRUNING = no("the family takes no video")
#: EVS as vLLM prunes Qwen-VL clips (runtime/video_pruning.py); M-RoPE positions recomputed by the host.
EVS_VIDEO_PRUNING = yes("EVS: video_pruning_rate drops redundant clip rows, positions recomputed")
QEFFICIENT_CONTINUOUS_BATCHING = yes("batch_index input, full_batch_size KV slots as QEfficient")
#: Every graph of the token-merge or cross-attention kinds splits into prefill and decode programs.
DISAGGREGATED_PROGRAMS = yes(
    "deployment: disaggregated, lang_prefill at batch 1, lang_decode at full_batch_size"
)
QEFFICIENT_CCL = yes("comp_ctx_lengths input; attention reads that many leading KV slots")


@dataclass(frozen=True)
class Features:
    """Feature matrix shown by ``qeff-vision families``; every feature is "no (not declared)" by default.

    Attributes:
        export: Both programs export to ONNX.
        dynamic_vision_size: The decoder's ``vision_embeds`` has a symbolic ``vision_size`` axis.
        multi_resolution: One vision graph serves several image resolutions.
        chunk_split: An image's placeholder tokens may be split across prefill chunks. False for
            families whose image tokens attend to each other bidirectionally (:func:`bidirectional`).
        video: Video inputs are exported and specialized.
        video_pruning: Spec/run option ``video_pruning_rate``: the host drops a clip's most
            redundant rows (EVS) and recomputes the kept tokens' positions.
        deepstack: The vision program also returns features of intermediate layers that the decoder
            adds to its first layers' hidden states (Qwen3-VL's ``deepstack_features``).
        continuous_batching: The language program exports with ``batch_index`` and
            ``full_batch_size`` KV slots (spec key ``full_batch_size``).
        comp_ctx_lengths: The language program exports with the ``comp_ctx_lengths`` input
            (compute-context lengths; spec key ``compile.comp_ctx_lengths``).
        single_program: ``deployment: single``: one program holding the encoder and the decoder.
        disaggregated: ``deployment: disaggregated``: prefill and decode programs compiled from
            the language graph, the host handing each finished prefill's KV to a decode slot.
    """

    export: Support = NOT_DECLARED
    dynamic_vision_size: Support = NOT_DECLARED
    multi_resolution: Support = NOT_DECLARED
    chunk_split: Support = NOT_DECLARED
    video: Support = NOT_DECLARED
    video_pruning: Support = NOT_DECLARED
    deepstack: Support = NOT_DECLARED
    continuous_batching: Support = NOT_DECLARED
    comp_ctx_lengths: Support = NOT_DECLARED
    single_program: Support = NOT_DECLARED
    disaggregated: Support = NOT_DECLARED

    def deployment(self, mode: str) -> Support:
        """Support of deployment ``mode`` (``dual``, ``single`` or ``disaggregated``)."""
        feature = MODES[mode].feature  # the mode table names the cell (none: every family)
        return getattr(self, feature) if feature else Support(True)

    def rows(self) -> list[tuple[str, Support]]:
        """Feature name and support, in table order."""
        return [
            ("export", self.export),
            ("dynamic vision_size", self.dynamic_vision_size),
            ("multi-resolution", self.multi_resolution),
            ("chunk split allowed", self.chunk_split),
            ("video", self.video),
            ("video pruning", self.video_pruning),
            ("deepstack", self.deepstack),
            ("continuous batching", self.continuous_batching),
            ("comp_ctx_lengths", self.comp_ctx_lengths),
            ("dual QPC", Support(True, "deployment: dual (default), vision + language programs")),
            ("disaggregated", self.disaggregated),
            ("single QPC", self.single_program),
        ]
