"""Golden compiler command lines for three spec variants. QEFF_UPDATE_GOLDEN=1 rewrites the files."""

import json
import os
from pathlib import Path

import pytest

from qeff_vision.compile.argv import (
    ProgramFiles,
    argv_without_paths,
    build_argv,
    format_command,
    mdp_partition_config,
)
from qeff_vision.spec.compile_options import parse_compile_options

GOLDEN = Path(__file__).parent / "golden" / "compile"

VARIANTS = {
    # Defaults: one device per program, MXFP6 on the language program only.
    "single_device": {},
    # The language program spans four devices (MDP); the vision encoder stays on eight cores of one.
    "multi_device_language": {
        "vision": {"num_cores": 8},
        "language": {"num_devices": 4, "mos": 1, "depth_first": True},
    },
    # MXINT8 KV cache with MXFP6 off everywhere; the KV dtype reaches the compiler through custom IO.
    "mxint8_kv_mxfp6_off": {
        "mxfp6_matmul": False,
        "kv_cache_dtype": "mxint8",
        "ols": 2,
    },
    # A precision plan for the language program (Gemma 3's residual stream): -node-precision-info
    # follows -convert-to-fp16. An auto plan gives the same flag when calibration keeps any node.
    "node_precision_plan": {"language": {"node_precision": "fp32_nodes.yaml"}},
}


def command_lines(compile_section, compiler_name):
    options, problems = parse_compile_options(compile_section)
    assert problems == []
    result = {}
    for program, dir_name in (("vision", "vision"), ("language", "lang")):
        program_options = options.program(program)
        partition = f"OUT/{dir_name}/mdp_partition.json" if program_options.num_devices > 1 else None
        files = ProgramFiles(
            onnx=f"OUT/export/{dir_name}/model.onnx",
            specializations=f"OUT/{dir_name}/specializations.json",
            custom_io=f"OUT/{dir_name}/custom_io.yaml",
            partition_config=partition,
            binary_dir=f"OUT/{dir_name}/qpc-HASH",
            node_precision=(
                f"OUT/{dir_name}/node_precision.yaml"
                if program_options.node_precision not in ("auto", "none")
                else None
            ),
        )
        argv = build_argv(
            f"/opt/qti-aic/exec/{compiler_name}", program, files, program_options, compiler_name=compiler_name
        )
        result[dir_name] = {
            "argv": argv,
            "kv_cache_dtype": program_options.kv_cache_dtype if program == "language" else None,
            "partition_config": (
                mdp_partition_config(program_options.num_devices, program_options.num_cores)
                if partition
                else None
            ),
        }
    return result


@pytest.mark.parametrize("compiler_name", ["qaic-exec", "qaic-compile"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_golden_argv(variant, compiler_name):
    actual = command_lines(VARIANTS[variant], compiler_name)
    path = GOLDEN / f"argv_{variant}_{compiler_name.replace('-', '_')}.json"
    text = json.dumps(actual, indent=2, sort_keys=True) + "\n"
    if os.environ.get("QEFF_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with QEFF_UPDATE_GOLDEN=1"
    assert json.loads(path.read_text()) == actual


def test_language_only_flags_and_mxfp6_defaults():
    lines = command_lines({}, "qaic-exec")
    assert "-retained-state" in lines["lang"]["argv"] and "-retained-state" not in lines["vision"]["argv"]
    assert "-mxfp6-matmul" in lines["lang"]["argv"] and "-mxfp6-matmul" not in lines["vision"]["argv"]
    assert lines["lang"]["argv"][-1] == "-compile-only"
    assert "-compile-only" not in command_lines({}, "qaic-compile")["lang"]["argv"]


def test_partition_file_exactly_when_multi_device():
    options, _ = parse_compile_options({"language": {"num_devices": 2}})
    files = ProgramFiles("m.onnx", "s.json", None, None, "qpc")
    with pytest.raises(ValueError):
        build_argv("qaic-exec", "lang", files, options.language)
    assert mdp_partition_config(2, 16)["partitions"][0]["devices"] == [
        {"deviceId": 0, "numCores": 16},
        {"deviceId": 1, "numCores": 16},
    ]


def test_argv_without_paths_has_no_paths():
    options, _ = parse_compile_options({"language": {"num_devices": 2}})
    argv = argv_without_paths("lang", options.language, compiler_name="qaic-compile")
    assert argv[0] == "qaic-compile"
    assert "-mdp-load-partition-config=<partition_config>" in argv
    assert all("/" not in arg for arg in argv)
    assert format_command(["a b", "c"]) == "'a b' c"


def test_golden_dry_run_of_the_7b_spec(tmp_path, monkeypatch, capsys):
    """`qeff-vision compile specs/.../qwen2_5_vl-7b-instruct.yaml -o out/qwen2_5_vl-7b --dry-run` on a machine
    without the SDK: both command lines, exactly."""
    from qeff_vision.cli import main
    from qeff_vision.compile import driver

    spec = Path(__file__).resolve().parents[1] / "specs" / "qwen2_5_vl" / "qwen2_5_vl-7b-instruct.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(driver, "detect_sdk", lambda *args, **kwargs: None)  # as on a machine without the SDK
    assert main(["compile", str(spec), "-o", "out/qwen2_5_vl-7b", "--dry-run"]) == 0
    actual = capsys.readouterr().out
    path = GOLDEN / "dry_run_qwen2_5_vl-7b-instruct.txt"
    if os.environ.get("QEFF_UPDATE_GOLDEN"):
        path.write_text(actual)
    assert actual == path.read_text()
    assert json.loads(
        (tmp_path / "out/qwen2_5_vl-7b/lang/mdp_partition.json").read_text()
    ) == mdp_partition_config(4, 16)
    assert not (tmp_path / "out/qwen2_5_vl-7b/manifest.json").exists()
