"""Real-width checkpoints drawn in a published stored form: the release's layout, quantized weights.

A published checkpoint differs from what ``save_pretrained`` writes in two ways this module
reproduces at real widths: the layout (Kimi-K2.5's remote-code names, per-expert tensors and fused
vision q/k/v: the family tiny module's ``published_state``) and quantized weights (int4 routed
experts, FP8 linears). The caller supplies the quantizer (:class:`StoredForm`): for each tensor
the stored tensors that replace it and the values they dequantize to. Those values are written
beside, as a plain float32 checkpoint (``reference_dir``) transformers runs as the reference.
Both are written in shards of ``SHARD_BYTES``, one shard in memory at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARD_BYTES = 256 * 2**20
_WEIGHT_FILES = ("model.safetensors.index.json",)


@dataclass(frozen=True)
class StoredForm:
    """How a real-width checkpoint is stored.

    Attributes:
        write: ``write(name, tensor)`` -> (stored tensors replacing it, the values they stand for),
            or None to keep the tensor as drawn.
        quantization_config: The config's ``quantization_config``.
        reference_dir: Where the dequantized plain checkpoint is written.
        published: Write the family's published layout (its tiny module's ``published_state``).
    """

    write: Callable[[str, Any], tuple[dict[str, Any], Any] | None]
    quantization_config: dict[str, Any]
    reference_dir: Path
    published: bool = True


def save_stored(family, model, out_dir: Path, form: StoredForm) -> None:
    """``model``'s weights in ``form`` into ``out_dir`` and, dequantized, into ``form.reference_dir``."""
    import inspect

    module = inspect.getmodule(family.parts.tiny) if family.parts else None
    published = getattr(module, "published_state", None) if form.published else None
    state = published(model) if published is not None else model.state_dict()
    form.reference_dir.mkdir(parents=True, exist_ok=True)
    stored, dense = _Shards(out_dir), _Shards(form.reference_dir)
    for name in list(state):
        tensor = state.pop(name)
        written = form.write(name, tensor)
        parts, values = written if written is not None else ({name: tensor}, tensor)
        stored.add(parts)
        dense.add({name: values.float() if values.is_floating_point() else values})
    stored.close()
    dense.close()
    config = model.config.to_dict()
    (form.reference_dir / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = form.quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def copy_side_files(out_dir: Path, reference_dir: Path) -> None:
    """The tokenizer, processor and generation files of ``out_dir`` into the reference checkpoint."""
    for item in out_dir.iterdir():
        if (
            item.name != "config.json"
            and not item.name.endswith(".safetensors")
            and item.name not in _WEIGHT_FILES
        ):
            shutil.copy2(item, reference_dir / item.name)


class _Shards:
    """safetensors shards of at most ``SHARD_BYTES`` and their index, written as tensors arrive."""

    def __init__(self, directory: Path):
        self.directory, self.pending, self.size, self.files = directory, {}, 0, []
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, tensors: dict[str, Any]) -> None:
        for name, tensor in tensors.items():
            self.pending[name] = tensor.contiguous()
            self.size += tensor.numel() * tensor.element_size()
        if self.size >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, self.directory / name, metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.total += self.size
        self.pending, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
