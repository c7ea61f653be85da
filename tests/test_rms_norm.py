"""Every family's RMSNorms export as the compiler-known ``CustomRMSNorm`` function, none decomposed.

Parametrized over the registry: the exported graphs of each tiny checkpoint (text and vision) are
walked for the decomposed pattern (a ReduceMean over a square), and the function calls are counted
against the checkpoint's RMSNorm modules. That onnxruntime runs the function bodies unpatched is
shown by the parity tests, which run these same graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qeff_vision.export.rms_norm import (
    DOMAIN,
    EPSILON,
    RMS_NORM,
    CustomRMSNormFunction,
    attach_rms_norm,
)
from qeff_vision.families import all_families

FAMILIES = [family.name for family in all_families()]
PROGRAMS = ("vision", "lang")


def _decomposed_norms(graph: onnx.GraphProto) -> list[str]:
    """Names of ReduceMean nodes whose input is a square (Pow(x, 2) or Mul(x, x)): a decomposed RMSNorm."""
    producers = {output: node for node in graph.node for output in node.output}
    constants = {
        node.output[0]: onnx.numpy_helper.to_array(node.attribute[0].t)
        for node in graph.node
        if node.op_type == "Constant"
        and node.attribute
        and node.attribute[0].name == "value"
        # Large constants live in model.onnx.data (a table, never the exponent 2).
        and not onnx.external_data_helper.uses_external_data(node.attribute[0].t)
    }
    found = []
    for node in graph.node:
        if node.op_type != "ReduceMean":
            continue
        source = producers.get(node.input[0])
        if source is None:
            continue
        if source.op_type == "Mul" and source.input[0] == source.input[1]:
            found.append(node.name)
        if source.op_type == "Pow" and np.all(constants.get(source.input[1], np.nan) == 2):
            found.append(node.name)
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rms_norm_exports_as_custom_function(family, exported, hf_model):
    """No decomposed RMSNorm in any graph; one CustomRMSNorm call per RMSNorm module transformers
    runs on an image prompt (a tower the programs never run, Gemma 4's audio one, has none), epsilon
    kept."""
    from tests import helpers

    model, processor = hf_model(family)
    # Gated norms (Qwen3.5's RMSNormGated) call it too; an L2Norm is an RMSNorm without weight
    # (Llama 4's QK-norm: one call for queries and keys).
    kinds = ("RMSNorm", "RMSNormGated", "L2Norm")
    norms = [module for module in model.modules() if type(module).__name__.endswith(kinds)]
    ran = set()
    hooks = [module.register_forward_hook(lambda m, i, o: ran.add(id(m))) for module in norms]
    try:
        inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(90, 120, 3)])
        helpers.hf_generate(model, inputs, max_new_tokens=1)
    finally:
        for hook in hooks:
            hook.remove()
    epsilons = sorted(
        float(getattr(module, "variance_epsilon", getattr(module, "eps", None)))
        for module in norms
        if id(module) in ran
    )
    calls = []
    for program in PROGRAMS:
        graph_model = onnx.load(str(exported(family) / program / "model.onnx"), load_external_data=False)
        assert _decomposed_norms(graph_model.graph) == [], program
        program_calls = [n for n in graph_model.graph.node if n.op_type == RMS_NORM]
        assert all(n.domain == DOMAIN for n in program_calls)
        if program_calls:
            assert any(f.domain == DOMAIN and f.name == RMS_NORM for f in graph_model.functions)
            assert any(op.domain == DOMAIN for op in graph_model.opset_import)
        calls += program_calls
    found = sorted(helper.get_attribute_value(n.attribute[0]) for n in calls)
    assert [a.name for n in calls for a in n.attribute] == [EPSILON] * len(calls)
    assert len(found) == len(epsilons) > 0
    assert np.allclose(found, epsilons, rtol=1e-6)


def test_function_body_runs_in_fp32_and_keeps_the_io_type(tmp_path):
    """The body computes in fp32 even on fp16 IO (x ** 2 would overflow fp16 for |x| > 256)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT16, [8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8])
    node = helper.make_node(RMS_NORM, ["x", "w"], ["y"], domain=DOMAIN, epsilon=1e-6)
    model = helper.make_model(
        helper.make_graph([node], "g", [x, w], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    attach_rms_norm(model)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    states = (np.random.default_rng(0).standard_normal((2, 8)) * 3000).astype(np.float16)
    weight = np.linspace(0.5, 2, 8).astype(np.float16)
    result = session.run(None, {"x": states, "w": weight})[0]
    expected = CustomRMSNormFunction.apply(
        torch.as_tensor(states).float(), torch.as_tensor(weight).float(), 1e-6
    ).numpy()
    assert result.dtype == np.float16 and np.isfinite(result).all()
    assert np.abs(result - expected).max() <= 1e-2
