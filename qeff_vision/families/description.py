"""A checkpoint read from disk without torch: config.json plus the processor configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeff_vision.errors import UserError
from qeff_vision.families.config_view import ConfigReader, Section
from qeff_vision.fsutil import read_json


@dataclass(frozen=True)
class ModelDescription:
    """A checkpoint as read from disk without torch: config.json plus the image-processor config.

    Attributes:
        config: The raw ``config.json`` dictionary.
        processor: The raw ``preprocessor_config.json`` dictionary, empty when absent (a pinned
            config snapshot); families then fall back to their documented processor defaults.
        source: Where it was read from, for messages.
    """

    config: Mapping[str, Any]
    processor: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    video_processor: Mapping[str, Any] = field(default_factory=dict)
    #: Typed config views read from this checkpoint, by family name (see :meth:`Family.config_view`).
    views: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def reader(self) -> tuple[ConfigReader, Section]:
        """A fresh reader of this checkpoint and its top-level ``config.json`` section."""
        reader = ConfigReader(self.source)
        return reader, reader.section(self.config)

    @property
    def architectures(self) -> tuple[str, ...]:
        """The ``architectures`` list of the config."""
        return tuple(self.reader()[1].optional("architectures", list) or ())

    @property
    def model_type(self) -> str:
        """The ``model_type`` of the config."""
        return self.reader()[1].optional("model_type", str) or ""


def describe_checkpoint(model_dir: str | Path, config_path: str | Path | None = None) -> ModelDescription:
    """Read a checkpoint directory (or a pinned config snapshot) into a :class:`ModelDescription`."""
    model_dir = Path(model_dir)
    if config_path is not None:
        config_file = Path(config_path)
    elif model_dir.is_dir():
        config_file = model_dir / "config.json"
    else:
        raise UserError(f"{model_dir}: not a checkpoint directory (expected config.json inside)")
    processor: dict[str, Any] = {}
    video: dict[str, Any] = {}
    if model_dir.is_dir():
        # Older checkpoints keep the image processor in preprocessor_config.json; transformers v5
        # saves it as the "image_processor" entry of processor_config.json.
        legacy, combined = model_dir / "preprocessor_config.json", model_dir / "processor_config.json"
        if legacy.exists():
            processor = read_json(legacy)
        elif combined.exists():
            processor = dict(
                ConfigReader(str(combined)).section(read_json(combined)).sub("image_processor").data
            )
        video_file = model_dir / "video_preprocessor_config.json"
        if video_file.exists():
            video = read_json(video_file)
        elif combined.exists():
            video = dict(ConfigReader(str(combined)).section(read_json(combined)).sub("video_processor").data)
    return ModelDescription(read_json(config_file), processor, str(config_file), video)
