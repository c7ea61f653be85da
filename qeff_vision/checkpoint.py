"""One checkpoint object: config, processor, tokenizer, end-of-sequence ids and family, read once.

Before this, the runtime, the calibration, verification and the benchmarks each rebuilt the same
settings from a checkpoint directory (config.json, generation_config.json, the processor). A
:class:`Checkpoint` is what they share. Opening one imports neither torch nor transformers; the
processor (which needs transformers) is loaded on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from qeff_vision.bad_input import reading
from qeff_vision.errors import UserError
from qeff_vision.families import Family, family_for, get_family
from qeff_vision.families.base import ModelDescription, TextDims, describe_checkpoint
from qeff_vision.fsutil import read_json
from qeff_vision.hf_logging import quiet_transformers

__all__ = ["Checkpoint", "quiet_transformers"]


def _eos_ids(generation: Mapping[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id")
    ids = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    return tuple(int(token) for token in ids)


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint as the host sees it.

    Attributes:
        description: config.json and the image-processor config (no torch).
        family: The family that serves it.
        eos_token_ids: End-of-sequence ids from generation_config.json (empty when absent).
        directory: The checkpoint directory; ``None`` for a config held in memory (tests, token
            math on a pinned config), which has no processor.
    """

    description: ModelDescription
    family: Family
    eos_token_ids: tuple[int, ...] = ()
    directory: Path | None = None
    _loaded: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, model_dir: str | Path, family: Family | str | None = None) -> Checkpoint:
        """Read a checkpoint directory; the family is detected from its config unless given.

        Raises:
            UserError: No config.json there (the checkpoint an export came from is gone), or no
                family accepts the config.
        """
        directory = Path(model_dir)
        if not (directory / "config.json").is_file():
            raise UserError(
                f"{directory}: the checkpoint these programs were exported from is gone (no config.json); "
                "the runtime needs its config, processor and chat template"
            )
        description = describe_checkpoint(directory)
        generation = directory / "generation_config.json"
        eos = _eos_ids(read_json(generation)) if generation.exists() else ()
        return cls(description, _family(family, description), eos, directory)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        family: Family | str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> Checkpoint:
        """A checkpoint known only by its config.json dictionary (no processor)."""
        description = ModelDescription(config)
        return cls(description, _family(family, description), tuple(eos_token_ids))

    @property
    def config(self) -> Mapping[str, Any]:
        """The raw config.json dictionary."""
        return self.description.config

    @cached_property
    def dims(self) -> TextDims:
        """Normalized language dimensions."""
        return self.family.text_dims(self.description)

    @cached_property
    def host(self):
        """The family's host protocol: vision inputs per image, placeholder counts, positions."""
        return self.family.host(self.description)

    @property
    def processor(self):
        """The checkpoint's own transformers processor (loaded once, on first use)."""
        if "processor" not in self._loaded:
            if self.directory is None:
                raise UserError(f"{self.description.source}: a config without a checkpoint has no processor")
            quiet_transformers()
            from transformers import AutoProcessor

            with reading(self.directory, "a checkpoint with a processor and tokenizer"):
                processor = AutoProcessor.from_pretrained(str(self.directory))
            if getattr(processor, "tokenizer", None) is None:
                # Without one, generation would run and print token ids nobody can read.
                raise UserError(
                    f"{self.directory}: no tokenizer files (tokenizer.json, tokenizer_config.json)"
                )
            self._loaded["processor"] = processor
        return self._loaded["processor"]

    @property
    def tokenizer(self):
        """The processor's tokenizer."""
        return self.processor.tokenizer

    def reference_model(self):
        """The checkpoint as a transformers model (the parity reference): float32, eager, eval mode."""
        if "model" not in self._loaded:
            import torch
            from transformers import AutoModelForImageTextToText

            quiet_transformers()
            self._loaded["model"] = AutoModelForImageTextToText.from_pretrained(
                str(self.directory), dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return self._loaded["model"]


def _family(family: Family | str | None, description: ModelDescription) -> Family:
    if isinstance(family, Family):
        return family
    return get_family(family) if family else family_for(description)
