"""Declarative description of a vision-language model family.

A family is data plus a little token math: which Hugging Face architectures it accepts, how its
config names map to normalized dimensions, the symbolic axes of its two programs, how many
vision tokens an image of a given resolution becomes, and which features it supports. Nothing in
this module imports torch; the torch side of a family lives in its ``export`` module and is
imported only when a graph is built (see :class:`FamilyParts` and :meth:`Family.adapter`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qeff_vision import symbols
from qeff_vision.contract.decoder_kinds import (  # noqa: F401 - CROSS_ATTENTION re-exported for families
    CROSS_ATTENTION,
    TOKEN_MERGE,
    DecoderKind,
)
from qeff_vision.contract.full_kv import full_length_caches
from qeff_vision.contract.language_io import (  # noqa: F401 - layer types re-exported for families
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    HEAD_DIM,
    HIDDEN_SIZE,
    LINEAR_ATTENTION,
    NUM_KV_HEADS,
    RECURRENT,
    SLIDING_ATTENTION,
    VOCAB_SIZE,
    IORow,
    LanguageIO,
    LayerCache,
    Role,
    language_io,
)
from qeff_vision.families.description import ModelDescription, describe_checkpoint  # noqa: F401
from qeff_vision.families.features import (  # noqa: F401 - the feature vocabulary, re-exported
    DISAGGREGATED_PROGRAMS,
    EVS_VIDEO_PRUNING,
    NO_DEEPSTACK,
    NO_VIDEO_PRUNING,
    NOT_DECLARED,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    SINGLE_PROGRAM_NOT_BUILT,
    Features,
    Support,
    bidirectional,
    no,
    yes,
)

if TYPE_CHECKING:
    from qeff_vision.families.host import Host

from qeff_vision.families.config_view import (
    ConfigReader,
    ConfigView,
    Section,
    TextGeometry,
    merged_text_config,
    read_text_geometry,
)


@dataclass(frozen=True)
class ImageSize:
    """An image resolution the user wants compiled (height and width in pixels, before resizing)."""

    height: int
    width: int
    frames: int = 1
    video: bool = False  # a clip of ``frames`` frames (``vision.videos``), not a still image


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


@dataclass(frozen=True)
class FamilyParts:
    """The parts of a registered family besides its description (see :func:`~qeff_vision.families.register`).

    Attributes:
        host: The family's host-protocol class (numpy only).
        adapter: Zero-argument loader of the export adapter class; it imports torch, so it runs
            only when a graph is built.
        tiny: ``tiny(out_dir, seed=0) -> Path``: writes a tiny random checkpoint of the family.
    """

    host: type[Host]
    adapter: Callable[[], type]
    tiny: Callable[..., Path]


class Family:
    """Base class of a model family description. Subclasses set the class attributes and token math.

    Class attributes:
        name: Registry key and CLI value (``qwen2_5_vl``).
        title: Human name for tables.
        architectures: ``config.architectures`` values this family accepts.
        model_types: ``config.model_type`` values this family accepts.
        features: The feature matrix.
        parts: Host class, export-adapter loader and tiny builder, set by registration.
        position_id_rows: ``None`` for ``position_ids`` of shape [batch, seq]; an integer R for
            [R, batch, seq] (Qwen-VL's M-RoPE: row 0 text position, rows 1-3 t/h/w).
        vision_input_axes: Vision-program inputs and their symbolic axes.
        text_config_key: Key of the language sub-config in ``config.json`` (top-level fields are
            used when absent, as in older Qwen2.5-VL checkpoints).
        image_token_key: Config key holding the image placeholder token id.
        tokens_between_images: The fewest tokens the processor always puts between the placeholder
            runs of two images (marker tokens). Only families that keep images whole use it: the
            ``chunk`` policy then sizes a bucket for the whole images that really fit in it.
        placeholders_in_runs: One image's placeholders are several runs with other tokens between
            them (Mistral 3 ends each row of image tokens with ``[IMG_BREAK]``); the host then
            joins consecutive runs into an image by its row count.
        decoder_kind: :data:`TOKEN_MERGE` (image rows replace placeholder embeddings) or
            :data:`CROSS_ATTENTION` (image states are cross-attention K/V); see
            :mod:`qeff_vision.contract.decoder_kinds`.
    """

    name: str = ""
    title: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    features: Features
    parts: FamilyParts | None = None
    position_id_rows: int | None = None
    vision_input_axes: Mapping[str, Mapping[int, str]] = {}
    text_config_key: str = "text_config"
    image_token_key: str = "image_token_id"
    #: Config key of the video placeholder id (families with video support).
    video_token_key: str | None = None
    tokens_between_images: int = 0
    placeholders_in_runs: bool = False
    #: Extra inputs of the language program that carry rows of the vision program's output sliced
    #: per chunk exactly like ``vision_embeds`` (same rows, same ``vision_size``), stacked on a
    #: leading axis: name -> symbol of that axis. Each is also a vision-program output of the same
    #: name and has a ``_RetainedState`` output. Qwen3-VL's deepstack features are one.
    #: They become rows of the language IO table (:meth:`language_io`).
    stacked_vision_rows: Mapping[str, str] = {}
    #: A family's own language inputs, rows of the IO table placed after ``position_ids``
    #: (mllama's ``cross_attention_mask``). Their symbols are bound by :meth:`language_symbols` or
    #: :meth:`request_symbols`, their :class:`~qeff_vision.contract.language_io.Fixed` dimensions
    #: by :meth:`language_symbols`.
    extra_language_inputs: tuple[IORow, ...] = ()
    decoder_kind: DecoderKind = TOKEN_MERGE
    #: The vision graph's symbol that counts the images of one call. ``deployment: single`` names it
    #: ``num_images`` in the composed program (compile/single_program.py); a vision graph whose
    #: first axis is the language batch (mllama: [batch, images, tiles, C, S, S]) names another.
    vision_images_symbol: str = symbols.BATCH_SIZE
    #: ``deployment: single``'s encode gate: the axis of the vision graph's first (pixel) input
    #: whose extent is 1 in a keep specialization (the host's placeholder) and larger in every
    #: encode one. The image side (the last axis) of [..., C, H, W] images by default; a
    #: patch-sequence graph ([patches, patch_dim]) names its patch axis. A pixel input without the
    #: image-count axis concatenates a call's images on this axis, so an encode entry of n images
    #: binds its symbol to their sum (spec/single.py).
    single_encode_axis: int = -1
    #: Optional capability: the family's :class:`PatchBuckets` subclass (a vision program on patch
    #: counts, several images packed per call). None: ``vision.patch_buckets`` is refused.
    patch_bucket_capability: type[PatchBuckets] | None = None

    #: Image-processor options a spec may set (``vision.image_processor``): name -> allowed values
    #: (Gemma 4's ``max_soft_tokens``). The spec's token math reads them over the checkpoint's
    #: processor config, and compile writes them into OUT's copy of it, so ``run`` processes
    #: images exactly as the vision specializations were compiled.
    image_processor_options: Mapping[str, tuple[int, ...]] = {}

    @property
    def bidirectional_images(self) -> bool:
        """Placeholders of one image attend to each other both ways (declared by ``chunk_split``)."""
        return self.features.chunk_split.bidirectional_images

    def _parts(self) -> FamilyParts:
        if self.parts is None:
            raise TypeError(f"family {self.name!r} is not registered (no host, adapter or tiny builder)")
        return self.parts

    def host(self, model: ModelDescription) -> Host:
        """The host protocol of this family for ``model`` (a :class:`~qeff_vision.families.host.Host`)."""
        return self._parts().host(self, model)

    def adapter(self):
        """The family's export adapter (imports torch): an ``ExportAdapter`` holding this family."""
        return self._parts().adapter()(self)

    def write_tiny_checkpoint(self, out_dir: str | Path, seed: int = 0) -> Path:
        """Write a tiny random-weight checkpoint of this family to ``out_dir``."""
        return self._parts().tiny(out_dir, seed)

    # ---- config normalization (one place; family code never chains getattr fallbacks) ----

    #: A family's stated defaults of language fields its published configs leave out (their source
    #: in :attr:`text_defaults_source`); fields without a stated default are required.
    text_defaults: Mapping[str, Any] = {}
    text_defaults_source: str = ""
    #: Default of the image placeholder id when the config omits it (None: the id is required).
    image_token_default: int | None = None

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
        """The language geometry (the text sub-config over :attr:`text_defaults`)."""
        return read_text_geometry(
            reader,
            merged_text_config(model.config, self.text_config_key),
            self.text_config_key,
            self.text_defaults,
            self.text_defaults_source,
            self.default_layer_types,
        )

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

    def splits_images(self, model: ModelDescription) -> bool:
        """Whether ``model``'s image placeholders may be split across prefill chunks.

        The family's ``chunk_split`` feature by default. A family whose image attention depends on
        the checkpoint (Gemma 4: bidirectional on sliding layers only with
        ``use_bidirectional_attention == "vision"``) reads it here; the planner, the spec checks
        and the specializations ask this, not the feature.
        """
        return self.features.chunk_split.supported

    # ---- token math (subclasses) ----

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """Values of every symbolic vision-program dimension for one image (batch excluded).

        Must include ``vision_size``: the vision tokens of one image including frames.
        """
        raise NotImplementedError

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """The vision graph's pixel side when it is fixed (not a symbol), else None.

        ``deployment: single`` renames a fixed side to a symbol so its encode entries bind it
        (compile/single_program.py ``PIXEL_SIDE``).
        """
        return None

    def image_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """Placeholder tokens (= vision_embeds rows) one image of this size becomes."""
        return self.vision_symbols(model, image)[symbols.VISION_SIZE]

    def language_rows(
        self, model: ModelDescription, image: ImageSize, video_pruning_rate: float = 0.0
    ) -> int:
        """Rows (= placeholders) an image or clip takes in the prompt at a video pruning rate.

        Its :meth:`image_tokens`; a family declaring ``video_pruning`` gives a pruned clip's kept
        rows, which depend only on the grid and the rate (so ``specialize`` sizes for them).
        """
        return self.image_tokens(model, image)

    def image_extent(self, model: ModelDescription, image: ImageSize) -> int:
        """Prompt tokens from an image's first placeholder to its last.

        Its placeholders, plus the break tokens between them in a family with ``placeholders_in_runs``.
        """
        return self.image_tokens(model, image)

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Problems with compiling ``image`` for this family (empty when fine)."""
        return []

    def language_symbols(self, model: ModelDescription) -> dict[str, int]:
        """Values of family-specific language-program symbols (e.g. a stacked rows axis)."""
        return {}

    def stack_depths(self, model: ModelDescription) -> dict[str, int]:
        """Leading-axis size of each :attr:`stacked_vision_rows` input, by input name."""
        values = self.language_symbols(model)
        return {name: int(values[symbol]) for name, symbol in self.stacked_vision_rows.items()}

    def request_symbols(self, model: ModelDescription, max_images: int) -> dict[str, int]:
        """Language-program symbols fixed by how many images one request may carry (none by default).

        A cross-attention family binds its image-slot axes here (``max_num_images`` and the rows
        of the retained cross-attention states).
        """
        return {}

    # ---- KV cache per layer (generic: read from the text config's layer types) ----

    def layer_types(self, model: ModelDescription) -> list[str]:
        """Attention type per decoder layer (``full_attention`` / ``sliding_attention``)."""
        return list(self.text_geometry(model).layer_types)

    def kv_cache_symbols(self, model: ModelDescription) -> list[str]:
        """Symbol of each layer's KV slot axis: ``ctx_len``, or a ring's symbol for ring layers.

        A window layer (``sliding_attention`` with a ``sliding_window``) keeps a ring of that many
        slots (``sliding_window``); a chunked layer (``chunked_attention`` with an
        ``attention_chunk_size``) a ring of ``min(ctx_len, attention_chunk_size)`` slots
        (``chunk_ctx_len``): a query sees only keys of its own block, all of which that ring holds.
        The exporter, the specializations and the runtime all size caches from this list.
        """
        text = self.text_geometry(model)
        rings = {
            SLIDING_ATTENTION: symbols.SLIDING_WINDOW if text.sliding_window else None,
            CHUNKED_ATTENTION: symbols.CHUNK_CTX_LEN if text.attention_chunk_size else None,
        }
        return [rings.get(kind) or symbols.CTX_LEN for kind in self.layer_types(model)]

    def recurrent_layers(self, model: ModelDescription) -> tuple[int, ...]:
        """Layers of the recurrent kind (``linear_attention``): conv and recurrent state rows, no KV."""
        return tuple(i for i, kind in enumerate(self.layer_types(model)) if kind == LINEAR_ATTENTION)

    def layer_caches(self, model: ModelDescription) -> list[LayerCache]:
        """What each decoder layer keeps: full cache, sliding ring, a layer it reads, or recurrent state.

        The default gives every layer a cache of the model's ``num_kv_heads`` x ``head_dim`` on
        its :meth:`kv_cache_symbols` axis, and each of :meth:`recurrent_layers` the recurrent kind.
        A family whose layers differ (per-layer head dims, layers that read an earlier layer's
        cache and keep none) overrides it; the IO table and so the export, zero caches, custom IO
        and specializations follow.
        """
        recurrent = set(self.recurrent_layers(model))
        return [
            RECURRENT if layer in recurrent else LayerCache(symbol)
            for layer, symbol in enumerate(self.kv_cache_symbols(model))
        ]

    def kv_cache_lengths(self, model: ModelDescription, ctx_len: int) -> dict[str, int]:
        """Values of the KV slot symbols for ``ctx_len`` (a ring never exceeds the context)."""
        values = {symbols.CTX_LEN: ctx_len}
        used = self.kv_cache_symbols(model)
        text = self.text_geometry(model)
        for symbol, span in (
            (symbols.SLIDING_WINDOW, text.sliding_window),
            (symbols.CHUNK_CTX_LEN, text.attention_chunk_size),
        ):
            if symbol in used:
                values[symbol] = min(int(span), ctx_len)
        return values

    # ---- language IO (one table: qeff_vision/contract/language_io.py) ----

    def language_io(
        self,
        num_layers: int,
        cache_symbols: Sequence[str | LayerCache] | None = None,
        comp_ctx_lengths: bool = False,
        continuous_batching: bool = False,
        recurrent_layers: Sequence[int] = (),
    ) -> LanguageIO:
        """The language program's IO table, from which every consumer derives its names and shapes.

        ``cache_symbols`` (from :meth:`layer_caches`, or bare slot symbols) declares each layer's
        cache; all ``ctx_len`` when omitted. ``comp_ctx_lengths`` adds that input last (CCL exports);
        ``continuous_batching`` gives the caches ``full_batch_size`` slots and adds ``batch_index``;
        ``recurrent_layers`` (from :meth:`recurrent_layers`) get conv and recurrent state rows
        (as a :data:`~qeff_vision.contract.language_io.RECURRENT` entry of ``cache_symbols`` does).
        A family reshapes the table by data: :attr:`position_id_rows`, :attr:`stacked_vision_rows`,
        :attr:`extra_language_inputs`, :attr:`decoder_kind` and :meth:`kv_cache_symbols`.
        """
        return language_io(
            num_layers,
            self.position_id_rows,
            cache_symbols,
            comp_ctx_lengths,
            self.stacked_vision_rows,
            merges_vision_rows=self.decoder_kind.merges_vision_rows,
            extra_inputs=self.extra_language_inputs,
            continuous_batching=continuous_batching,
            recurrent_layers=recurrent_layers,
        )

    def language_table(
        self,
        model: ModelDescription,
        comp_ctx_lengths: bool = False,
        continuous_batching: bool = False,
        retain_full_kv: bool = False,
    ) -> LanguageIO:
        """:meth:`language_io` for ``model`` (its layer count and per-layer caches).

        ``retain_full_kv`` gives every ring layer a ``ctx_len`` cache instead of its ring
        (:mod:`qeff_vision.contract.full_kv`).
        """
        layers = self.text_dims(model).num_layers
        caches = self.layer_caches(model)
        if retain_full_kv:
            caches = full_length_caches(caches)
        return self.language_io(layers, caches, comp_ctx_lengths, continuous_batching)

    def language_dims(self, model: ModelDescription) -> dict[str, int]:
        """Values of the table's fixed model dimensions (:class:`~qeff_vision.contract.language_io.Fixed`)."""
        dims = self.text_dims(model)
        return {
            HIDDEN_SIZE: dims.hidden_size,
            NUM_KV_HEADS: dims.num_kv_heads,
            HEAD_DIM: dims.head_dim,
            VOCAB_SIZE: dims.vocab_size,
            **self.language_symbols(model),
        }

    def language_input_axes(
        self, num_layers: int, cache_symbols: Sequence[str] | None = None, comp_ctx_lengths: bool = False
    ) -> dict[str, dict[int, str]]:
        """Symbolic axes of every language-program input, in graph input order (from the table)."""
        return self.language_io(num_layers, cache_symbols, comp_ctx_lengths).input_axes()

    def language_output_axes(
        self, num_layers: int, cache_symbols: Sequence[str] | None = None
    ) -> dict[str, dict[int, str]]:
        """Symbolic axes of every language-program output, in graph output order (from the table)."""
        return self.language_io(num_layers, cache_symbols).output_axes()

    def vision_outputs(self, model: ModelDescription) -> dict[str, dict[int, str]]:
        """Vision-program outputs and their axes for ``model``: the language table's vision rows.

        The vision program produces what the language program's vision-row inputs take, under the
        same names; its batch axis is ``batch_size`` (images per call) where the language input
        has ``vision_batch_size``. A cross-attention family overrides this (its K/V rows).
        """
        rename = {symbols.VISION_BATCH_SIZE: symbols.BATCH_SIZE}
        return {
            row.name: {
                axis: rename[symbol] if symbol in rename else symbol for axis, symbol in row.axes.items()
            }
            for row in self.language_table(model).rows(Role.VISION_ROWS)
        }

    # ---- optional capabilities ----

    @property
    def patch_buckets(self) -> PatchBuckets | None:
        """The family's patch-bucket vision program (:attr:`patch_bucket_capability`), or None."""
        capability = self.patch_bucket_capability
        return None if capability is None else capability(self)

    @property
    def supports_patch_buckets(self) -> bool:
        """The family has a patch-bucket vision program."""
        return self.patch_bucket_capability is not None

    def vision_io(self, model: ModelDescription, patch_buckets: bool = False):
        """(input axes, output axes) of the vision program in the given mode."""
        if patch_buckets and self.patch_buckets is not None:
            return dict(self.patch_buckets.input_axes), dict(self.patch_buckets.output_axes)
        return dict(self.vision_input_axes), self.vision_outputs(model)


class PatchBuckets:
    """Optional capability: a vision program specialized on a patch count instead of a resolution.

    For towers that take any resolution: several images are packed per call into a bucket of
    patches. A family that has it sets :attr:`Family.patch_bucket_capability` to its subclass;
    its host then also packs images (``patch_layout``, ``pack_vision_inputs``, ``item_patches``,
    ``item_rows``) and its export adapter builds the program (``patch_bucket_encoder``,
    ``patch_bucket_example_inputs``). Families without it have nothing to override.

    Args:
        family: The family whose token math the buckets follow.
    """

    #: Inputs and outputs of the patch-bucket vision program and their symbolic axes.
    input_axes: Mapping[str, Mapping[int, str]] = {}
    output_axes: Mapping[str, Mapping[int, str]] = {}

    def __init__(self, family: Family):
        self.family = family

    def patch_count(self, model: ModelDescription, image: ImageSize) -> int:
        """Patches an image occupies in a bucket at its own (processor-resized) resolution."""
        raise NotImplementedError

    def bucket_symbols(self, model: ModelDescription, patches: int) -> dict[str, int]:
        """Values of the patch-bucket program's symbols for a bucket of ``patches`` (vision_size included)."""
        raise NotImplementedError

    def bucket_problems(self, model: ModelDescription, patches: int) -> list[str]:
        """Why ``patches`` cannot be a bucket (empty when it can)."""
        return []

    def fit_to_patches(self, model: ModelDescription, image: ImageSize, patches: int) -> tuple[int, int]:
        """(height, width) the processor's own resize gives with its pixel bound set to ``patches``."""
        raise NotImplementedError

    def max_patches(self, model: ModelDescription) -> int:
        """Patches of the largest image the processor produces."""
        raise NotImplementedError
