"""Activation memory counted from the graph: largest intermediate, peak live bytes, the compile bound.

The figures of a hand-written attention graph are known in closed form; a compile records them
per specialization in its manifest, prints them, and refuses a spec whose bound one exceeds,
leaving OUT untouched. The tiny Qwen2.5-VL export shows the blocking bound in the figures: forced
query blocks divide the tower's largest score tensor.
"""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from qeff_vision.cli import main
from qeff_vision.compile.activation_memory import bound_problem, graph_activation_memory
from qeff_vision.compile.driver import compile_spec
from qeff_vision.errors import UserError
from qeff_vision.families import all_families
from tests import helpers
from tests.compile_fixtures import stand_in, synthetic_export, tree_state, write_spec


def _attention_graph(path, dtype=TensorProto.FLOAT):
    """q, k, v [N, D] -> softmax(q k^T) v, plus an int64 index and a retained-state output."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[1, 0]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "v"], ["out"]),
        helper.make_node("Shape", ["scores"], ["shape"]),  # int64 [2]
        helper.make_node("Identity", ["state"], ["state_RetainedState"]),
    ]
    inputs = [helper.make_tensor_value_info(name, dtype, ["N", 8]) for name in ("q", "k", "v", "state")]
    outputs = [
        helper.make_tensor_value_info("out", dtype, ["N", 8]),
        helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        helper.make_tensor_value_info("state_RetainedState", dtype, ["N", 8]),
    ]
    weight = helper.make_tensor("unused_weight", dtype, [4, 4], [0.0] * 16)
    graph = helper.make_graph(nodes, "attention", inputs, outputs, [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_attention_graph_figures_in_closed_form(tmp_path, dtype):
    path = _attention_graph(tmp_path / "a.onnx", dtype)
    n = 100
    figures = graph_activation_memory(path, {"N": n})
    # Every float at 2 device bytes, whatever the graph's dtype.
    assert figures.largest_bytes == n * n * 2 and figures.largest_shape == (n, n)
    assert figures.largest_op == "MatMul"  # the first of the two [N, N] values
    # scores and weights are alive together during the Softmax; kt died at the first MatMul;
    # the retained state is an IO buffer and the graph inputs are not counted.
    assert figures.peak_bytes == 2 * n * n * 2
    assert figures.weight_bytes == 16 * 2 and figures.unresolved == 0
    assert graph_activation_memory(path, {"N": 2 * n}).largest_bytes == 4 * n * n * 2


def test_unbound_symbol_is_counted_unresolved(tmp_path):
    figures = graph_activation_memory(_attention_graph(tmp_path / "a.onnx"), {})
    assert figures.unresolved >= 4 and figures.largest_bytes <= 16  # only the int64 [2] shape


def test_bound_problem_names_every_specialization_over_it():
    entry = {"name": "Vision-1080x1920", "largest_bytes": 3 << 30, "largest_op": "Softmax"}
    measured = {"vision": [{**entry, "largest_bytes": 1 << 20, "largest_shape": [4]}]}
    measured["vision"].append({**entry, "largest_shape": [16, 10764, 10764]})
    assert bound_problem(measured, None) is None
    assert bound_problem(measured, 4 << 30) is None
    problem = bound_problem(measured, 256 << 20)
    assert (
        "in 1 specialization(s): vision 1 (Vision-1080x1920) 3072.0 MiB (Softmax [16x10764x10764])" in problem
    )
    assert "\n" not in problem


def test_compile_records_prints_and_bounds_activation_memory(tmp_path, capsys):
    export = synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path)
    spec = write_spec(tmp_path / "spec.yaml")
    outcome = compile_spec(
        spec,
        tmp_path / "out",
        compiler=compiler,
        export_dir=export,
        progress=None,
        status_stream=None,
        env={},
    )
    recorded = outcome.manifest["activation_memory"]
    assert recorded["bound"] == 256 << 20 and recorded["device_item_bytes"] == 2
    for program, plan in (("vision", "vision"), ("lang", "lang")):
        entries = recorded["programs"][program]
        assert len(entries) == len(outcome.manifest["programs"][plan]["specializations"])
        assert all(e["largest_bytes"] > 0 and e["peak_bytes"] >= e["largest_bytes"] for e in entries)
        assert all(e["weight_bytes"] > 0 and e["unresolved"] == 0 for e in entries)
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert saved["activation_memory"] == recorded
    assert len(outcome.activation) == sum(len(v) for v in recorded["programs"].values())

    # The CLI prints one line per specialization; a bound below a figure is refused, OUT untouched.
    code = main(
        [
            "compile",
            str(spec),
            "-o",
            str(tmp_path / "out"),
            "--compiler",
            str(compiler),
            "--export",
            str(export),
        ]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "largest intermediate" in line]
    assert code == 0 and len(lines) == len(outcome.activation) and lines[0].startswith("vision 0 (")
    before = tree_state(tmp_path / "out")
    tight = write_spec(tmp_path / "tight.yaml", compile_section={"max_activation_bytes": 1024})
    with pytest.raises(UserError, match=r"above compile.max_activation_bytes \(1.0 KiB\)"):
        compile_spec(
            tight,
            tmp_path / "out",
            compiler=compiler,
            export_dir=export,
            progress=None,
            status_stream=None,
            env={},
        )
    assert tree_state(tmp_path / "out") == before
    code = main(
        [
            "compile",
            str(tight),
            "-o",
            str(tmp_path / "new"),
            "--compiler",
            str(compiler),
            "--export",
            str(export),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_activation_bytes" in err[0]
    assert not (tmp_path / "new").exists()
    unbounded = write_spec(tmp_path / "free.yaml", compile_section={"max_activation_bytes": None})
    outcome = compile_spec(
        unbounded,
        tmp_path / "free",
        compiler=compiler,
        export_dir=export,
        progress=None,
        status_stream=None,
        env={},
    )
    assert outcome.manifest["activation_memory"]["bound"] is None


def test_forced_query_blocks_divide_the_towers_largest_scores(tiny_checkpoint, tmp_path):
    """Qwen2.5-VL's full-attention layer at a 56 x 84-patch image: whole vs 4 query blocks."""
    from qeff_vision.contract.attention_blocking import UNBLOCKED, AttentionBlocking
    from qeff_vision.exporter import export_model

    values = {
        "batch_size": 1,
        "time": 1,
        "grid_h": 56,
        "grid_w": 84,
        "grid_height": 56 * 84,
        "grid_width": 1176,
    }
    largest = {}
    for name, policy in (("whole", UNBLOCKED), ("blocked", AttentionBlocking(vision_blocks=4))):
        out = export_model(
            tiny_checkpoint("qwen2_5_vl"), tmp_path / name, progress=None, attention_blocking=policy
        )
        figures = graph_activation_memory(out.out_dir / "vision" / "model.onnx", values)
        largest[name] = figures
    n = 56 * 84
    heads = 2
    assert largest["whole"].largest_bytes == heads * n * n * 2
    assert largest["blocked"].largest_bytes == heads * (n // 4) * n * 2
    assert largest["blocked"].peak_bytes < largest["whole"].peak_bytes


def test_values_of_weights_alone_are_folded_not_activations(tmp_path):
    """A tied language head's ``Transpose`` of the embedding is a constant the compiler folds.

    At full depth (Qwen2.5-VL-3B) it is [2048, 151936]: 594 MiB, above the 256 MiB bound, and a
    compile refused the spec over it. A value that also reads an activation stays counted.
    """
    vocab, hidden = 1000, 8
    nodes = [
        helper.make_node("Transpose", ["embed"], ["head"], perm=[1, 0]),  # weights alone
        helper.make_node("Mul", ["head", "scale"], ["scaled_head"]),  # weights and a constant
        helper.make_node("MatMul", ["x", "scaled_head"], ["logits"]),
        helper.make_node("Transpose", ["logits"], ["logits_t"], perm=[1, 0]),  # an activation
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden])]
    outputs = [helper.make_tensor_value_info("logits_t", TensorProto.FLOAT, [vocab, "N"])]
    weights = [
        helper.make_tensor("embed", TensorProto.FLOAT, [vocab, hidden], [0.0] * vocab * hidden),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [2.0]),
    ]
    graph = helper.make_graph(nodes, "tied_head", inputs, outputs, weights)
    path = tmp_path / "head.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    figures = graph_activation_memory(path, {"N": 2})
    assert figures.largest_bytes == 2 * vocab * 2 and figures.largest_name in ("logits", "logits_t")
    assert figures.peak_bytes == 2 * (2 * vocab * 2)  # logits and its transpose, not the head


def test_a_static_slice_of_a_weight_is_a_weight_and_its_gathered_rows_are_read(tmp_path):
    """Experts [E, 2I, H] cut along the width (a static Slice), then gathered by routed rows: the
    slice is folded into weights (not an activation), the gather is an activation of its rows, and
    ``weight_reads`` counts the rows the gathers read (two halves of n rows = n whole rows)."""
    import numpy as np
    from onnx import numpy_helper

    from qeff_vision.compile.weight_reads import weight_reads

    experts, width, hidden = 6, 8, 4
    stacked = numpy_helper.from_array(np.zeros((experts, width, hidden), np.float32), "experts")

    def constant(name, values):
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
        )

    nodes = [
        constant("axes", [1]),
        constant("lo", [0]),
        constant("mid", [width // 2]),
        constant("hi", [width]),
        helper.make_node("Slice", ["experts", "lo", "mid", "axes"], ["first"]),
        helper.make_node("Slice", ["experts", "mid", "hi", "axes"], ["second"]),
        helper.make_node("Gather", ["first", "ids"], ["rows_first"], axis=0),
        helper.make_node("Gather", ["second", "ids"], ["rows_second"], axis=0),
        helper.make_node("Concat", ["rows_first", "rows_second"], ["rows"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "experts",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", width, hidden])],
        [stacked],
    )
    path = tmp_path / "experts.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    figures = graph_activation_memory(path, {"n": 2})
    # The largest value is the gathered [2, 8, 4] rows (2 bytes each), not a [6, 4, 4] slice.
    assert figures.largest_bytes == 2 * width * hidden * 2 and figures.largest_op == "Concat"
    assert figures.peak_bytes == 2 * (2 * width * hidden * 2)  # both halves, then the concatenation
    (read,) = weight_reads(path, {"n": 2})
    assert read.rows_read == 2 and read.read_bytes == 2 * width * hidden * 4


@pytest.mark.parametrize("family", helpers.tiered([family.name for family in all_families()]))
def test_every_language_graph_resolves_every_shape(family, exported, tiny_checkpoint):
    """The language figures cover every value: our custom ops (CtxGather, GatedDeltaRule whose final
    state is a retained-state output with a declared shape, CustomRMSNorm) get their shapes."""
    from qeff_vision.export_record import read_export
    from qeff_vision.families import get_family
    from qeff_vision.families.base import ModelDescription

    export = exported(family)
    model = ModelDescription(json.loads((tiny_checkpoint(family) / "config.json").read_text()))
    family_obj = get_family(family)
    values = {
        "batch_size": 1,
        "seq_len": 32,
        "ctx_len": 256,
        "vision_size": 32,
        "vision_batch_size": 1,
        **family_obj.kv_cache_lengths(model, 256),
        **family_obj.language_symbols(model),
        **family_obj.request_symbols(model, 1),
    }
    figures = graph_activation_memory(export / read_export(export)["programs"]["lang"]["path"], values)
    assert figures.unresolved == 0 and figures.largest_bytes > 0, figures
