"""Sliced runs of bf16 graphs (issue 49): no value numpy cannot hold crosses a slice boundary.

onnxruntime's Python API returns and takes numpy arrays, and numpy has no bfloat16 ("No
corresponding Numpy type for Tensor Type. bfloat16"). The ai200 device emulation rounds every value
through a Cast pair (``x -> bf16 -> x``, numerics/device.py); a slice ending between the two Casts
would make the bf16 half a slice output. Tiny graphs run as one session, so only real widths showed
it: Kimi-K2.5's ai200 compile check failed on its language program, where a slice ended after the
last reader of an attention-sized input (``LARGE_VALUE``), the first Cast of a pair. Here the slice
budget and ``LARGE_VALUE`` are lowered so tiny graphs are cut at every weight and after every
large-input reader, and the sliced run must give the whole session's outputs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_vision import api
from qeff_vision.families import all_families
from qeff_vision.numerics import recording, slicing
from qeff_vision.numerics.device import session_for, value_types
from qeff_vision.numerics.recording import SlicedRecorder
from tests import helpers
from tests.test_ai200_families import ai200_spec, bf16_checkpoint

FAMILIES = [family.name for family in all_families()]


def _rounded_chain(tmp_path, layers: int = 3, width: int = 32) -> onnx.ModelProto:
    """``layers`` MatMuls, each output rounded to bf16 through a Cast pair, weights on disk."""
    rng = np.random.default_rng(0)
    nodes, weights, value = [], [], "x"
    for layer in range(layers):
        weight = numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{layer}")
        weights.append(weight)
        exact, half, rounded = f"h{layer}__exact", f"h{layer}__bf16", f"h{layer}"
        nodes += [
            helper.make_node("MatMul", [value, f"w{layer}"], [exact]),
            helper.make_node("Cast", [exact], [half], to=TensorProto.BFLOAT16),
            helper.make_node("Cast", [half], [rounded], to=TensorProto.FLOAT),
        ]
        value = rounded
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", width])],
        [helper.make_tensor_value_info(value, TensorProto.FLOAT, None)],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "chain.onnx", save_as_external_data=True, location="chain.data")
    return onnx.load(tmp_path / "chain.onnx", load_external_data=False)


def test_no_cut_falls_between_a_bf16_value_and_its_reader(tmp_path, monkeypatch):
    """Every input a slice ends after (LARGE_VALUE lowered to 1 byte) moves the cut past the pair."""
    monkeypatch.setattr(slicing, "LARGE_VALUE", 1)
    model = _rounded_chain(tmp_path)
    types = value_types(model)
    output = model.graph.output[0].name
    recorder = SlicedRecorder(model, tmp_path, [], types, [output], slice_bytes=1)
    feed = {"x": np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)}
    sliced = recorder.run(feed)[output]
    whole = session_for(model, tmp_path).run([output], feed)[0]
    np.testing.assert_array_equal(sliced, whole)
    crossing = {
        name
        for part in recorder.slices
        for name in (*part.inputs, *part.outputs)
        if types.get(name) == TensorProto.BFLOAT16
    }
    assert crossing == set(), crossing
    # The cuts were made (one slice per weight at least), just not inside a pair.
    assert len(recorder.slices) >= 3, [(p.start, p.stop) for p in recorder.slices]


def _checked(family: str, root, name: str) -> dict:
    if not (root / "bf16").exists():
        bf16_checkpoint(helpers.write_tiny(family, root / "tiny"), root / "bf16")
    checkpoint = root / "bf16"
    (root / name).mkdir()
    spec = ai200_spec(family, checkpoint, root / name)
    api.compile(spec, root / name / "out", backend="onnxruntime", progress=None, status_stream=None)
    manifest = json.loads((root / name / "out" / "manifest.json").read_text())
    return {
        program: [run["device_precision"] for run in entry["verification"]["runs"]]
        for program, entry in manifest["programs"].items()
    }


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES, keep=("kimi_k25",)))
def test_the_ai200_compile_check_sliced_is_the_check_as_one_session(family, tmp_path, monkeypatch):
    """The compile's bf16 device check of the tiny ai200 export, cut into slices of 64 KiB of weights
    (and after every reader of a 4 KiB input), reports the deviations of the unsliced check."""
    whole = _checked(family, tmp_path, "whole")
    monkeypatch.setattr(recording, "DEFAULT_SLICE_BYTES", 2**16)
    monkeypatch.setattr(slicing, "LARGE_VALUE", 4096)
    built = []

    class Counted(SlicedRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(len(self.slices))

    monkeypatch.setattr(recording, "SlicedRecorder", Counted)
    sliced = _checked(family, tmp_path, "sliced")
    assert built and min(built) > 1, built  # both programs' checks ran sliced
    assert sliced.keys() == whole.keys()
    for program, runs in whole.items():
        assert len(sliced[program]) == len(runs)
        for ours, theirs in zip(sliced[program], runs):
            assert ours["finite"] and theirs["finite"]
            assert ours["max_relative"] == pytest.approx(theirs["max_relative"], rel=1e-3, abs=1e-6)
