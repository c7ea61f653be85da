"""OUT is self-contained: moved elsewhere with its checkpoint deleted, ``run`` gives the same tokens.

Issue 15 item 3. Users compile on one machine and serve on another, so the manifest names what is
inside OUT relative to it, and compile copies the checkpoint's small runtime files (config,
generation config, tokenizer, processor, chat template; no weights) into ``OUT/model``.
"""

from __future__ import annotations

import shutil

import torch
import yaml

from qeff_vision.cli import main
from qeff_vision.compile.runtime_files import RUNTIME_MODEL_DIR
from qeff_vision.compile_record import read_manifest
from qeff_vision.runtime.artifacts import load_artifacts
from qeff_vision.runtime.conversation import open_conversation
from tests import helpers

FAMILY = "qwen2_5_vl"
NEW_TOKENS = 6
PROMPT = "Describe the picture."


def _paths(value):
    """Every string under the manifest's ``programs`` and ``export`` entries that names a file."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("path", "onnx", "dir", "log") or key.endswith("_file"):
                if isinstance(item, str):
                    yield item
            yield from _paths(item)
    elif isinstance(value, list):
        for item in value:
            yield from _paths(item)


def _tokens(out, image):
    chat = open_conversation(out, max_new_tokens=NEW_TOKENS)
    return chat.ask([image], PROMPT).tokens


def _run_cli(capsys, out, image_file):
    code = main(["run", str(out), "--image", str(image_file), "--prompt", PROMPT, "--max-new-tokens", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_moved_out_without_its_checkpoint_runs_the_same_tokens(tmp_path, tiny_checkpoint, hf_model, capsys):
    from qeff_vision import api

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint(FAMILY), checkpoint)
    spec = {
        "model": str(checkpoint),
        "ctx_len": 256,
        "prefill": {"seq_lens": [64]},
        "vision": {"images": [{"height": 112, "width": 112}]},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "build" / "out"
    api.compile(tmp_path / "spec.yaml", out, backend="onnxruntime", progress=None, status_stream=None)

    manifest = read_manifest(out)
    assert manifest["runtime_model"] == RUNTIME_MODEL_DIR
    inside = list(_paths({"programs": manifest["programs"], "export": manifest["export"]}))
    assert inside and not [p for p in inside if p.startswith("/")], inside
    copied = {p.name for p in (out / RUNTIME_MODEL_DIR).iterdir()}
    assert {"config.json", "generation_config.json"} <= copied
    assert not [name for name in copied if name.endswith(".safetensors")]

    image = helpers.image(112, 112, 4)
    image_file = tmp_path / "picture.png"
    image.save(image_file)
    before = _tokens(out, image)
    model, _ = hf_model(FAMILY)
    chat = open_conversation(out, max_new_tokens=NEW_TOKENS)
    processed = chat.prepare([image], PROMPT).processed
    inputs = {key: torch.as_tensor(value) for key, value in processed.items()}
    expected, _ = helpers.hf_generate(model, inputs, NEW_TOKENS)
    assert before == expected
    text_before = _run_cli(capsys, out, image_file)

    moved = tmp_path / "another-machine" / "served"
    moved.parent.mkdir()
    shutil.move(str(out), str(moved))
    shutil.rmtree(checkpoint)

    artifacts = load_artifacts(moved)
    assert artifacts.model_dir == moved / RUNTIME_MODEL_DIR
    assert artifacts.checkpoint_dir is None
    assert _tokens(moved, image) == before
    assert _run_cli(capsys, moved, image_file) == text_before
