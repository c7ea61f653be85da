"""``compile.language.subfunctions``: decoder layers exported as ONNX functions, one per layer body.

Every family (default tier: one per decoder and state kind, ``tests.helpers.tiered``; every family
under ``-m slow``): the function form's structure (a call per layer, one function per distinct
body, weights per layer passed to the calls, ``*_InternalRetainedState`` inside bodies, the same
graph IO as the inline form); chunked generation on onnxruntime token-identical to transformers
and to the inline export, logits equal; at device precision (fp16 emulation, automatic plan
calibrated on the function form) tokens identical to the inline form's and logits within 1e-4 of
their range. The single-program composition of the function form runs token-identical to
transformers. Deployment modes through ``compile``: tests/test_subfunctions_compile.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.compile.calibration import prompt_ranges
from qeff_vision.export_record import read_export
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.numerics.layer_functions import (
    KERNEL_DOMAINS,
    SEPARATOR,
    expanded_plan,
    folded_plan,
    layer_functions,
    load_flat_graph,
)
from qeff_vision.numerics.plan import auto_plan
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers
from tests.family_runtime import FamilyRuntime

FAMILIES = [family.name for family in all_families()]
# Calibration inputs are generated for the token-merge IO (tests/test_device_precision_families.py).
MERGE = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE]
NEW_TOKENS = 6
# Every default-tier family, Gemma 4 included: its function export used to crash in torch's
# function extraction (an invalid std::sort comparator over too many scope groups); the exporter now
# records scopes for the layers only (qeff_vision/export/subfunctions.py, _scopes_of_functions).
TIER = helpers.DEFAULT_TIER_FAMILIES
WHOLE_IMAGE_CHUNKS = {"molmo2": (32,)}  # its 22-token test image in one chunk
DEVICE_TOLERANCE = 1e-4  # of the logit range: both forms run the same nodes in the same order


@pytest.fixture(scope="session")
def function_export(tiny_checkpoint, tmp_path_factory):
    """``function_export(family) -> Path``: the tiny checkpoint exported with layer functions."""
    built = {}

    def build(family: str):
        if family not in built:
            from qeff_vision.exporter import export_model

            out = tmp_path_factory.mktemp(f"functions-{family}") / "export"
            export_model(tiny_checkpoint(family), out, progress=None, subfunctions=True)
            built[family] = out
        return built[family]

    return build


def _lang(export) -> onnx.ModelProto:
    return onnx.load(str(export / "lang" / "model.onnx"), load_external_data=False)


def _signature(function: onnx.FunctionProto) -> tuple:
    """What makes two bodies one function: ops in order (with domains), inputs and outputs counted."""
    ops = tuple((node.domain, node.op_type) for node in function.node)
    return ops, len(function.input), len(function.output)


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES, TIER))
def test_each_layer_is_a_call_of_one_function_per_signature(family, function_export, exported):
    functions, inline = function_export(family), exported(family)
    model = _lang(functions)
    layers = layer_functions(model)
    calls = [node for node in model.graph.node if (node.domain, node.op_type) in layers]
    num_layers = read_export(functions)["num_layers"]
    # One call per decoder layer (mllama: self- and cross-attention layers alike) and a function
    # per distinct body: no two functions have the same signature.
    assert len(calls) == num_layers
    signatures = [_signature(function) for function in layers.values()]
    assert len(set(signatures)) == len(signatures) <= num_layers
    assert read_export(functions)["programs"]["lang"]["functions"] == {
        name: sum(1 for call in calls if call.op_type == name) for _, name in layers
    }
    # The program's IO is the inline form's: names, dtypes, symbolic axes.
    manifests = read_export(functions)["programs"]["lang"], read_export(inline)["programs"]["lang"]
    assert manifests[0]["inputs"] == manifests[1]["inputs"]
    assert manifests[0]["outputs"] == manifests[1]["outputs"]
    # Each layer's weights stay initializers of the main graph, passed to its own call.
    weights = {tensor.name for tensor in model.graph.initializer}
    passed = [set(call.input) & weights for call in calls]
    assert all(passed) and not set.intersection(*passed)
    # A retained state is public only at the graph's outputs; inside a shared body it is internal.
    for function in layers.values():
        values = {*function.output, *(o for node in function.node for o in node.output)}
        assert not any(name.endswith(symbols.RETAINED_SUFFIX) for name in values)
    internal = [o for f in layers.values() for o in f.output if o.endswith(symbols.INTERNAL_RETAINED_SUFFIX)]
    assert internal
    retained = {o.name for o in model.graph.output if o.name.endswith(symbols.RETAINED_SUFFIX)}
    from_calls = {o for call in calls for o in call.output} & retained
    assert from_calls, "the caches are written inside the layer functions"
    # Our kernels stay functions of their own; no body's Range reads a function parameter
    # (QEfficient's compiler rule; a Range over a shape computed in the body is static per
    # specialization, as the MoE dispatch's and the gated delta rule's are).
    assert all(f.domain in KERNEL_DOMAINS for f in model.functions if (f.domain, f.name) not in layers)
    for function in layers.values():
        ranges = [node for node in function.node if node.op_type == "Range"]
        assert not any(set(function.input) & set(node.input) for node in ranges)


def _prompt(runtime: FamilyRuntime):
    return runtime.inputs(["<image>", "Describe this image."], [helpers.image(100, 150)])


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES, TIER))
def test_function_form_generates_as_the_inline_form(family, function_export, exported, hf_model):
    model, processor = hf_model(family)
    functions = FamilyRuntime(family, function_export(family), model, processor)
    inline = FamilyRuntime(family, exported(family), model, processor)
    processed = _prompt(functions)
    # Chunks of 16 tokens (an image straddles chunks; Molmo2 keeps an image in one chunk), then
    # decode: each against transformers.
    seq_lens = WHOLE_IMAGE_CHUNKS.get(family, (16,))
    _, ours = functions.run(processed, seq_lens)
    _, theirs = inline.run(processed, seq_lens)
    assert ours.tokens == theirs.tokens
    worst = max(float(np.abs(a - b).max()) for a, b in zip(ours.logits, theirs.logits))
    assert worst <= 1e-5, worst


def _device_run(export, processed, length: int):
    """Tokens and logits at device precision with the automatic plan calibrated on this export."""
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: length,
        symbols.VISION_SIZE: length,
        symbols.CTX_LEN: 512,
    }
    ranges = prompt_ranges(export, None, [bucket, {**bucket, symbols.SEQ_LEN: 1}], [(100, 150)])
    plans = {}
    for program in ("vision", "lang"):
        flat = load_flat_graph(export / program / "model.onnx")
        plans[program] = folded_plan(auto_plan(flat, ranges[program]))
    shape = LanguageShape((PrefillBucket(length, length),), length, length + 64)
    generator = generator_for_export(export, shape, fp32_values=plans)
    return generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True), plans


@pytest.mark.parametrize("family", helpers.tiered(MERGE, TIER))
def test_device_precision_of_the_function_form_is_the_inline_forms(
    family, function_export, exported, hf_model
):
    model, processor = hf_model(family)
    processed = helpers.as_numpy(
        helpers.process(
            processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
        )
    )
    length = processed["input_ids"].shape[1] + 3
    ours, plans = _device_run(function_export(family), processed, length)
    theirs, inline_plans = _device_run(exported(family), processed, length)
    assert ours.tokens == theirs.tokens
    for a, b in zip(ours.logits, theirs.logits):
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() <= DEVICE_TOLERANCE * (b.max() - b.min())
    # The plan is the inline one (tiny random weights: the rotary angle chains, outside the layers).
    assert len(plans["lang"]) == len(inline_plans["lang"])
    assert not any(SEPARATOR in name for name in plans["lang"])


def test_a_plan_folds_to_body_names_and_expands_to_every_call(function_export):
    flat = load_flat_graph(function_export("qwen2_5_vl") / "lang" / "model.onnx")
    model = _lang(function_export("qwen2_5_vl"))
    (function,) = layer_functions(model).values()
    body_value = next(o for node in function.node if node.op_type == "MatMul" for o in node.output)
    calls = [n.name for n in model.graph.node if n.op_type == function.name]
    inlined = [f"{call}{SEPARATOR}{body_value}" for call in calls]
    produced = {o for node in flat.graph.node for o in node.output}
    assert set(inlined) <= produced and len(calls) == 2
    # One call's value in a plan keeps the body value, so every call's copy.
    assert folded_plan([inlined[0], "logits"]) == [body_value, "logits"]
    assert expanded_plan(flat, [body_value]) == set(inlined)
    assert not layer_functions(flat) and {f.domain for f in flat.functions} <= KERNEL_DOMAINS


def test_single_program_of_the_function_form_matches_transformers(function_export, hf_model):
    from qeff_vision.compile.single_program import write_single_program
    from qeff_vision.runtime.session import OnnxProgram
    from tests.test_single_program import SEQ_LENS, _generator

    family = "qwen2_5_vl"
    export = function_export(family)
    path = write_single_program(export, export / "vision" / "model.onnx", export / "lang" / "model.onnx")
    composed = onnx.load(str(path), load_external_data=False)
    assert layer_functions(composed), "the composed program keeps the layer functions"
    runtime = FamilyRuntime(family, export, *hf_model(family))
    generator = _generator(runtime, OnnxProgram(path))
    processed = _prompt(runtime)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, f"{family} single S={SEQ_LENS[family]}")


def _plan_entries(model: onnx.ModelProto, plan, ranges, scopes: dict[str, int]) -> list[tuple]:
    """Each plan entry as (layer or -1, producing op, its peak to 6 digits), sorted.

    A value is located by its producer's node name: the layer whose scope (or call, in a flat
    graph) it starts with. The two forms name values differently; both compute the same values
    with the same nodes, so each layer's entries have the same ops and peaks.
    """
    producer = {o: node for node in model.graph.node for o in node.output}

    def layer(node) -> int:
        return next((i for prefix, i in scopes.items() if node.name.startswith(prefix)), -1)

    return sorted(
        (layer(producer[name]), producer[name].op_type, float(f"{ranges[name]:.6g}")) for name in plan
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma4"])
def test_a_plan_on_the_function_form_is_the_inline_forms(family, function_export, tiny_checkpoint, tmp_path):
    """Values inside layer functions are calibrated: the same per-layer plan as the inline graph's.

    The inputs carry hidden states near fp16's limit, so the plan holds values inside every layer
    (residual sums and what reads them), not only the rotary angles outside them.
    """
    import torch

    from qeff_vision.exporter import export_model
    from qeff_vision.graph_file import load_graph
    from qeff_vision.numerics.plan import value_ranges

    cse = torch._C._jit_pass_cse
    torch._C._jit_pass_cse = lambda graph: False  # the inline reference traced as the function form is
    try:
        inline_dir = export_model(tiny_checkpoint(family), tmp_path / "inline", progress=None).out_dir
    finally:
        torch._C._jit_pass_cse = cse
    functions = function_export(family)
    model = _lang(functions)
    layers = layer_functions(model)
    calls = [node for node in model.graph.node if (node.domain, node.op_type) in layers]
    flat = load_flat_graph(functions / "lang" / "model.onnx")
    inline = load_graph(inline_dir / "lang" / "model.onnx")
    image_token = read_export(functions)["image_token_id"]
    rng = np.random.RandomState(0)
    feeds = {}
    for value in inline.graph.input:
        if value.name in {t.name for t in inline.graph.initializer}:
            continue
        dims = [d.dim_value or 8 for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if value.name == symbols.INPUT_IDS:
            feeds[value.name] = np.full(dims, image_token, dtype)
        elif value.name == symbols.POSITION_IDS:
            feeds[value.name] = np.broadcast_to(np.arange(dims[-1]), dims).astype(dtype)
        elif value.name == symbols.VISION_EMBEDS:
            feeds[value.name] = (rng.randn(*dims) * 2e4).astype(dtype)
        else:
            feeds[value.name] = np.zeros(dims, dtype)
    our_ranges = value_ranges(flat, functions / "lang", [feeds])
    their_ranges = value_ranges(inline, inline_dir / "lang", [feeds])
    ours, theirs = auto_plan(flat, our_ranges), auto_plan(inline, their_ranges)
    inside = {name.split(SEPARATOR)[0] for name in ours if SEPARATOR in name}
    assert inside == {call.name for call in calls}, "every layer's function body has values in the plan"
    calls_at = {call.name + SEPARATOR: i for i, call in enumerate(calls)}
    scopes = {call.name.rsplit("/", 1)[0] + "/": i for i, call in enumerate(calls)}
    assert _plan_entries(flat, ours, our_ranges, calls_at) == _plan_entries(
        inline, theirs, their_ranges, scopes
    )
    # The compiled plan names body values once; expanded, it keeps at least every call's own.
    folded = folded_plan(ours)
    assert set(ours) <= expanded_plan(flat, folded) and len(folded) < len(ours)


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES, TIER))
def test_mx_rounding_reads_the_same_weights_in_both_forms(family, function_export, exported):
    """``-mxfp6-matmul`` emulation rounds the weights the matmuls read, inside layer bodies too."""
    from qeff_vision.graph_file import load_graph
    from qeff_vision.numerics.mx import matmul_weights

    flat = load_flat_graph(function_export(family) / "lang" / "model.onnx")
    inline = load_graph(exported(family) / "lang" / "model.onnx")
    ours, theirs = matmul_weights(flat), matmul_weights(inline)

    def shapes(model, found):  # (reduction axis, stored dims) of each weight; names differ by form
        dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
        return sorted((axis, dims.get(name)) for name, axis in found.items())

    assert ours and shapes(flat, ours) == shapes(inline, theirs)
    # Read in place, the function form's main graph shows only the matmuls outside the layers.
    assert len(matmul_weights(load_graph(function_export(family) / "lang" / "model.onnx"))) < len(ours)
