"""Acceptance on a real export of tiny Qwen2.5-VL: the onnxruntime backend proves every specialization
(vision_size chunk, two prefill buckets, two resolutions) and rejects symbols the graph lacks; the
stand-in compiler accepts the spec package's files for the exported graphs."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from qeff_vision.cli import main
from tests.compile_fixtures import calls, stand_in, write_spec

FAMILY = "qwen2_5_vl"


@pytest.fixture
def tiny_spec(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(FAMILY)
    return write_spec(tmp_path / "tiny.yaml", model=str(checkpoint), config=None, ctx_len=512)


def test_onnxruntime_verifies_every_specialization_after_exporting(tiny_spec, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["compile", str(tiny_spec), "-o", str(out), "--backend", "onnxruntime"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (out / "export" / "export.json").is_file(), "the checkpoint is exported into OUT/export"
    # The compile report compares device precision (fp16 emulation) with fp32 per specialization.
    assert "device precision (fp16, plan nodes fp32) vs fp32" in captured.out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "onnxruntime" and manifest["family"] == FAMILY
    vision, lang = manifest["programs"]["vision"], manifest["programs"]["lang"]
    assert vision["path"] == "export/vision/model.onnx" and lang["path"] == "export/lang/model.onnx"
    # Two resolutions: 224x224 -> 16x16 patches (64 tokens), 354x536 -> 26x38 patches (247 tokens).
    assert [run["output_shapes"]["vision_embeds"][:2] for run in vision["verification"]["runs"]] == [
        [1, 64],
        [1, 247],
    ]
    # vision_size chunk: V(S) = min(S, 247) for the buckets 64 and 128; decode carries the largest.
    assert [
        (s["name"], s["symbols"]["seq_len"], s["symbols"]["vision_size"]) for s in lang["specializations"]
    ] == [
        ("Prefill-64", "64", "64"),
        ("Prefill-128", "128", "128"),
        ("Decode", "1", "128"),
    ]
    runs = lang["verification"]["runs"]
    assert [run["output_shapes"]["vision_embeds_RetainedState"][1] for run in runs] == [64, 128, 128]
    assert all(run["output_shapes"]["past_key.0_RetainedState"][2] == 512 for run in runs)
    assert all(s["latency_ms"] > 0 for s in vision["specializations"] + lang["specializations"])

    # The same OUT compiles with the stand-in: the export is reused, the spec's files are accepted.
    export_json = (out / "export" / "export.json").stat().st_mtime_ns
    compiler, record = stand_in(tmp_path)
    code = main(["compile", str(tiny_spec), "-o", str(out), "--compiler", str(compiler)])
    assert code == 0, capsys.readouterr().err
    assert (out / "export" / "export.json").stat().st_mtime_ns == export_json
    assert len(calls(record)) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "qaic"
    assert all(
        (out / manifest["programs"][p]["path"] / "programqpc.bin").is_file() for p in ("vision", "lang")
    )


def _rename_dim(path, old, new):
    model = onnx.load(str(path), load_external_data=False)
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param == old:
                dim.dim_param = new
    onnx.save(model, str(path))


@pytest.mark.parametrize("backend", ["onnxruntime", "qaic"])
def test_symbols_that_do_not_match_the_graph_are_rejected_by_name(
    exported, tiny_spec, tmp_path, capsys, backend
):
    drifted = tmp_path / "drifted-export"
    shutil.copytree(exported(FAMILY), drifted)
    _rename_dim(drifted / "lang" / "model.onnx", "vision_size", "vision_rows")
    compiler, record = stand_in(tmp_path)
    argv = [
        "compile",
        str(tiny_spec),
        "-o",
        str(tmp_path / "out"),
        "--export",
        str(drifted),
        "--backend",
        backend,
    ]
    code = main([*argv, "--compiler", str(compiler)] if backend == "qaic" else argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "symbol 'vision_rows' is missing" in err and "on input vision_embeds axis 1" in err
    assert "symbol 'vision_size' is not a dimension of any input or output" in err
    assert calls(record) == [] and not (tmp_path / "out" / "manifest.json").exists()
