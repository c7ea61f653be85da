"""Shared pieces of the compile tests: a spec on the pinned 3B config and a synthetic export for it."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import yaml

from qeff_vision.families import describe_checkpoint, get_family
from tests import compile_graphs
from tests.stand_in_compiler import install

REPO = Path(__file__).resolve().parents[1]
CONFIG_3B = REPO / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct" / "config.json"


def num_layers_3b() -> int:
    return get_family("qwen2_5_vl").text_dims(describe_checkpoint(CONFIG_3B.parent)).num_layers


def write_spec(path: Path, *, compile_section=None, layout="auto", model=None, config=CONFIG_3B, ctx_len=512):
    """A small Qwen2.5-VL spec: two resolutions, two prefill buckets, vision_size chunk."""
    data = {
        "name": "compile-test",
        "model": model or "Qwen/Qwen2.5-VL-3B-Instruct",
        "ctx_len": ctx_len,
        "prefill": {"seq_lens": [64, 128]},
        "vision": {
            "images": [{"height": 224, "width": 224}, {"height": 354, "width": 536}],
            "vision_size": "chunk",
        },
        "specialization_layout": layout,
    }
    if config is not None:
        data["config"] = str(config)
    if compile_section is not None:
        data["compile"] = compile_section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def synthetic_export(directory: Path, *, rename=None) -> Path:
    """An export directory with contract-shaped graphs for the 3B config (no torch, milliseconds)."""
    compile_graphs.vision_graph(directory / "vision" / "model.onnx", rename=rename)
    compile_graphs.language_graph(
        directory / "lang" / "model.onnx", num_layers=num_layers_3b(), rename=rename
    )
    manifest = {
        "family": "qwen2_5_vl",
        "model": "synthetic",
        "config_hash": "synthetic",
        "programs": {"vision": {"path": "vision/model.onnx"}, "lang": {"path": "lang/model.onnx"}},
    }
    (directory / "export.json").write_text(json.dumps(manifest))
    return directory


def stand_in(tmp_path: Path, **kwargs) -> tuple[Path, Path]:
    """(compiler path, record file) of a fresh stand-in SDK under ``tmp_path``."""
    record = tmp_path / "stand_in_calls.jsonl"
    root = tmp_path / f"sdk-{kwargs.get('mode', 'ok')}-{kwargs.get('name', 'qaic-exec')}"
    return install(root, record=record, **kwargs), record


def calls(record: Path) -> list[dict]:
    """Every stand-in invocation recorded so far."""
    return [entry for entry in _entries(record) if "argv" in entry]


def hanging(record: Path) -> int:
    """How many stand-ins are hanging now, their partial output written (their own marker)."""
    return sum(entry.get("event") == "hanging" for entry in _entries(record))


def _entries(record: Path) -> list[dict]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def tree_state(path: Path) -> dict[str, str] | None:
    """Every entry under ``path`` -> a digest of what it is (file bytes, link target, directory).

    ``None`` when ``path`` does not exist: two equal states mean the tree is byte-for-byte the same.
    """
    if not os.path.lexists(path):
        return None
    state = {}
    for entry in sorted([path, *path.rglob("*")]):
        name = entry.relative_to(path).as_posix()
        if entry.is_symlink():
            state[name] = "link:" + os.readlink(entry)
        elif entry.is_dir():
            state[name] = "dir"
        else:
            state[name] = hashlib.sha256(entry.read_bytes()).hexdigest()
    return state


def make_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path
