"""Exported graphs every later stage can read: weights external, node attributes in the graph.

The tiny defaults keep every traced constant under the exporter's 1 KiB external-data threshold;
real widths do not (Gemma 3's 896 px tower: ``/tower/embeddings/position_embedding/Constant``,
int64 [1, 4096]). A tiny Gemma 3 at 224 px (16 x 16 patches) has the same constant at 2 KiB: it
compiles with the default precision plan (calibration and verification on onnxruntime) and runs
at fp32 and at device precision. Graphs exported before the fix (the constant stored in
``model.onnx.data``) are read by every stage as well.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import yaml
from onnx import numpy_helper

from qeff_vision.cli import main
from qeff_vision.families import all_families
from qeff_vision.graph_file import attribute_tensors, external_attributes, load_graph
from tests import helpers

POSITION_CONSTANT = "/tower/embeddings/position_embedding/Constant"
SIDE = 224  # 16 x 16 patches of 14 px: the position ids are int64 [1, 256], 2 KiB


@pytest.mark.parametrize("family", [family.name for family in all_families()])
def test_no_exported_graph_keeps_a_node_attribute_outside_the_graph(family, exported):
    for program in ("vision", "lang"):
        model = onnx.load(str(exported(family) / program / "model.onnx"), load_external_data=False)
        assert external_attributes(model) == [], (family, program)


@pytest.fixture(scope="module")
def wide_gemma3(tmp_path_factory):
    """(checkpoint, export) of the tiny Gemma 3 with 224 px images."""
    from qeff_vision.exporter import export_model
    from qeff_vision.families.gemma3 import tiny

    patch = pytest.MonkeyPatch()
    patch.setattr(tiny, "IMAGE_SIDE", SIDE)
    patch.setitem(tiny.VISION, "image_size", SIDE)
    try:
        checkpoint = tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("gemma3-224") / "checkpoint")
    finally:
        patch.undo()
    export = tmp_path_factory.mktemp("gemma3-224-export") / "export"
    export_model(checkpoint, export, progress=None)
    return checkpoint, export


def _position_constant(model: onnx.ModelProto) -> onnx.TensorProto:
    (tensor,) = [t for node, t in attribute_tensors(model) if node.name == POSITION_CONSTANT]
    return tensor


def test_a_constant_above_the_threshold_stays_in_the_graph(wide_gemma3):
    _, export = wide_gemma3
    model = onnx.load(str(export / "vision" / "model.onnx"), load_external_data=False)
    tensor = _position_constant(model)
    assert len(tensor.raw_data) >= 1024 and not tensor.external_data  # it would have gone external


def test_compiles_with_the_default_plan_and_runs_at_both_precisions(wide_gemma3, tmp_path, capsys):
    checkpoint, export = wide_gemma3
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "gemma3-224",
                "model": str(checkpoint),
                "ctx_len": 128,
                "prefill": {"seq_lens": [16, 48]},
                "vision": {"images": [{"height": SIDE, "width": SIDE}], "vision_size": "chunk"},
            }
        )
    )
    out = tmp_path / "out"
    command = ["compile", str(spec), "-o", str(out), "--export", str(export), "--backend", "onnxruntime"]
    assert main(command) == 0, capsys.readouterr().err
    assert "calibrating device precision" in capsys.readouterr().err
    image = tmp_path / "image.png"
    helpers.image(SIDE, SIDE).save(image)
    common = [
        "run",
        str(out),
        "--image",
        str(image),
        "--prompt",
        "Describe this image.",
        "--max-new-tokens",
        "4",
    ]
    for precision in ("fp32", "device"):
        assert main([*common, "--precision", precision, "--compare-hf"]) == 0, precision
        assert "compare-hf: tokens identical" in capsys.readouterr().err, precision


def _store_externally(path, node_name: str) -> None:
    """Move one node attribute of the graph at ``path`` into its ``model.onnx.data`` (older exports)."""
    model = onnx.load(str(path), load_external_data=False)
    (tensor,) = [t for node, t in attribute_tensors(model) if node.name == node_name]
    data = path.with_name(path.name + ".data")
    offset = data.stat().st_size
    with open(data, "ab") as handle:
        handle.write(tensor.raw_data)
    length = len(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    onnx.save_model(model, str(path))


def test_every_stage_reads_a_graph_whose_constant_is_stored_externally(wide_gemma3, tmp_path):
    """An export written before attributes were kept inline: fp32, device precision, calibration
    and the single-program composition read the constant from the data file."""
    import shutil

    from qeff_vision.compile.calibration import RecordingProgram
    from qeff_vision.compile.single_program import compose
    from qeff_vision.runtime.session import OnnxProgram

    _, export = wide_gemma3
    old = tmp_path / "export"
    shutil.copytree(export, old)
    _store_externally(old / "vision" / "model.onnx", POSITION_CONSTANT)
    stored = onnx.load(str(old / "vision" / "model.onnx"), load_external_data=False)
    assert external_attributes(stored) == [POSITION_CONSTANT]
    inline = _position_constant(load_graph(export / "vision" / "model.onnx"))
    loaded = _position_constant(load_graph(old / "vision" / "model.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded), numpy_helper.to_array(inline))

    rng = np.random.default_rng(0)
    feeds = {"pixel_values": rng.standard_normal((1, 3, SIDE, SIDE)).astype(np.float32)}
    for build in (
        lambda path: OnnxProgram(path),
        lambda path: OnnxProgram(path, fp32_values=[]),
        lambda path: RecordingProgram(path),
    ):
        expected = build(export / "vision" / "model.onnx").run(feeds)
        given = build(old / "vision" / "model.onnx").run(feeds)
        for name, value in expected.items():
            np.testing.assert_array_equal(given[name], value)
    composed = compose(old / "vision" / "model.onnx", old / "lang" / "model.onnx")
    assert external_attributes(composed) == []
