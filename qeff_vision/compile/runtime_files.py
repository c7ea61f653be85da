"""The checkpoint's small runtime files, copied into OUT so OUT serves without the checkpoint.

``run`` needs the model config, generation config, tokenizer, processor and chat template; vLLM's
qaic backend, given compiled QPCs, reads the same files from its model path. None of them is a
weight, so OUT/model holds every top-level file of the checkpoint except weights (a few MB at
most) and OUT can be moved to another machine, or the checkpoint deleted, without breaking
``run`` or the printed vLLM commands.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qeff_vision.errors import UserError
from qeff_vision.fsutil import atomic_write_json, read_json

RUNTIME_MODEL_DIR = "model"
# Weight and graph files (safetensors shards and their index, PyTorch/TF/Flax/GGUF weights,
# exported graphs): everything else at the top of a checkpoint is runtime metadata.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".data",
)
_WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
# Sub-directories transformers reads at load time (extra chat templates, transformers >= 4.54).
_RUNTIME_SUBDIRS = ("additional_chat_templates",)


def is_runtime_file(name: str) -> bool:
    """Whether a top-level checkpoint file belongs in OUT/model (not a weight, not hidden)."""
    if name.startswith("."):
        return False
    return not name.endswith(_WEIGHT_SUFFIXES) and not name.endswith(_WEIGHT_INDEXES)


def copy_runtime_files(checkpoint: Path, out_dir: Path) -> Path:
    """Copy ``checkpoint``'s runtime files into ``OUT/model``; return that directory.

    The copy is built beside the old one and swapped in, so an interrupted compile leaves the
    previous copy whole.

    Raises:
        UserError: ``checkpoint`` has no config.json.
    """
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise UserError(f"{checkpoint}: not a checkpoint directory (expected config.json inside)")
    target = Path(out_dir) / RUNTIME_MODEL_DIR
    staging = target.with_name(f".{RUNTIME_MODEL_DIR}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for entry in sorted(checkpoint.iterdir()):
        if entry.is_file() and is_runtime_file(entry.name):
            shutil.copy2(entry, staging / entry.name)
        elif entry.is_dir() and entry.name in _RUNTIME_SUBDIRS:
            shutil.copytree(entry, staging / entry.name)
    previous = target.with_name(f".{RUNTIME_MODEL_DIR}.{os.getpid()}.old")
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
    return target


def copy_first_checkpoint(candidates, out_dir: Path) -> str | None:
    """Copy the runtime files of the first candidate that is a checkpoint here; OUT-relative path.

    Args:
        candidates: Checkpoint directories in order of preference (None entries are skipped).
        out_dir: The compile output directory.

    Returns:
        ``"model"`` (relative to OUT), or None when no candidate is a checkpoint directory here.
    """
    for candidate in candidates:
        if candidate is not None and (Path(candidate) / "config.json").is_file():
            copy_runtime_files(Path(candidate), out_dir)
            return RUNTIME_MODEL_DIR
    return None


def set_image_processor_options(model_dir: Path, options: dict[str, int]) -> None:
    """Write the spec's image-processor options into ``model_dir``'s processor config.

    ``preprocessor_config.json`` when the checkpoint has one, else the ``image_processor`` entry of
    transformers v5's ``processor_config.json``.

    Raises:
        UserError: ``model_dir`` has neither file.
    """
    legacy, combined = Path(model_dir) / "preprocessor_config.json", Path(model_dir) / "processor_config.json"
    if legacy.is_file():
        atomic_write_json(legacy, {**read_json(legacy), **options})
    elif combined.is_file():
        data = read_json(combined)
        data["image_processor"] = {**(data.get("image_processor") or {}), **options}
        atomic_write_json(combined, data)
    else:
        raise UserError(f"{model_dir}: no processor config to set {', '.join(options)} in")
