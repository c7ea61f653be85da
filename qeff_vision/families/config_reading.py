"""How a family reads a checkpoint's configs into its typed view, once per checkpoint.

The config half of :class:`~qeff_vision.families.base.Family` (one of its base classes): the keys
that hold the language sub-config and the placeholder ids, the defaults a family states for what
its published configs leave out, and the methods that read them into
:mod:`~qeff_vision.families.config_view`'s frozen views, cached on the
:class:`~qeff_vision.families.description.ModelDescription`. Config names are normalized in this
one place; family code never chains getattr fallbacks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qeff_vision.contract.language_io import FULL_ATTENTION
from qeff_vision.errors import UserError
from qeff_vision.families.config_view import (
    ConfigReader,
    ConfigView,
    Section,
    TextGeometry,
    merged_text_config,
    read_text_geometry,
)
from qeff_vision.families.description import ModelDescription

if TYPE_CHECKING:
    from qeff_vision.families.features import Features


@dataclass(frozen=True)
class TextDims:
    """Normalized language-model dimensions (the only names family-agnostic code reads)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


class FamilyConfig:
    """Config reading of a :class:`~qeff_vision.families.base.Family` (a base class of it).

    It reads the family's ``name`` (the cache key of its views), ``title`` and ``features``,
    which :class:`~qeff_vision.families.base.Family` declares.

    Class attributes:
        text_config_key: Key of the language sub-config in ``config.json`` (top-level fields are
            used when absent, as in older Qwen2.5-VL checkpoints).
        image_token_key: Config key holding the image placeholder token id.
        video_token_key: Config key of the video placeholder id (families with video support).
        text_defaults: A family's stated defaults of language fields its published configs leave
            out (their source in ``text_defaults_source``); fields without a stated default are
            required.
        image_token_default: Default of the image placeholder id when the config omits it (None:
            the id is required).
        last_layer_type: The attention type the model's config class forces on the last decoder
            layer whatever ``layer_types`` lists (Gemma 4: ``full_attention``); None: as listed.
    """

    name: str
    title: str
    features: Features

    text_config_key: str = "text_config"
    image_token_key: str = "image_token_id"
    video_token_key: str | None = None
    text_defaults: Mapping[str, Any] = {}
    text_defaults_source: str = ""
    image_token_default: int | None = None
    last_layer_type: str | None = None

    def config_view(self, model: ModelDescription) -> ConfigView:
        """The typed view of ``model``'s configs: text and vision geometry, the defaults used."""
        text, text_reader = self._read(model, "text", self.read_text)
        vision, vision_reader = self._read(model, "vision", self.read_vision)
        placeholders, token_reader = self._read(model, "tokens", self.read_placeholder_ids)
        readers = (text_reader, vision_reader, token_reader)
        notes = tuple(note for reader in readers for note in reader.notes)
        required = tuple(field for r in readers for field in r.required)
        return ConfigView(text, vision, placeholders, notes, required)

    def _read(self, model: ModelDescription, part: str, read) -> tuple[Any, ConfigReader]:
        """One part of the view, read once per checkpoint and family (cached on ``model``)."""
        key = f"{self.name}:{part}"
        if key not in model.views:
            reader = ConfigReader(model.source)
            model.views[key] = (read(reader, model), reader)
        return model.views[key]

    def text_geometry(self, model: ModelDescription) -> TextGeometry:
        """The language geometry of ``model`` (:meth:`read_text`, read once)."""
        return self._read(model, "text", self.read_text)[0]

    def read_text(self, reader: ConfigReader, model: ModelDescription) -> TextGeometry:
        """The language geometry (the text sub-config over :attr:`text_defaults`).

        Raises:
            UserError: A value of the wrong type (one line naming the file).
        """
        try:
            return read_text_geometry(
                reader,
                merged_text_config(model.config, self.text_config_key),
                self.text_config_key,
                self.text_defaults,
                self.text_defaults_source,
                self.default_layer_types,
                self.last_layer_type,
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"{model.source}: unusable {self.title} config value ({exc})") from None

    def default_layer_types(self, text: Section, num_layers: int) -> Sequence[str]:
        """Layer types when the config lists none: full attention everywhere."""
        return [FULL_ATTENTION] * num_layers

    def read_vision(self, reader: ConfigReader, model: ModelDescription) -> Any:
        """The family's frozen vision geometry (None here; families override)."""
        return None

    def vision(self, model: ModelDescription) -> Any:
        """The family's vision geometry of ``model`` (:meth:`read_vision`, read once)."""
        return self._read(model, "vision", self.read_vision)[0]

    def text_config(self, model: ModelDescription) -> dict[str, Any]:
        """The raw language sub-config over :attr:`text_defaults` (top-level fields for flat configs)."""
        return {**self.text_defaults, **merged_text_config(model.config, self.text_config_key)}

    def text_dims(self, model: ModelDescription) -> TextDims:
        """Normalized language dimensions of ``model``."""
        text = self.text_geometry(model)
        return TextDims(
            hidden_size=text.hidden_size,
            num_layers=text.num_layers,
            num_attention_heads=text.num_attention_heads,
            num_kv_heads=text.num_kv_heads,
            head_dim=text.head_dim,
            vocab_size=text.vocab_size,
            max_position_embeddings=text.max_position_embeddings,
        )

    def read_placeholder_ids(self, reader: ConfigReader, model: ModelDescription) -> tuple[int, ...]:
        """The image placeholder id, then the video one for a family that exports video."""
        top = reader.section(model.config)
        if self.image_token_default is None:
            ids = [top.required(self.image_token_key)]
        else:
            ids = [top.default(self.image_token_key, self.image_token_default, int, f"{self.title} default")]
        if self.video_token_key and self.features.video.supported:
            ids.append(top.required(self.video_token_key))
        return tuple(ids)

    def image_token_id(self, model: ModelDescription) -> int:
        """Token id of the image placeholder."""
        return self.placeholder_token_ids(model)[0]

    def placeholder_token_ids(self, model: ModelDescription) -> tuple[int, ...]:
        """Every placeholder id whose tokens take vision rows: the image id, then the video id."""
        return self._read(model, "tokens", self.read_placeholder_ids)[0]
