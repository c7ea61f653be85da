"""RMSNorm as the compiler-known ONNX function ``CustomRMSNorm`` (domain ``com.qti.aisw.onnx``).

Exported decomposed (Pow, ReduceMean, Sqrt, Div), an RMSNorm overflows as soon as the AI 100
compiler converts the graph to fp16 (``-convert-to-fp16``): ``x ** 2`` leaves the fp16 range for
|x| > 256, and real hidden states carry outliers far above that. The compiler maps a function
named ``CustomRMSNorm`` in domain ``com.qti.aisw.onnx`` (version 1, inputs ``hidden_states`` and
``weight``, float attribute ``epsilon``) to its own kernel, as QEfficient relies on for every
RMSNorm it exports (ref: quic/efficient-transformers QEfficient/customop/rms_norm.py,
``CustomRMSNorm`` / ``CustomRMSNormAIC``). Any other runtime inlines the body defined here: standard
ops that compute in fp32 whatever the graph's float type, then cast back, which is what a
dedicated kernel does and what transformers' RMSNorms do (they upcast to float32).

Which modules: every module whose class name ends in ``RMSNorm`` (transformers' naming for
``weight * x / sqrt(mean(x ** 2) + eps)``). A norm built without a weight (``with_scale=False``,
Gemma 4's ``v_norm`` and its router and projector pre-norms) exports the same function with a
weight of ones, so the compiler still sees its own kernel. A family whose norm scales by
``offset + weight`` (Gemma's ``1 + weight``) declares the offset per class name in its adapter
(:attr:`~qeff_vision.export.adapter.ExportAdapter.rms_norm_weight_offsets`); the offset is an
``Add`` on the weight in front of the function, as QEfficient folds ``+ 1`` into Gemma's weight.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import onnx
import torch
from onnx import AttributeProto, TensorProto, helper
from torch import nn

from qeff_vision.graph_file import model_nodes

DOMAIN = "com.qti.aisw.onnx"
DOMAIN_VERSION = 1
RMS_NORM = "CustomRMSNorm"
EPSILON = "epsilon"
# transformers names its RMSNorm classes ``<Model>RMSNorm`` (LlamaRMSNorm, Qwen2_5_VLRMSNorm, ...).
CLASS_SUFFIX = "RMSNorm"


class CustomRMSNormFunction(torch.autograd.Function):
    """``weight * x / sqrt(mean(x ** 2, -1) + epsilon)`` computed in fp32, returned in ``x``'s dtype."""

    @staticmethod
    def forward(hidden_states: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        """Eager result (also what tracing records as the example output)."""
        states = hidden_states.float()
        variance = states.pow(2).mean(-1, keepdim=True)
        normed = states * torch.rsqrt(variance + epsilon)
        return (weight.float() * normed).to(hidden_states.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, hidden_states, weight, epsilon):  # noqa: D102 - ONNX emission
        return g.op(f"{DOMAIN}::{RMS_NORM}", hidden_states, weight, epsilon_f=float(epsilon)).setType(
            hidden_states.type()
        )


def _epsilon_of(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float | int):
            return float(value)
    raise RuntimeError(f"{type(module).__name__}: RMSNorm without an epsilon attribute")


def _custom_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if weight is None:  # a unit-weight norm: the function's weight input is ones
        weight = torch.ones(hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    if module.rms_weight_offset:
        weight = weight + module.rms_weight_offset
    return CustomRMSNormFunction.apply(hidden_states, weight, module.rms_epsilon)


def use_custom_rms_norm(model: nn.Module, weight_offsets: Mapping[str, float] | None = None) -> int:
    """Make every ``*RMSNorm`` module of ``model`` call :class:`CustomRMSNormFunction`.

    Instances are patched (their ``forward``), not replaced, so module paths, parameter names and
    the exported node names (``.../input_layernorm/CustomRMSNorm``) stay those of the checkpoint.

    Args:
        model: The model to patch in place.
        weight_offsets: Class name -> offset added to the weight (Gemma: 1.0); absent means 0.

    Returns:
        How many modules were patched.

    Raises:
        RuntimeError: A ``*RMSNorm`` module has no 1-D ``weight`` or no epsilon.
    """
    offsets = dict(weight_offsets or {})
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if not name.endswith(CLASS_SUFFIX):
            continue
        weight = getattr(module, "weight", None)
        if weight is None and getattr(module, "with_scale", True) is False:
            module.weight = None  # unit weight (Gemma 4's v_norm, router and projector pre-norms)
        elif not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise RuntimeError(f"{name}: RMSNorm without a 1-D weight cannot export as {RMS_NORM}")
        module.rms_epsilon = _epsilon_of(module)
        module.rms_weight_offset = float(offsets.get(name, 0.0))
        module.forward = types.MethodType(_custom_forward, module)
        patched += 1
    return patched


def _epsilon_constant(name: str) -> onnx.NodeProto:
    # A Constant whose value_float refers to the function's ``epsilon`` attribute.
    node = helper.make_node("Constant", [], [name])
    reference = AttributeProto(name="value_float", type=AttributeProto.FLOAT, ref_attr_name=EPSILON)
    node.attribute.append(reference)
    return node


def rms_norm_function(opset: int) -> onnx.FunctionProto:
    """The ``CustomRMSNorm`` definition: fp32 inside (Cast in, CastLike out), attribute ``epsilon``."""
    nodes = [
        helper.make_node("Cast", ["hidden_states"], ["states"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["weight"], ["weight_fp32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["states", "states"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[-1], keepdims=1),
        _epsilon_constant("eps"),
        helper.make_node("Add", ["variance", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["rms"]),
        helper.make_node("Div", ["states", "rms"], ["normed"]),
        helper.make_node("Mul", ["weight_fp32", "normed"], ["scaled"]),
        helper.make_node("CastLike", ["scaled", "hidden_states"], ["output"]),
    ]
    return helper.make_function(
        DOMAIN,
        RMS_NORM,
        ["hidden_states", "weight"],
        ["output"],
        nodes,
        [helper.make_opsetid("", opset)],
        attributes=[EPSILON],
    )


def attach_rms_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the ``CustomRMSNorm`` definition (and the domain import) when the graph uses it."""
    opset = next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))
    used = any(node.domain == DOMAIN and node.op_type == RMS_NORM for node in model_nodes(model))
    if not used:
        return model
    if not any(f.domain == DOMAIN and f.name == RMS_NORM for f in model.functions):
        model.functions.append(rms_norm_function(opset))
    if not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
