"""Export stage: CLI behaviour, bad input, atomicity, start-up cost and the family coverage guard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qeff_vision import exporter
from qeff_vision.cli import main
from qeff_vision.families import all_families

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, capsys):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_export_writes_both_programs_and_manifest(exported):
    out = exported("qwen2_5_vl")
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["family"] == "qwen2_5_vl" and manifest["opset"] == exporter.OPSET
    lang = manifest["programs"]["lang"]
    assert lang["inputs"]["vision_embeds"]["axes"] == {"0": "vision_batch_size", "1": "vision_size"}
    assert lang["inputs"]["position_ids"]["shape"][0] == 4
    assert "past_key.0_RetainedState" in lang["outputs"]
    vision = manifest["programs"]["vision"]
    assert vision["inputs"]["image_grid_thw"]["axes"] == {
        "0": "batch_size",
        "1": "time",
        "2": "grid_h",
        "3": "grid_w",
    }
    for program in ("vision", "lang"):
        assert (out / program / "model.onnx").exists() and (out / program / "model.onnx.data").exists()


def test_language_graph_uses_kv_functions_without_sentinels(exported):
    import onnx

    model = onnx.load(str(exported("qwen2_5_vl") / "lang" / "model.onnx"), load_external_data=False)
    used = {(node.domain, node.op_type) for node in model.graph.node if node.domain}
    assert used == {
        ("com.qualcomm.cloud", "CtxScatter"),
        ("com.qualcomm.cloud", "CtxGather"),
        ("com.qti.aisw.onnx", "CustomRMSNorm"),
    }
    assert {(f.domain, f.name) for f in model.functions} == used
    for function in model.functions:  # built from standard ops only
        assert all(node.domain in ("", "ai.onnx") for node in function.node)


def test_text_only_chunk_keeps_image_idx(exported):
    """image_idx_output never goes backwards: a chunk without placeholders returns its input."""
    import numpy as np

    from qeff_vision.runtime.session import OnnxProgram

    manifest = json.loads((exported("qwen2_5_vl") / "export.json").read_text())
    lang = OnnxProgram(exported("qwen2_5_vl") / "lang" / "model.onnx")
    feeds = {}
    for name, info in manifest["programs"]["lang"]["inputs"].items():
        shape = [
            {"batch_size": 1, "seq_len": 4, "ctx_len": 8, "vision_batch_size": 1, "vision_size": 3}.get(d, d)
            if isinstance(d, str)
            else d
            for d in info["shape"]
        ]
        feeds[name] = np.zeros(shape, dtype=info["dtype"])
    feeds["input_ids"][:] = 5
    feeds["position_ids"][:] = np.arange(4)
    feeds["image_idx"][:] = 7
    assert int(lang.run(feeds)["image_idx_output"][0, 0]) == 7


def test_unsupported_architecture_names_supported_families(tmp_path, tiny_checkpoint, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen2_5_vl"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("export", str(model), "-o", str(tmp_path / "out"), "-q", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "MistralForCausalLM is not supported" in err
    for family in all_families():
        assert family.name in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "missing_file", "missing_tensor"])
def test_bad_weights_give_one_clear_line(tmp_path, tiny_checkpoint, capsys, damage):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen2_5_vl"), model)
    weights = model / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing_file":
        weights.unlink()
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(weights), metadata={"format": "pt"})
    code, _, err = run_cli("export", str(model), "-o", str(tmp_path / "out"), "-q", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "weight" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_non_empty_output_needs_force(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, _, err = run_cli("export", str(tiny_checkpoint("qwen2_5_vl")), "-o", str(out), "-q", capsys=capsys)
    assert code == 2 and "--force" in err
    assert (out / "keep.txt").exists()
    code, stdout, _ = run_cli(
        "export", str(tiny_checkpoint("qwen2_5_vl")), "-o", str(out), "-q", "--force", capsys=capsys
    )
    assert code == 0 and (out / "export.json").exists() and not (out / "keep.txt").exists()
    assert "lang/model.onnx" in stdout


def test_progress_lines_per_stage_and_quiet(tmp_path, tiny_checkpoint, capsys):
    code, _, err = run_cli(
        "export", str(tiny_checkpoint("qwen2_5_vl")), "-o", str(tmp_path / "a"), capsys=capsys
    )
    assert code == 0
    stages = [
        line.split("] ")[1].split(":")[0] for line in err.splitlines() if line.startswith("[qeff-vision]")
    ]
    assert stages == [
        "load",
        "patch",
        "export vision",
        "export language",
        "write vision weights",
        "vision written",  # bytes per parameter, weights kept float32 or quantized
        "write lang weights",
        "lang written",
        "check",
    ]
    code, _, err = run_cli(
        "export", str(tiny_checkpoint("qwen2_5_vl")), "-o", str(tmp_path / "b"), "-q", capsys=capsys
    )
    assert code == 0 and err == ""


def test_interrupted_export_leaves_nothing_that_looks_complete(tmp_path, tiny_checkpoint, monkeypatch):
    real = exporter._trace

    def interrupt_on_language(staging, program, *args, **kwargs):
        if program == "lang":
            raise KeyboardInterrupt
        return real(staging, program, *args, **kwargs)

    monkeypatch.setattr(exporter, "_trace", interrupt_on_language)
    with pytest.raises(KeyboardInterrupt):
        exporter.export_model(tiny_checkpoint("qwen2_5_vl"), tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_help_is_fast_and_does_not_import_torch():
    code = (
        "import sys, time; t = time.perf_counter();"
        "from qeff_vision.cli import main;"
        "rc = main(['--help']); elapsed = time.perf_counter() - t;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'transformers' not in sys.modules;"
        "print(elapsed)"
    )
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert "export" in result.stdout and "compile" in result.stdout
    # Not a timing test (CI machines vary): the budget is 0.5 s, asserted loosely against hangs.
    assert wall < 5


def test_every_family_has_a_tiny_checkpoint_and_parity_coverage():
    """Coverage guard: a registered family needs a tiny checkpoint builder and a spec."""
    from qeff_vision.exporter import load_adapter

    specs = list((ROOT / "specs").rglob("*.yaml"))
    for family in all_families():
        adapter = load_adapter(family)
        assert callable(family.parts.tiny), f"{family.name} has no tiny builder"
        assert adapter.family is family, family.name
        assert adapter.test_image_sizes, family.name
        assert any(f"family: {family.name}" in p.read_text() or family.name in p.parts for p in specs), (
            family.name
        )
    # The parity tests are parametrized over the registry, so every family above is covered.
    from tests import test_family_parity

    assert test_family_parity.FAMILIES == [f.name for f in all_families()]
