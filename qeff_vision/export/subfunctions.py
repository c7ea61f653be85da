"""Decoder layers as ONNX local functions (QEfficient's ``use_onnx_subfunctions``).

Spec key ``compile.language.subfunctions``.

The TorchScript exporter's ``export_modules_as_functions`` groups the nodes traced inside each
instance of the given module classes into one ONNX local function per distinct body and replaces
each instance by a call. Instances whose bodies differ (sliding vs full attention, a recurrent
layer, a shared-KV layer, MoE vs dense MLP, different widths) get functions of their own
(``Gemma4TextDecoderLayer``, ``Gemma4TextDecoderLayer.1``, ...): one function per layer signature,
found by the exporter from the traced bodies, not declared. The weights stay graph inputs
(initializers after :mod:`qeff_vision.export.weights` writes them) passed to every call, so each
layer keeps its own weights. A compiler given ``-sub-functions`` then works on one body per
signature instead of one copy per layer.

What the exporter needs around it (facts from QEfficient ``utils/torch_patches.py`` and
``utils/export_utils.py`` at ebf55e8, and torch PR #104880):

* Module attributes become function attributes through a tracking hook that fails on
  transformers' modules (``_jit_pass_onnx_track_scope_attributes(): incompatible function
  arguments``) and is not needed: no attribute is tracked (:func:`exporting_functions`).
* The tracer's common-subexpression pass ignores module scopes: a computation repeated in every
  layer (a mask slice, a position cast) is merged into the first layer's copy, which then
  exports it to the others, so the first layer's function differs from the rest. It is off while
  exporting functions.
* A graph output computed inside a function leaves the call under a generated name, and the
  function body keeps the output name of the instance it was built from. Retained-state outputs
  are therefore exported as ``X_InternalRetainedState`` (the body's name, shared by every call)
  and the graph outputs renamed back to ``X_RetainedState`` by position
  (:func:`restore_output_names`), as QEfficient's ``RenameFunctionOutputsTransform`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import onnx
import torch
from torch import nn

from qeff_vision.numerics.layer_functions import KERNEL_DOMAINS
from qeff_vision.symbols import INTERNAL_RETAINED_SUFFIX, RETAINED_SUFFIX

# Attribute names of the module lists holding repeated layers (transformers' decoder ``layers``;
# vision towers' ``blocks``).
LAYER_LISTS = ("layers",)


def layer_classes(module: nn.Module, lists: Sequence[str] = LAYER_LISTS) -> set[type[nn.Module]]:
    """The classes of the repeated layers inside ``module``.

    Children of every ``nn.ModuleList`` whose attribute name is in ``lists`` (a cross-attention
    stack has two classes).
    """
    found: set[type[nn.Module]] = set()
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] in lists:
            found.update(type(layer) for layer in child)
    return found


@contextlib.contextmanager
def exporting_functions(module: nn.Module) -> Iterator[None]:
    """Patch the TorchScript exporter for ``export_modules_as_functions`` (see the module docstring).

    Scopes are recorded for ``module`` itself and the instances of the exported classes only
    (:func:`_scopes_of_functions`), and no attribute-tracking hook is registered.
    """
    from torch.onnx._internal.torchscript_exporter import utils as exporter_utils

    setup, cse = exporter_utils._setup_trace_module_map, torch._C._jit_pass_cse
    exporter_utils._setup_trace_module_map = _scopes_of_functions
    torch._C._jit_pass_cse = lambda graph: False
    try:
        yield
    finally:
        exporter_utils._setup_trace_module_map, torch._C._jit_pass_cse = setup, cse


def _scopes_of_functions(model: nn.Module, export_modules_as_functions) -> set[str]:
    """The exporter's ``_setup_trace_module_map``, with scopes for the root, the layers and their holders.

    The exporter gives every submodule a scope, and its function extraction
    (``torch/csrc/jit/passes/onnx/function_extraction.cpp``, ``SortScopesByMaxDepth``) orders the
    groups of identical scopes with ``std::sort`` under the comparator ``depth(a) >= depth(b)``,
    which is not a strict weak order: with more than 16 groups at equal depths the sort runs past
    the end of its array (undefined behaviour; the order of the groups comes from a hash map keyed
    by pointers, so it changes from run to run). Gemma 4's heterogeneous stack has enough distinct
    submodule scopes to cross 16: its function export died with a segmentation fault in that pass
    in about one run of four here. With scopes only for the root (every node needs one), the
    layers and the modules that hold them, the groups are the layer signatures plus a few single
    modules, far below 16; every node inside a layer belongs to the layer's scope directly, which
    is all the extraction reads. No attribute is tracked either (the tracking hook fails on
    transformers' modules, and no function attribute is needed). Nodes outside the layers lose
    their submodule prefix (``/model/language_model/Gather``, not ``.../embed_tokens/Gather``);
    a call keeps the inline layer's name.

    Args:
        model: The module being exported.
        export_modules_as_functions: The set of module classes given to ``torch.onnx.export``.

    Returns:
        The qualified type names of those classes (what the exporter's version returns).
    """
    classes = tuple(export_modules_as_functions)
    named = list(model.named_modules())
    layers = [name for name, child in named if isinstance(child, classes)]
    # The layers' ancestors keep their scopes too, so a call is named as the inline layer's nodes
    # are (``/model/language_model/layers.3/...``).
    ancestors = {name.rsplit(".", depth)[0] for name in layers for depth in range(name.count(".") + 1)}
    scopes = {}
    for name, child in named:
        if child is model or name in ancestors:
            atoms = name.split(".")  # the exporter's scope name: from the last non-numeric atom on
            first = next((i for i in reversed(range(len(atoms))) if not atoms[i].isnumeric()), 0)
            scopes[child] = torch._C._jit_onnx_create_full_scope_name(
                torch.typename(type(child)), ".".join(atoms[first:])
            )
    torch.jit._trace._trace_module_map = scopes
    return {torch.typename(cls) for cls in classes}


def internal_name(name: str) -> str:
    """``X_RetainedState`` -> ``X_InternalRetainedState``; any other name unchanged."""
    if name.endswith(RETAINED_SUFFIX):
        return name[: -len(RETAINED_SUFFIX)] + INTERNAL_RETAINED_SUFFIX
    return name


def restore_output_names(model: onnx.ModelProto, names: Sequence[str]) -> None:
    """Give the graph outputs ``names`` by position (a call's output has a generated name)."""
    graph = model.graph
    pairs = zip(graph.output, names, strict=True)
    renamed = {value.name: name for value, name in pairs if value.name != name}
    if not renamed:
        return
    for node in graph.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) for n in node.output]
    for value in (*graph.output, *graph.value_info):
        value.name = renamed.get(value.name, value.name)


def layer_functions(model: onnx.ModelProto) -> list[onnx.FunctionProto]:
    """The model's layer functions (local functions other than our kernels)."""
    return [f for f in model.functions if f.domain not in KERNEL_DOMAINS]


def layer_calls(model: onnx.ModelProto) -> dict[str, int]:
    """Layer function name -> calls of it in the main graph."""
    names = {(f.domain, f.name): f.name for f in layer_functions(model)}
    calls = dict.fromkeys(names.values(), 0)
    for node in model.graph.node:
        key = (node.domain, node.op_type)
        if key in names:
            calls[names[key]] += 1
    return calls


def hoist_weight_transposes(model: onnx.ModelProto, weights: Mapping[str, int]) -> int:
    """Move each layer body's ``Transpose`` of a 2-D weight out to the main graph, one per call.

    Inline, a weight whose only reader is ``Transpose(perm=[1, 0])`` is stored transposed and the
    node dropped (:func:`qeff_vision.export.weights.write_weights`). In a body the weight is a
    function parameter, so the tracer's ``Transpose`` stays there and the weight would be stored
    as traced, transposed again by every call. Here a parameter read only by such a ``Transpose``
    (for every call: a 2-D weight the main graph reads nowhere else) loses the node in the body,
    and each call reads the weight through a ``Transpose`` in the main graph, which the writer
    then folds as it does inline: the same stored weights and the same matmuls as the inline form
    (what the MX emulation and the compiler's matmul weight handling look for).

    Args:
        model: The traced graph (weights still graph inputs).
        weights: Weight input name -> rank.

    Returns:
        How many body parameters were hoisted.
    """
    functions = {(f.domain, f.name): f for f in model.functions if f.domain not in KERNEL_DOMAINS}
    calls: dict[tuple[str, str], list[onnx.NodeProto]] = {}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        key = (node.domain, node.op_type)
        if key in functions:
            calls.setdefault(key, []).append(node)
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    hoisted, transposes = 0, []
    for key, function in functions.items():
        body_readers: dict[str, list[onnx.NodeProto]] = {}
        for node in function.node:
            for name in node.input:
                body_readers.setdefault(name, []).append(node)
        for index, param in enumerate(function.input):
            nodes = body_readers.get(param, [])
            if len(nodes) != 1 or not _is_2d_transpose(nodes[0]):
                continue
            actual = [call.input[index] for call in calls.get(key, [])]
            if not actual or any(weights.get(a) != 2 or readers.get(a) != 1 for a in actual):
                continue
            transpose = nodes[0]
            for node in function.node:  # the body reads the parameter itself, already transposed
                node.input[:] = [param if n == transpose.output[0] else n for n in node.input]
            function.node.remove(transpose)
            for call in calls[key]:
                hoisted_name = f"{call.input[index]}_transposed"
                transposes.append(
                    onnx.helper.make_node(
                        "Transpose", [call.input[index]], [hoisted_name], perm=[1, 0], name=hoisted_name
                    )
                )
                call.input[index] = hoisted_name
            hoisted += 1
    if transposes:  # first: they read graph inputs only
        nodes = [*transposes, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return hoisted


def _is_2d_transpose(node: onnx.NodeProto) -> bool:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and perm in (None, [1, 0])
