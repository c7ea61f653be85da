"""Typed, torch-free views of a checkpoint's config: every raw config read of a family happens here.

A family reads ``config.json`` (and the processor configs) once into frozen dataclasses — the text
geometry below and the family's own vision geometry — that its description, its host protocol and
its export adapter all use. A :class:`Section` is the only way to read a raw field:

- :meth:`Section.required` raises one :class:`~qeff_vision.errors.UserError` naming the field and
  the file when the field is missing (the CLI prints it as one line, exit code 2);
- :meth:`Section.default` states a default once, next to its source, and records a note when the
  checkpoint leaves the field out (shown by ``qeff-vision validate``);
- :meth:`Section.optional` is for fields whose absence means something (no sliding window).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qeff_vision.contract.language_io import FULL_ATTENTION
from qeff_vision.errors import UserError

_MISSING = object()


class ConfigReader:
    """Reads the dictionaries of one checkpoint, recording the defaults it falls back to.

    Args:
        source: The config file, for messages.
    """

    def __init__(self, source: str):
        self.source = source
        self.notes: list[str] = []
        self.required: list[str] = []

    def section(self, data: Mapping[str, Any] | None, path: str = "") -> Section:
        """A view of ``data`` (a missing section is empty); ``path`` prefixes field names in messages."""
        return Section(self, dict(data or {}), path)


class Section:
    """One dictionary of a config (``config.json``, its ``vision_config``, the processor config)."""

    def __init__(self, reader: ConfigReader, data: Mapping[str, Any], path: str):
        self.reader = reader
        self.data = data
        self.path = path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def sub(self, key: str) -> Section:
        """The nested dictionary ``key`` (empty when absent or null)."""
        value = self.data.get(key)
        return Section(self.reader, dict(value) if isinstance(value, Mapping) else {}, self._name(key))

    def has(self, key: str) -> bool:
        """Whether the field is present and not null."""
        return self.data.get(key) is not None

    def required(self, key: str, kind: Callable[[Any], Any] = int) -> Any:
        """The field converted by ``kind``; a user error naming the field and the file when missing."""
        self.reader.required.append(self._name(key))
        value = self.data.get(key)
        if value is None:
            raise UserError(f"{self.reader.source}: config lacks required field {self._name(key)!r}")
        return kind(value)

    def default(self, key: str, value: Any, kind: Callable[[Any], Any] = int, source: str = "") -> Any:
        """The field converted by ``kind``, or ``value`` (noted) when the checkpoint leaves it out.

        Args:
            key: The field.
            value: The default, stated once here (``source`` says whose default it is).
            kind: Conversion of a present value.
            source: Where the default comes from, for the note.
        """
        present = self.data.get(key)
        if present is None or present == "":
            why = f" ({source})" if source else ""
            self.reader.notes.append(f"{self._name(key)} not set; using {value!r}{why}")
            return value
        return kind(present)

    def optional(self, key: str, kind: Callable[[Any], Any] = int) -> Any:
        """The field converted by ``kind``, or None when absent (absence has a meaning of its own)."""
        value = self.data.get(key)
        return None if value is None else kind(value)

    def first(self, keys: Sequence[tuple[Section, str]], value: Any, kind=int, source: str = "") -> Any:
        """The first of several spellings of one setting that is set (truthy), else the noted default."""
        for section, key in keys:
            present = section.data.get(key)
            if present:
                return kind(present)
        names = " / ".join(section._name(key) for section, key in keys)
        why = f" ({source})" if source else ""
        self.reader.notes.append(f"{names} not set; using {value!r}{why}")
        return value


def pair(value: Any) -> tuple[int, int]:
    """A (height, width) pair from a ``[h, w]`` list (pinpoints)."""
    height, width = value
    return int(height), int(width)


@dataclass(frozen=True)
class TextGeometry:
    """The language model's dimensions and per-layer attention, read once.

    Attributes:
        hidden_size: Hidden width.
        num_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_kv_heads: Key/value heads (the query heads when not grouped).
        head_dim: Per-head width (hidden / heads unless stated).
        vocab_size: Vocabulary size.
        max_position_embeddings: Trained context (0 when unstated).
        layer_types: Attention type of every layer.
        sliding_window: Window of ``sliding_attention`` layers (None: no window).
        attention_chunk_size: Block of ``chunked_attention`` layers (None: no blocks).
    """

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_chunk_size: int | None = None


def merged_text_config(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The language sub-config ``key`` over the top-level scalar fields (flat configs use those)."""
    merged = {k: v for k, v in config.items() if not isinstance(v, dict)}
    sub = config.get(key)
    merged.update(sub if isinstance(sub, Mapping) else {})
    return merged


def read_text_geometry(
    reader: ConfigReader,
    text: Mapping[str, Any],
    path: str,
    defaults: Mapping[str, Any] | None = None,
    source: str = "",
    layer_types: Callable[[Section, int], Sequence[str]] | None = None,
    last_layer_type: str | None = None,
) -> TextGeometry:
    """Read the text geometry from the merged text config ``text``.

    Args:
        reader: The checkpoint's reader.
        text: The merged language config (:func:`merged_text_config`).
        path: Its name in messages (``text_config``).
        defaults: A family's stated defaults for fields its checkpoints may omit (otherwise the
            dimension fields are required).
        source: Whose defaults those are, for the notes.
        layer_types: The family's rule for layer types when the config lists none (all full
            attention otherwise).
        last_layer_type: The type the model's config class forces on the last layer, listed or
            not (None: the types are read as they are).
    """
    section = reader.section(text, path)
    defaults = defaults or {}

    def dim(key: str) -> int:
        if key in defaults:
            return section.default(key, defaults[key], int, source)
        return section.required(key)

    def derived(key: str, fallback: int) -> int:
        if key in defaults:
            return section.default(key, defaults[key], int, source)
        return section.optional(key) or fallback

    hidden, layers, heads = dim("hidden_size"), dim("num_hidden_layers"), dim("num_attention_heads")
    kv_heads = derived("num_key_value_heads", heads)
    head_dim = derived("head_dim", hidden // heads)
    vocab = dim("vocab_size")
    max_positions = derived("max_position_embeddings", 0)
    declared = section.optional("layer_types", list)
    if declared:
        types = tuple(declared)
    elif layer_types is not None:
        types = tuple(layer_types(section, layers))
    else:
        types = (FULL_ATTENTION,) * layers
    if last_layer_type is not None and types:
        types = (*types[:-1], last_layer_type)
    window = (
        derived("sliding_window", 0) if "sliding_window" in defaults else section.optional("sliding_window")
    )
    chunk = (
        derived("attention_chunk_size", 0)
        if "attention_chunk_size" in defaults
        else section.optional("attention_chunk_size")
    )
    return TextGeometry(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        layer_types=types,
        sliding_window=int(window) if window else None,
        attention_chunk_size=int(chunk) if chunk else None,
    )


@dataclass(frozen=True)
class ConfigView:
    """Everything a family reads from one checkpoint's configs.

    Attributes:
        text: The language geometry.
        vision: The family's own frozen vision geometry (None for a family without one).
        placeholder_ids: The image placeholder id, then the video one (families with video).
        notes: The defaults used because the checkpoint leaves their fields out.
        required: The required fields read (each missing one is a one-line error).
    """

    text: TextGeometry
    vision: Any
    placeholder_ids: tuple[int, ...]
    notes: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
