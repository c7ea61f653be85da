"""Qwen3.5: Qwen3-VL's vision tower (no deepstack) over a hybrid decoder of Gated DeltaNet and full attention.

Everything image-side is Qwen3-VL's (ref: transformers v5.23 models/qwen3_5/modeling_qwen3_5.py:
the vision model, ``get_rope_index`` and the processor, ``Qwen3VLProcessor``, are Qwen3-VL's), so
the family reuses :class:`~qeff_vision.families.qwen3_vl.Qwen3_VL`'s token math and host and drops
the deepstack rows. The text model differs: three of every four layers (``layer_types`` entry
``linear_attention``) are Gated DeltaNet layers that keep a fixed-size state instead of a KV cache,
so the language program has ``conv_state.{i}`` / ``recurrent_state.{i}`` rows for them
(:meth:`Family.recurrent_layers <qeff_vision.families.base.Family.recurrent_layers>`) and
``past_key.{i}`` / ``past_value.{i}`` for the full-attention layers. Their dimensions are read
once, by :class:`LinearAttentionDims`.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_vision.contract.language_io import (
    CONV_DIM,
    CONV_KERNEL,
    STATE_KEY_DIM,
    STATE_VALUE_DIM,
    STATE_VALUE_HEADS,
)
from qeff_vision.families import register
from qeff_vision.families.base import (
    DISAGGREGATED_PROGRAMS,
    EVS_VIDEO_PRUNING,
    GENERATE,
    Features,
    ModelDescription,
    no,
    yes,
)
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.families.qwen3_5.tiny import write_tiny_checkpoint  # torch-free until called
from qeff_vision.families.qwen3_vl import Qwen3_VL


@dataclass(frozen=True)
class LinearAttentionDims:
    """The Gated DeltaNet dimensions of a Qwen3.5 text config (the only place that reads them).

    Attributes:
        key_heads: ``linear_num_key_heads`` (query/key heads; each serves several value heads).
        value_heads: ``linear_num_value_heads``.
        key_dim: ``linear_key_head_dim``.
        value_dim: ``linear_value_head_dim``.
        conv_kernel: ``linear_conv_kernel_dim``.
    """

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def read(cls, text: Section) -> LinearAttentionDims:
        """Read the five required values from the text section (one user error naming a missing one)."""
        return cls(
            key_heads=text.required("linear_num_key_heads"),
            value_heads=text.required("linear_num_value_heads"),
            key_dim=text.required("linear_key_head_dim"),
            value_dim=text.required("linear_value_head_dim"),
            conv_kernel=text.required("linear_conv_kernel_dim"),
        )

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: queries, keys and values."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_dims(self) -> dict[str, int]:
        """Values of the recurrent rows' fixed dimensions in the language IO table."""
        return {
            CONV_DIM: self.conv_dim,
            CONV_KERNEL: self.conv_kernel,
            STATE_VALUE_HEADS: self.value_heads,
            STATE_KEY_DIM: self.key_dim,
            STATE_VALUE_DIM: self.value_dim,
        }


FEATURES = dict(
    dynamic_vision_size=yes("vision_embeds sliced per chunk"),
    multi_resolution=yes("one vision graph, a specialization per resolution"),
    chunk_split=yes("causal attention over image tokens"),
    video=yes("2 frames per temporal patch; frames as timestamped placeholder runs"),
    video_pruning=EVS_VIDEO_PRUNING,
    deepstack=no("the architecture has no deepstack layers"),
    continuous_batching=yes("conv/recurrent states and KV caches indexed by batch_index"),
    disaggregated=DISAGGREGATED_PROGRAMS,
    single_program=yes(
        "one lang program: the patch-sequence tower composed in, gated on the patch count; "
        "one encode call per run of same-resolution images; conv/recurrent states kept per turn like "
        "the KV; images only"
    ),
    comp_ctx_lengths=no("not yet tested with recurrent layers"),
)


class Qwen3_5(Qwen3_VL):
    """Qwen3.5 (dense text models, e.g. Qwen3.5-27B)."""

    name = "qwen3_5"
    tasks = (GENERATE,)  # no published pooling checkpoint of this architecture
    title = "Qwen3.5"
    architectures = ("Qwen3_5ForConditionalGeneration",)
    model_types = ("qwen3_5",)
    features = Features(export=yes("Gated DeltaNet layers as an ONNX Scan over 64-token chunks"), **FEATURES)
    stacked_vision_rows = {}

    def linear_attention(self, model: ModelDescription) -> LinearAttentionDims:
        """The Gated DeltaNet dimensions of ``model`` (read once through the config view)."""
        return self._read(model, "linear_attention", self.read_linear_attention)[0]

    def read_linear_attention(self, reader: ConfigReader, model: ModelDescription) -> LinearAttentionDims:
        """Read :class:`LinearAttentionDims` from the text sub-config."""
        text = reader.section(self.text_config(model), self.text_config_key)
        return LinearAttentionDims.read(text)

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """None: no deepstack rows (Qwen3-VL's ``num_feature_layers`` does not exist here)."""
        return {}

    def language_dims(self, model: ModelDescription) -> dict[str, int]:
        """The table's fixed dimensions, the recurrent rows' included."""
        return {**super().language_dims(model), **self.linear_attention(model).state_dims()}


def _host():
    """Qwen3-VL's host protocol class (numpy only): same processor, rope index and clips."""
    from qeff_vision.families.qwen3_vl.host import Host

    return Host


def _export_adapter():
    """The export adapter class (imports torch, so only when a graph is built)."""
    from qeff_vision.families.qwen3_5.export import Adapter

    return Adapter


register(Qwen3_5, host=_host, adapter=_export_adapter, tiny=write_tiny_checkpoint)
