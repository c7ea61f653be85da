"""``compile.language.subfunctions`` through the spec, the compiler argv, the stand-in and ``run``.

The spec key (language program only, a boolean); ``-sub-functions`` in the language program's
argv and not the vision program's; the stand-in compiler accepts the function form with the flag
and refuses the form without the flag, the flag without the form, and a body naming a public
retained state. Then every deployment mode (dual, single, disaggregated with continuous batching)
compiled on the onnxruntime backend from a spec with ``subfunctions: true`` (export, calibration on
the function form, every specialization verified at fp32 and device precision) and run with
``--compare-hf``: tokens identical to transformers generate, as the inline form's are
(tests/test_subfunctions.py compares the two forms directly, over the tiered families). Default
tier: Qwen2.5-VL in every mode; every family and mode under ``-m slow``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import onnx
import pytest
import yaml

from qeff_vision.cli import main
from qeff_vision.compile.argv import ProgramFiles, build_argv
from qeff_vision.families import all_families, get_family
from qeff_vision.spec.compile_options import parse_compile_options
from tests import helpers
from tests.compile_fixtures import REPO, calls, stand_in

MODES = ("dual", "single", "disaggregated")
CASES = [
    (family.name, mode)
    for family in all_families()
    for mode in MODES
    if family.features.deployment(mode).supported
]


def test_the_spec_key_is_a_language_boolean():
    options, problems = parse_compile_options({"language": {"subfunctions": True}})
    assert problems == [] and options.language.subfunctions and not options.vision.subfunctions
    options, problems = parse_compile_options({"subfunctions": True})  # shared: the language takes it
    assert problems == [] and options.language.subfunctions and not options.vision.subfunctions
    _, problems = parse_compile_options({"vision": {"subfunctions": True}})
    assert problems == ["compile.vision.subfunctions: applies to the language program only"]
    _, problems = parse_compile_options({"language": {"subfunctions": "yes"}})
    assert problems == ["compile.language.subfunctions: must be true or false"]


def test_the_language_argv_has_the_flag(tmp_path):
    options, _ = parse_compile_options({"language": {"subfunctions": True}})
    files = ProgramFiles(tmp_path / "m.onnx", tmp_path / "s.json", None, None, tmp_path / "b")
    language = build_argv("qaic-exec", "lang", files, options.language)
    vision = build_argv("qaic-exec", "vision", files, options.vision)
    assert language.count("-sub-functions") == 1 and "-sub-functions" not in vision
    plain, _ = parse_compile_options({})
    assert "-sub-functions" not in build_argv("qaic-exec", "lang", files, plain.language)


def _spec(path, model, mode: str, **compile_keys) -> str:
    spec = {
        "name": f"functions-{mode}",
        "model": str(model),
        "ctx_len": 512,
        "prefill": {"seq_lens": [32, 128]},
        "vision": {"images": [{"height": 224, "width": 224}]},
        "compile": {"language": {"subfunctions": True, **compile_keys}},
    }
    if mode != "dual":
        spec["deployment"] = mode
    if mode == "disaggregated":
        spec["full_batch_size"] = 2
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _stand_in_main(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "stand_in_compiler" / "stand_in.py"), *argv],
        capture_output=True,
        text=True,
    )


def _moved(argv: list[str], out) -> list[str]:
    """A recorded argv (paths in the staging directory ``compile`` renames to OUT) with OUT's paths."""
    return [re.sub(r"/\.out\.staging\.[^/]+/", f"/{out.name}/", arg) for arg in argv[1:]]


def _elsewhere(argv: list[str], binary_dir) -> list[str]:
    """``argv`` writing its program to ``binary_dir``."""
    return [a for a in argv if not a.startswith("-aic-binary-dir=")] + [f"-aic-binary-dir={binary_dir}"]


def test_the_stand_in_checks_the_flag_and_the_form(tiny_checkpoint, tmp_path, capsys):
    spec = _spec(tmp_path / "spec.yaml", tiny_checkpoint("qwen2_5_vl"), "dual", node_precision="none")
    compiler, record = stand_in(tmp_path)
    assert main(["compile", spec, "-o", str(tmp_path / "out"), "--compiler", str(compiler)]) == 0, (
        capsys.readouterr().err
    )
    out = tmp_path / "out"
    argvs = {("-retained-state" in call["argv"]): _moved(call["argv"], out) for call in calls(record)}
    language, vision = argvs[True], argvs[False]
    assert "-sub-functions" in language and "-sub-functions" not in vision
    assert _stand_in_main(_elsewhere(language, tmp_path / "l1")).returncode == 0
    # The function form without the flag, and the flag on the inline vision graph: refused.
    refused = _stand_in_main(_elsewhere([a for a in language if a != "-sub-functions"], tmp_path / "l2"))
    assert refused.returncode != 0 and "pass -sub-functions" in refused.stderr
    refused = _stand_in_main(_elsewhere([*vision, "-sub-functions"], tmp_path / "v2"))
    assert refused.returncode != 0 and "calls no layer function" in refused.stderr
    # A body naming a public retained state (what a plain rename of the outputs would leave).
    path = next(a.split("=", 1)[1] for a in language if a.startswith("-m="))
    model = onnx.load(path, load_external_data=False)
    function = next(f for f in model.functions if f.domain.startswith("transformers"))
    internal = next(o for o in function.output if o.endswith("_InternalRetainedState"))
    public = internal.replace("_InternalRetainedState", "_RetainedState")
    function.output[:] = [public if o == internal else o for o in function.output]
    for node in function.node:
        node.input[:] = [public if o == internal else o for o in node.input]
        node.output[:] = [public if o == internal else o for o in node.output]
    onnx.save(model, path)
    refused = _stand_in_main(_elsewhere(language, tmp_path / "l3"))
    assert refused.returncode != 0 and "use _InternalRetainedState" in refused.stderr


# The compile path is generic (export, calibration, verification, run); default tier: Qwen2.5-VL in
# every mode (each family's function form against the inline form: tests/test_subfunctions.py).
@pytest.mark.parametrize(
    ("family", "mode"), helpers.tiered(CASES, keep=("qwen2_5_vl",), key=lambda case: case[0])
)
def test_every_mode_compiles_and_runs_the_function_form(family, mode, tiny_checkpoint, tmp_path, capsys):
    spec = _spec(tmp_path / "spec.yaml", tiny_checkpoint(family), mode)
    out = tmp_path / "out"
    assert main(["compile", spec, "-o", str(out), "--backend", "onnxruntime"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "device precision" in captured.out  # every specialization verified against fp32 too
    manifest = json.loads((out / "manifest.json").read_text())
    export = json.loads((out / "export" / "export.json").read_text())
    assert export["subfunctions"] is True and export["programs"]["lang"]["functions"]
    assert manifest["deployment"] == mode
    # The verification ran each language specialization at device precision with the MX formats
    # too (-mxfp6-matmul is on by default), on the layer bodies inlined per call.
    for name, program in manifest["programs"].items():
        if name != "vision":
            assert any(run.get("device_precision_mx") for run in program["verification"]["runs"]), name
    helpers.image(112, 112, 1).save(tmp_path / "a.png")
    turns = ["--prompt", "Describe it.", "--prompt", "And the colours?"]
    args = [
        "run",
        str(out),
        "--image",
        str(tmp_path / "a.png"),
        *turns,
        "--max-new-tokens",
        "4",
        "--compare-hf",
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 2, err[-2000:]
    assert get_family(family).features.deployment(mode).supported
