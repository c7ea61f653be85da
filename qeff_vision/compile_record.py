"""``OUT/manifest.json``: what was compiled, from what, and how vLLM's qaic backend serves it.

Layout (format 1)::

    {
      "format": 1, "tool": "qeff-vision 0.1.0", "backend": "qaic" | "onnxruntime",
      "model": "Qwen/Qwen2.5-VL-7B-Instruct", "family": "qwen2_5_vl",
      "spec": {"path": ..., "name": ..., "hash": ...}, "spec_hash": ...,
      "sdk": {"compiler": ..., "version": ..., ...} | null,
      "export": {"dir": ..., "config_hash": ...},
      "shapes": {"batch_size": 1, "ctx_len": ..., "prefill_seq_lens": [...], "images": [...], ...},
      "programs": {
        "vision": {"path": "vision/qpc-<key>" | "export/vision/model.onnx", "onnx": ...,
                   "specializations": [{"name": ..., "symbols": {...}}], ...},
        "lang": {...}            (disaggregated: "lang_prefill" and "lang_decode" instead)
      },
      "deployment": "dual" | "single" | "disaggregated", "kv_cache_prefix": null | "vllmKvCache",
      "runtime_model": "model",
      "vllm": {"qpc_path": "<vision>:<lang>", "plugin": {"engine_args": {"vision": ..., "language": ...}},
               "override_qaic_config": {"encode": ..., "decode": ...}, "commands": {...}}
    }

Paths inside OUT are relative to the manifest's directory; others are absolute. ``vllm`` is
written by :mod:`qeff_vision.compile.vllm_handoff`: the two engines' arguments for vLLM 0.23 + the
vllm-qaic plugin, the 0.8.5 launcher's override configs, and the four printed forms. The manifest is
written last and atomically: a directory without one has not finished compiling.

Torch-free and outside compile/ (like :mod:`qeff_vision.export_record`): the runtime reads the
record without importing the compile driver, which itself runs the runtime (calibration).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qeff_vision import __version__
from qeff_vision.contract.deployment_programs import DUAL
from qeff_vision.contract.deployment_programs import PROGRAMS as DEPLOYMENT_PROGRAMS
from qeff_vision.errors import UserError
from qeff_vision.fsutil import read_json

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
PROGRAMS = ("vision", "lang")
QAIC = "qaic"
ONNXRUNTIME = "onnxruntime"
BACKENDS = (QAIC, ONNXRUNTIME)


def relative_to(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` when inside it, else absolute."""
    # Absolute without resolving symlinks: a compile's staging directory reaches OUT's export
    # through one, and the path recorded must stay inside OUT.
    path, base = Path(os.path.abspath(path)), Path(os.path.abspath(base))
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


def spec_hash(spec_file: Path, config_file: Path | None) -> str:
    """SHA-256 of the spec file and the model config it was checked against."""
    digest = hashlib.sha256(Path(spec_file).read_bytes())
    if config_file is not None and Path(config_file).is_file():
        digest.update(b"\0" + Path(config_file).read_bytes())
    return digest.hexdigest()


def tool_name() -> str:
    """``qeff-vision <version>``."""
    return f"qeff-vision {__version__}"


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """Read ``OUT/manifest.json``; a user error when OUT is not a finished compile."""
    path = Path(out_dir) / MANIFEST_FILE
    missing = f"{out_dir}: no {MANIFEST_FILE}; run `qeff-vision compile` into it first"
    manifest = read_json(path, missing=missing)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise UserError(f"{path}: not a format-{MANIFEST_FORMAT} qeff-vision manifest")
    deployment = manifest.get("deployment", DUAL)
    if deployment not in DEPLOYMENT_PROGRAMS:
        raise UserError(f"{path}: unknown deployment {deployment!r}")
    missing = [p for p in DEPLOYMENT_PROGRAMS[deployment] if p not in manifest.get("programs", {})]
    if missing:
        raise UserError(f"{path}: program(s) {', '.join(missing)} missing")
    return manifest


def program_path(manifest: Mapping[str, Any], out_dir: str | Path, program: str) -> Path:
    """Absolute path of a program: the QPC directory (qaic) or the ONNX file (onnxruntime)."""
    path = Path(manifest["programs"][program]["path"])
    return path if path.is_absolute() else Path(out_dir) / path
