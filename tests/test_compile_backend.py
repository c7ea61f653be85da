"""Graph IO, symbol checks and the onnxruntime backend on synthetic graphs; the stand-in's refusals."""

from __future__ import annotations

import json
import subprocess

import pytest

from qeff_vision.compile.graph_io import read_graph_io, read_specializations, symbol_problems
from qeff_vision.compile.onnxruntime_backend import verify_program
from qeff_vision.errors import SpecError, UserError
from tests import compile_graphs
from tests.compile_graphs import language_specialization, vision_specialization
from tests.stand_in_compiler import install


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return {
        "vision": compile_graphs.vision_graph(root / "vision" / "model.onnx"),
        "lang": compile_graphs.language_graph(root / "lang" / "model.onnx", num_layers=2),
    }


def test_graph_io_reads_symbols_without_external_data(graphs):
    lang = read_graph_io(graphs["lang"])
    assert lang.input_symbols() == {"batch_size", "seq_len", "vision_batch_size", "vision_size", "ctx_len"}
    assert [t.name for t in lang.inputs][:4] == ["input_ids", "position_ids", "vision_embeds", "image_idx"]
    assert lang.where("ctx_len") == "input past_key.0 axis 2"
    vision = read_graph_io(graphs["vision"])
    assert vision.input_symbols() == {"grid_height", "grid_width", "batch_size", "time", "grid_h", "grid_w"}
    assert vision.all_symbols() - vision.input_symbols() == {"vision_size"}  # only on the output


def test_output_only_symbols_are_required_by_onnxruntime_but_not_by_the_compiler(graphs):
    graph = read_graph_io(graphs["vision"])
    values = vision_specialization(26, 38)
    del values["vision_size"]
    assert symbol_problems(graph, [values], "vision", outputs_required=False) == []
    assert symbol_problems(graph, [values], "vision", outputs_required=True) == [
        "vision specialization 0: symbol 'vision_size' is missing (graph model.onnx has it on output "
        "vision_embeds axis 1)"
    ]


def test_onnxruntime_verifies_every_specialization(graphs):
    vision = verify_program(
        "vision", graphs["vision"], [vision_specialization(16, 16), vision_specialization(26, 38)]
    )
    assert [run.output_shapes["vision_embeds"] for run in vision] == [[1, 64, 16], [1, 247, 16]]
    lang = verify_program(
        "lang",
        graphs["lang"],
        [language_specialization(64, 64), language_specialization(128, 128), language_specialization(1, 128)],
    )
    assert [run.output_shapes["past_key.1_RetainedState"] for run in lang] == [[1, 2, 256, 4]] * 3
    assert all(run.latency_ms > 0 for run in vision + lang)


def test_onnxruntime_rejects_missing_and_unused_symbols_by_name(graphs):
    values = language_specialization(64, 64)
    values["vision_len"] = values.pop("vision_size")
    with pytest.raises(SpecError) as error:
        verify_program("lang", graphs["lang"], [values], source="tiny.yaml")
    assert error.value.problems == [
        "lang specialization 0: symbol 'vision_size' is missing "
        "(graph model.onnx has it on input vision_embeds axis 1)",
        "lang specialization 0: symbol 'vision_len' is not a dimension of any input or output of model.onnx "
        "(graph symbols: batch_size, ctx_len, seq_len, vision_batch_size, vision_size)",
    ]
    assert str(error.value).startswith("tiny.yaml: 2 problem(s)")


def test_onnxruntime_checks_output_shapes(graphs):
    wrong = vision_specialization(26, 38)
    wrong["vision_size"] = 100  # the graph makes grid_height / 4 = 247 rows
    with pytest.raises(
        UserError, match=r"output vision_embeds has shape \[1, 247, 16\], expected \[1, 100, 16\]"
    ):
        verify_program("vision", graphs["vision"], [wrong])


def test_specialization_files_in_both_layouts(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"specializations": [{"seq_len": "128", "ctx_len": 4096}]}))
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"specializations": [{"name": "Decode", "symbols": {"seq_len": "1"}}]}))
    assert read_specializations(flat) == [{"seq_len": 128, "ctx_len": 4096}]
    assert read_specializations(named) == [{"seq_len": 1}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"specializations": [{"seq_len": "many"}]}))
    with pytest.raises(UserError, match="non-integer value 'many'"):
        read_specializations(bad)


# ---- the stand-in compiler refuses what the real one would ----


def _stand_in(tmp_path, graphs, specializations, custom_io=None, extra=()):
    compiler = install(tmp_path / "sdk")
    spec_file = tmp_path / "specializations.json"
    spec_file.write_text(json.dumps({"specializations": specializations}))
    argv = [str(compiler), f"-m={graphs['lang']}", "-aic-hw", f"-network-specialization-config={spec_file}"]
    if custom_io is not None:
        (tmp_path / "custom_io.yaml").write_text(custom_io)
        argv.append(f"-custom-IO-list-file={tmp_path / 'custom_io.yaml'}")
    argv += [f"-aic-binary-dir={tmp_path / 'qpc'}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_stand_in_accepts_a_good_program(tmp_path, graphs):
    io = "- IOName: past_key.0\n  Precision: mxint8\n"
    done = _stand_in(
        tmp_path, graphs, [language_specialization(64, 64)], io, ["-retained-state", "-compile-only"]
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "qpc" / "programqpc.bin").is_file()


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"drop": "ctx_len"}, "no value for symbol(s) ctx_len"),
        ({"add": "grid_h"}, "unknown symbol(s) grid_h"),
        ({"extra": ["-mystery-flag"]}, "unknown option '-mystery-flag'"),
        ({"io": "- IOName: past_key.9\n  Precision: float16\n"}, "past_key.9 is not an input or output"),
        ({"io": "- IOName: past_key.0\n  Precision: int3\n"}, "unknown precision 'int3'"),
    ],
)
def test_stand_in_refuses(tmp_path, graphs, change, refusal):
    values = language_specialization(64, 64)
    if "drop" in change:
        del values[change["drop"]]
    if "add" in change:
        values[change["add"]] = 4
    done = _stand_in(tmp_path, graphs, [values], change.get("io"), change.get("extra", []))
    assert done.returncode == 1 and refusal in done.stderr
    assert not (tmp_path / "qpc" / "programqpc.bin").exists()


def test_stand_in_refuses_missing_external_data(tmp_path, graphs):
    copy = tmp_path / "copy" / "model.onnx"
    copy.parent.mkdir()
    copy.write_bytes(graphs["lang"].read_bytes())  # without model.onnx.data beside it
    done = _stand_in(tmp_path, {"lang": copy}, [language_specialization(64, 64)])
    assert done.returncode == 1 and "is not a valid ONNX model" in done.stderr


def test_a_graph_larger_than_a_slice_is_verified_slice_by_slice(exported, monkeypatch):
    """fp32, device-precision and MX runs slice by slice give the one-session results.

    The tiny llava language graph with slices of a quarter of its weights: every session holds a
    quarter of them (real widths: Mistral 3's 4.7 GB language graph verifies within the memory
    of one slice's weights and its activations instead of three copies of the whole graph).
    """
    from qeff_vision import graph_file
    from qeff_vision.graph_file import load_graph
    from qeff_vision.numerics import recording
    from qeff_vision.numerics.device import MxEmulation
    from qeff_vision.numerics.plan import angle_chains

    path = exported("llava") / "lang" / "model.onnx"
    model = load_graph(path)
    plan = sorted(angle_chains(model))
    specializations = [language_specialization(32, 32), language_specialization(1, 32)]
    mx = MxEmulation("fp6_e2m3", kv_mxint8=True)

    def verify():
        return verify_program("lang", path, specializations, device_values=plan, mx=mx)

    whole = verify()
    passes = []
    run_many = recording.SlicedRecorder.run_many

    def counted(self, feeds, on_slice=None):
        results = run_many(self, feeds, on_slice)
        passes.append((len(feeds), len(self.slices), self.sessions_built))
        return results

    monkeypatch.setattr(recording, "DEFAULT_SLICE_BYTES", graph_file.weight_bytes(model) // 4)
    monkeypatch.setattr(recording.SlicedRecorder, "run_many", counted)
    sliced = verify()
    # fp32, fp16, MX: one pass each over the slices for every specialization, each slice's
    # session built once (not once per specialization).
    assert [feeds for feeds, _, _ in passes] == [len(specializations)] * 3
    assert all(slices >= 4 and built == slices for _, slices, built in passes), passes
    for one, other in zip(whole, sliced):
        assert one.output_shapes == other.output_shapes
        assert other.device.max_relative == pytest.approx(one.device.max_relative, rel=0.05, abs=1e-6)
        assert other.device_mx.max_relative == pytest.approx(one.device_mx.max_relative, rel=0.05, abs=1e-6)
