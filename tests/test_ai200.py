"""``compile.aic_hw_version: ai200`` and ``auto``: detection, the spec's rules, the argv, the stand-in.

Detection reads ``qaic-util -q`` outputs under tests/qaic_util_outputs (ai100, ai200 in both field
spellings, no device), a tool that is missing, one that fails and one that hangs; ``auto`` in a spec
resolves through ``QAIC_UTIL`` and the compile manifest records what was used. ai200 programs get
``-aic-hw-version=ai200``, no ``-convert-to-fp16``, bfloat16 custom IO for every retained state and
``pixel_values``; what the SDK facts do not support (MXINT8 KV, fp16 state, a node precision
file on ai200; bfloat16 on ai100) is refused with the reason. The stand-in compiler refuses the
same mistakes the real one would.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from qeff_vision.cli import main
from qeff_vision.compile.argv import argv_without_paths
from qeff_vision.errors import SpecError
from qeff_vision.spec import load_spec
from qeff_vision.spec.compile_options import parse_compile_options
from qeff_vision.spec.hardware import (
    AI100,
    AI200,
    QAIC_UTIL_ENV,
    HwDetection,
    detect_hw_version,
    detected_once,
    version_from_qaic_util,
)
from tests.compile_fixtures import make_executable, write_spec
from tests.stand_in_compiler import stand_in

OUTPUTS = Path(__file__).with_name("qaic_util_outputs")


def _tool(tmp_path: Path, output: str, code: int = 0) -> Path:
    """A qaic-util double printing ``output`` (a file under tests/qaic_util_outputs) for ``-q``."""
    text = (OUTPUTS / output).read_text() if output else ""
    (tmp_path / "printed.txt").write_text(text)
    script = f'#!/bin/sh\n[ "$1" = "-q" ] || exit 9\ncat "{tmp_path / "printed.txt"}"\nexit {code}\n'
    return make_executable(tmp_path / "qaic-util", script)


@pytest.mark.parametrize(
    "output, version, variant",
    [
        ("ai100.txt", AI100, "AIC100.REL"),
        ("ai200.txt", AI200, "AIC200.REL"),
        ("ai200_fw.txt", AI200, "aic200.rel"),
        ("no_device.txt", AI100, None),
    ],
)
def test_detection_reads_the_first_devices_image_variant(tmp_path, output, version, variant):
    found = detect_hw_version(_tool(tmp_path, output), env={})
    assert (found.version, found.variant) == (version, variant)
    assert found.reason  # a line for the manifest either way
    assert version_from_qaic_util((OUTPUTS / output).read_text()) == found


def test_detection_falls_back_to_ai100_when_the_tool_cannot_answer(tmp_path):
    missing = detect_hw_version(tmp_path / "no-such-qaic-util", env={})
    assert missing.version == AI100 and "not found" in missing.reason
    failing = detect_hw_version(_tool(tmp_path, "", code=3), env={})
    assert failing.version == AI100 and "exited with 3" in failing.reason

    def hanging(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    hung = detect_hw_version(_tool(tmp_path, "ai200.txt"), env={}, run=hanging)
    assert hung.version == AI100 and "TimeoutExpired" in hung.reason
    # QAIC_UTIL names the tool when no path is given.
    via_env = detect_hw_version(env={QAIC_UTIL_ENV: str(_tool(tmp_path, "ai200.txt"))})
    assert via_env.version == AI200


def test_ai200_options_take_bfloat16_defaults_and_drop_convert_to_fp16():
    options, problems = parse_compile_options({"aic_hw_version": "ai200"})
    assert problems == []
    for program in (options.vision, options.language):
        assert program.aic_hw_version == AI200 and program.convert_to_fp16 is False
    assert (options.language.kv_cache_dtype, options.language.state_dtype) == ("bfloat16", "bfloat16")
    assert options.hardware == AI200 and options.hardware_record()["requested"] is None
    # ai100 keeps its fp16 defaults.
    plain, _ = parse_compile_options({})
    assert plain.language.convert_to_fp16 and plain.language.kv_cache_dtype == "float16"
    assert plain.hardware == AI100


def test_auto_resolves_through_the_detector_and_is_recorded():
    asked = []

    def detect():
        asked.append(1)
        return HwDetection(AI200, "double", "AIC200.X")

    options, problems = parse_compile_options({"aic_hw_version": "auto"}, detect=detect)
    assert problems == [] and asked == [1], "one detection for both programs"
    assert options.language.aic_hw_version == options.vision.aic_hw_version == AI200
    assert options.hardware_record() == {
        "aic_hw_version": AI200,
        "requested": "auto",
        "detection": {"aic_hw_version": AI200, "reason": "double", "variant": "AIC200.X"},
    }


@pytest.mark.parametrize(
    "section, refusal",
    [
        ({"aic_hw_version": "ai200", "kv_cache_dtype": "mxint8"}, "compile.kv_cache_dtype: no public SDK"),
        ({"aic_hw_version": "ai200", "language": {"kv_cache_dtype": "float16"}}, "a float16 cache"),
        ({"aic_hw_version": "ai200", "convert_to_fp16": True}, "-convert-to-fp16 is ai100's"),
        ({"aic_hw_version": "ai200", "state_dtype": "float16"}, "keep recurrent state bfloat16"),
        ({"aic_hw_version": "ai200", "node_precision": "plan.yaml"}, "under -convert-to-fp16 only"),
        ({"kv_cache_dtype": "bfloat16"}, "bfloat16 needs aic_hw_version: ai200"),
        ({"language": {"aic_hw_version": "ai200"}}, "target different hardware"),
    ],
)
def test_what_the_target_cannot_do_is_refused_with_the_reason(section, refusal):
    _, problems = parse_compile_options(section)
    assert any(refusal in problem for problem in problems), problems


def test_a_spec_names_every_problem_and_refuses_float16_graphs_on_ai200(tmp_path):
    path = write_spec(
        tmp_path / "s.yaml", compile_section={"aic_hw_version": "ai200", "kv_cache_dtype": "mxint8"}
    )
    data = yaml.safe_load(path.read_text())
    data["dtype"] = "float16"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    text = str(raised.value)
    assert "dtype: ai200 computes in bfloat16" in text and "compile.kv_cache_dtype" in text


def test_argv_for_ai200_has_the_version_and_no_fp16_conversion():
    options, _ = parse_compile_options({"aic_hw_version": "ai200"})
    for program in ("vision", "lang"):
        argv = argv_without_paths(program, options.program("vision" if program == "vision" else "language"))
        assert "-aic-hw-version=ai200" in argv and "-convert-to-fp16" not in argv
        assert not any(a.startswith("-node-precision-info") for a in argv)


def test_auto_in_a_spec_follows_qaic_util_and_the_manifest_records_it(tmp_path, monkeypatch, capsys):
    detected_once.cache_clear()
    monkeypatch.setenv(QAIC_UTIL_ENV, str(_tool(tmp_path, "ai200.txt")))
    spec = write_spec(tmp_path / "auto.yaml", compile_section={"aic_hw_version": "auto"})
    try:
        loaded = load_spec(spec)
        assert loaded.compile.hardware == AI200 and loaded.compute_dtype("language") == "bfloat16"
        assert loaded.weight_dtypes() == {"vision": "bfloat16", "lang": "bfloat16"}
        out = tmp_path / "out"
        assert main(["compile", str(spec), "-o", str(out), "--dry-run"]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert "-aic-hw-version=ai200" in printed and "-convert-to-fp16" not in printed
        custom_io = yaml.safe_load((out / "lang" / "custom_io.yaml").read_text())
        precisions = {entry["IOName"]: entry["Precision"] for entry in custom_io}
        assert precisions["past_key.0"] == precisions["vision_embeds"] == "bfloat16"
        vision_io = yaml.safe_load((out / "vision" / "custom_io.yaml").read_text())
        assert {e["IOName"]: e["Precision"] for e in vision_io}["pixel_values"] == "bfloat16"
        # No device: the same spec resolves to ai100 and says why.
        detected_once.cache_clear()
        monkeypatch.setenv(QAIC_UTIL_ENV, str(tmp_path / "absent"))
        fallback = load_spec(spec)
        assert fallback.compile.hardware == AI100 and "not found" in fallback.compile.detection.reason
    finally:
        detected_once.cache_clear()


@pytest.mark.parametrize(
    "hw, switches, io, refusal",
    [
        (
            "ai200",
            {"-convert-to-fp16"},
            {"past_key.0": "bfloat16", "pixel_values": "bfloat16"},
            "-convert-to-fp16",
        ),
        ("ai200", set(), {"past_key.0": "float16", "pixel_values": "bfloat16"}, "past_key.0 is float16"),
        ("ai200", set(), {"pixel_values": "bfloat16"}, "past_key.0 is not in the custom IO list"),
        ("ai200", set(), {"past_key.0": "bfloat16"}, "pixel_values is not in the custom IO list"),
        ("ai100", set(), {"past_key.0": "bfloat16"}, "has no bfloat16"),
    ],
)
def test_stand_in_refuses_what_ai200_or_ai100_cannot_take(hw, switches, io, refusal):
    outputs = {"logits": [1], "past_key.0_RetainedState": [1]}
    floats = {"past_key.0", "pixel_values"}
    with pytest.raises(stand_in.Refused, match=refusal):
        stand_in.check_hardware(hw, switches, io, outputs, floats)
    good = {"past_key.0": "bfloat16", "pixel_values": "bfloat16"}
    stand_in.check_hardware(AI200, set(), good, outputs, floats)  # accepted


def test_validate_prints_memory_per_device_and_says_ai200_memory_is_unpublished(tiny_checkpoint, tmp_path):
    from qeff_vision.api import memory_fit
    from qeff_vision.spec.memory_fit import checkpoint_parameters

    checkpoint = tiny_checkpoint("qwen2_5_vl")
    parameters = checkpoint_parameters(checkpoint)
    assert parameters and parameters > 10_000
    lines = {}
    for name, section in (
        ("ai100", {}),
        ("ai100-mxint8", {"language": {"kv_cache_dtype": "mxint8"}}),
        ("ai200", {"aic_hw_version": "ai200"}),
        ("ai200-2dev", {"aic_hw_version": "ai200", "language": {"num_devices": 2}}),
    ):
        spec = write_spec(
            tmp_path / f"{name}.yaml", model=str(checkpoint), config=None, compile_section=section
        )
        lines[name] = memory_fit(spec)
    state = {
        name: int(re.search(r"retained state [^(]*\(([\d,]+) bytes", found[0]).group(1).replace(",", ""))
        for name, found in lines.items()
    }
    assert f"{parameters:,} parameters at 2 bytes, bfloat16" in lines["ai200"][0]
    assert state["ai200"] == state["ai100"] > state["ai100-mxint8"]  # bf16 and fp16: 2 bytes
    assert "on 2 device(s)" in lines["ai200-2dev"][0]
    assert lines["ai200"][1].startswith("fit not judged: Cloud AI 200's memory per device is not published")
    assert len(lines["ai100"]) == 1  # no claim about the ai100 card's memory either way
    # A hub id: weights are unknown, not guessed.
    hub = memory_fit(write_spec(tmp_path / "hub.yaml", compile_section={"aic_hw_version": "ai200"}))
    assert "weights: unknown until the checkpoint is local" in hub[0]
