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
        "lang": {...}
      },
      "vllm": {"qpc_path": "<vision>:<lang>", "override_qaic_config": {...}, "commands": {...}}
    }

Paths inside OUT are relative to the manifest's directory; others are absolute. The manifest is
written last and atomically: a directory without one has not finished compiling.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qeff_vision import __version__
from qeff_vision.errors import UserError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
PROGRAMS = ("vision", "lang")
QAIC = "qaic"
ONNXRUNTIME = "onnxruntime"
BACKENDS = (QAIC, ONNXRUNTIME)
QPC_PATH_ENV = "VLLM_QAIC_QPC_PATH"
SERVE_PORTS = {"single": 8000, "encode": 8001, "prefill_decode": 8002}


def relative_to(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` when inside it, else absolute."""
    path, base = Path(path).resolve(), Path(base).resolve()
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


def vllm_handoff(
    *,
    model: str,
    vision_path: Path,
    language_path: Path,
    ctx_len: int,
    batch_size: int,
    prefill_seq_lens: list[int],
    images: list[tuple[int, int]],
    max_images: int,
    vision_devices: int,
    language_devices: int,
    mxfp6_matmul: bool,
    kv_cache_dtype: str,
) -> dict[str, Any]:
    """The values vLLM's qaic backend needs to serve the two programs, and the commands to start it.

    ``VLLM_QAIC_QPC_PATH`` holds both program directories, vision first: with ``kv_offload`` the
    backend picks index 0 for the encoder (pooling runner) and 1 for the language model
    (ref: qualcomm/vllm-qaic, model loader ``_get_qaic_compile_config``). ``override_qaic_config``
    goes in ``--additional-config`` (older vLLM forks took ``--override-qaic-config``). ``images``
    (height, width) are listed only for multi-resolution families; pass an empty list otherwise. Device
    groups are a starting point: the encoder on the first devices, the language model after them.
    """
    qpc_path = f"{Path(vision_path).resolve()}:{Path(language_path).resolve()}"
    common: dict[str, Any] = {"kv_offload": True}
    if images:  # compiled resolutions, for families whose one vision graph serves several
        common["height"] = [height for height, _ in images]
        common["width"] = [width for _, width in images]
    common.update(prefill_seq_len=max(prefill_seq_lens), ctx_len=ctx_len)
    vision_group = list(range(vision_devices))
    language_group = list(range(vision_devices, vision_devices + language_devices))
    overrides = {
        "single": dict(common),
        "encode": {**common, "skip_lang": True, "device_group": vision_group},
        "prefill_decode": {**common, "skip_vision": True, "device_group": language_group},
    }
    base = [
        "vllm",
        "serve",
        model,
        "--max-model-len",
        str(ctx_len),
        "--max-num-seqs",
        str(batch_size),
        "--long-prefill-token-threshold",
        str(max(prefill_seq_lens)),
        "--limit-mm-per-prompt",
        json.dumps({"image": max_images}),
    ]
    if kv_cache_dtype == "mxint8":
        base += ["--kv-cache-dtype", "mxint8"]
    if mxfp6_matmul:
        base += ["--quantization", "mxfp6"]
    extra = {"single": [], "encode": ["--runner", "pooling"], "prefill_decode": ["--enable-mm-embeds"]}
    commands = {}
    for role, override in overrides.items():
        argv = [
            *base,
            *extra[role],
            "--port",
            str(SERVE_PORTS[role]),
            "--additional-config",
            json.dumps({"override_qaic_config": override}, separators=(",", ":")),
        ]
        commands[role] = f"{QPC_PATH_ENV}={shlex.quote(qpc_path)} " + shlex.join(argv)
    return {
        "available": True,
        "qpc_path": qpc_path,
        "env": {QPC_PATH_ENV: qpc_path},
        "override_qaic_config": overrides,
        "commands": commands,
    }


def serve_text(manifest: Mapping[str, Any]) -> str:
    """The vLLM command lines of a manifest, for ``--print-serve``."""
    vllm = manifest.get("vllm") or {}
    if not vllm.get("available"):
        raise UserError(f"no vLLM hand-off: {vllm.get('reason', 'the manifest has none')}")
    titles = {
        "single": "# one endpoint: encoder and language model in one server",
        "encode": "# disaggregated: encode server (vision program, pooling runner)",
        "prefill_decode": "# disaggregated: prefill-decode server (language program, takes image embeddings)",
    }
    return "\n".join(f"{titles[role]}\n{command}" for role, command in vllm["commands"].items()) + "\n"


def tool_name() -> str:
    """``qeff-vision <version>``."""
    return f"qeff-vision {__version__}"


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """Read ``OUT/manifest.json``; a user error when OUT is not a finished compile."""
    path = Path(out_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{out_dir}: no {MANIFEST_FILE}; run `qeff-vision compile` into it first") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise UserError(f"{path}: not a format-{MANIFEST_FORMAT} qeff-vision manifest")
    missing = [p for p in PROGRAMS if p not in manifest.get("programs", {})]
    if missing:
        raise UserError(f"{path}: program(s) {', '.join(missing)} missing")
    return manifest


def program_path(manifest: Mapping[str, Any], out_dir: str | Path, program: str) -> Path:
    """Absolute path of a program: the QPC directory (qaic) or the ONNX file (onnxruntime)."""
    path = Path(manifest["programs"][program]["path"])
    return path if path.is_absolute() else Path(out_dir) / path
