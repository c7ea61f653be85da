"""Decoder layers exported as ONNX functions, as the numerics read them: bodies inlined per call.

A graph exported with ``compile.language.subfunctions`` (:mod:`qeff_vision.export.subfunctions`)
calls one local function per layer signature; the values a layer computes live in the function
body, shared by every call. Calibration, the device-precision emulation, the MX weight rounding
and the overflow report all walk node outputs of the main graph, so they read the graph through
:func:`load_flat_graph`: every call of a layer function replaced by a copy of its body, whose
inner values are named ``<call node>|<body value>``. Each call's values are then recorded,
rounded and reported on their own, exactly as in a graph exported inline. Our kernels
(``CtxScatter``, ``CustomRMSNorm``, ``GatedDeltaRule``) stay functions, as they are in an inline
export.

Why inline rather than read the bodies in place: a body value has one name and a value per call;
everything that records or rounds per value (sliced sessions, per-node fp16 casts) would have to
thread the call through. Inlining keeps one code path for both forms.

A precision plan lists values the compiler keeps in fp32. The compiler compiles one body for all
calls of a function, so a body value is kept for every call or none: :func:`folded_plan` turns a
plan computed on the flat graph into body names (a body value is kept when any call needs it),
and :func:`expanded_plan` turns such a plan back into the flat graph's names for the emulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import onnx
from onnx import helper

from qeff_vision.graph_file import load_graph

# Domains of our kernels (KV ops, RMSNorm, gated delta rule): functions in every export, never
# a layer. (Spelled by export/kv_ops.py, export/rms_norm.py and export/gated_delta.py; the layer
# functions' domains are the modules of the layer classes, e.g.
# ``transformers.models.qwen2_5_vl.modeling_qwen2_5_vl``.)
KERNEL_DOMAINS = frozenset({"com.qualcomm.cloud", "com.qti.aisw.onnx", "com.qeff_vision"})
# Between a call node's name and a body value's name in an inlined value's name.
SEPARATOR = "|"


def layer_functions(model: onnx.ModelProto) -> dict[tuple[str, str], onnx.FunctionProto]:
    """(domain, name) -> layer function of ``model`` (its local functions other than our kernels)."""
    return {(f.domain, f.name): f for f in model.functions if f.domain not in KERNEL_DOMAINS}


def body_name(name: str) -> str:
    """The body value an inlined value copies (``call|value`` -> ``value``); other names unchanged."""
    return name.split(SEPARATOR, 1)[1] if SEPARATOR in name else name


def inline_layer_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every call of a layer function replaced by its body (see the module docstring).

    A body attribute that refers to a function attribute (the exporter turns a constant that
    differs between layers of one signature into one: Gemma 4's shared-KV layers) takes the
    call's value.

    Raises:
        ValueError: A body with control flow or a layer call of its own, an attribute the call does
            not give, or two layer functions naming a value alike (a folded plan would be ambiguous).
    """
    layers = layer_functions(model)
    if not layers:
        return model
    seen: dict[str, str] = {}
    for function in layers.values():
        for node in function.node:
            if (node.domain, node.op_type) in layers or any(a.g.node or a.graphs for a in node.attribute):
                raise ValueError(f"{function.name}: nested layer call or control flow in a layer body")
            for name in node.output:
                if seen.setdefault(name, function.name) != function.name:
                    raise ValueError(f"{name}: a value of both {seen[name]} and {function.name}")
    nodes = []
    for node in model.graph.node:
        function = layers.get((node.domain, node.op_type))
        if function is None:
            nodes.append(node)
            continue
        nodes.extend(_body(function, node))
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    kept = [f for f in model.functions if f.domain in KERNEL_DOMAINS]
    del result.functions[:]
    result.functions.extend(kept)
    imports = {entry.domain: entry.version for entry in result.opset_import}
    for function in layers.values():
        for entry in function.opset_import:
            imports.setdefault(entry.domain, entry.version)
    del result.opset_import[:]
    result.opset_import.extend(helper.make_opsetid(d, v) for d, v in sorted(imports.items()))
    return result


def _body(function: onnx.FunctionProto, call: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Copies of ``function``'s nodes for one ``call``, its formal parameters bound to the call's values."""
    bound = dict(zip(function.input, call.input))
    bound.update(zip(function.output, call.output))
    prefix = call.name or f"{call.op_type}_{call.output[0]}"

    def renamed(name: str) -> str:
        if not name:
            return name
        return bound.get(name, f"{prefix}{SEPARATOR}{name}")

    given = {attribute.name: attribute for attribute in call.attribute}
    given.update({a.name: a for a in function.attribute_proto if a.name not in given})  # defaults
    copies = []
    for node in function.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{prefix}{SEPARATOR}{node.name}"
        for attribute in copy.attribute:
            if attribute.ref_attr_name:
                if attribute.ref_attr_name not in given:
                    raise ValueError(f"{call.name}: no value for attribute {attribute.ref_attr_name}")
                name = attribute.name
                attribute.CopyFrom(given[attribute.ref_attr_name])
                attribute.name = name
        copy.input[:] = [renamed(n) for n in node.input]
        copy.output[:] = [renamed(n) for n in node.output]
        copies.append(copy)
    return copies


def load_flat_graph(path: str | Path) -> onnx.ModelProto:
    """The graph at ``path`` (as :func:`~qeff_vision.graph_file.load_graph`), layer functions inlined."""
    return inline_layer_functions(load_graph(path))


def folded_plan(names: Iterable[str]) -> list[str]:
    """A plan over a flat graph as the compiled graph names it: body values once, in first order."""
    return list(dict.fromkeys(body_name(name) for name in names))


def expanded_plan(flat: onnx.ModelProto, names: Iterable[str]) -> set[str]:
    """The flat graph's node outputs a (folded) plan keeps: every call's copy of a named body value."""
    wanted = set(names)
    return {o for node in flat.graph.node for o in node.output if o in wanted or body_name(o) in wanted}
