"""What a family declares about its language program: per-layer caches and the IO table.

The IO half of :class:`~qeff_vision.families.base.Family` (one of its base classes). Every layer's
state (:mod:`qeff_vision.contract.states`) follows from the text geometry's layer types by
default (a full ``ctx_len`` cache, a sliding or chunked ring, recurrent state), and the language
program's inputs and outputs from one table
(:mod:`qeff_vision.contract.language_io`) that a family reshapes by data: position rows, stacked
vision rows, extra inputs, its decoder kind. The exporter, the specializations and the runtime all
read names, shapes and symbol values from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qeff_vision import symbols
from qeff_vision.contract.decoder_kinds import TOKEN_MERGE, DecoderKind
from qeff_vision.contract.full_kv import full_length_caches
from qeff_vision.contract.language_io import (
    HEAD_DIM,
    HIDDEN_SIZE,
    NUM_KV_HEADS,
    VOCAB_SIZE,
    IORow,
    LanguageIO,
    Role,
    language_io,
)
from qeff_vision.contract.states import LayerState, state_for_layer_type
from qeff_vision.families.description import ModelDescription


class FamilyLanguageIO:
    """Language-program declarations of a :class:`~qeff_vision.families.base.Family` (a base class of it).

    It reads the geometry through ``text_geometry`` and ``text_dims``
    (:class:`~qeff_vision.families.config_reading.FamilyConfig`, the family's other base).

    Class attributes:
        position_id_rows: ``None`` for ``position_ids`` of shape [batch, seq]; an integer R for
            [R, batch, seq] (Qwen-VL's M-RoPE: row 0 text position, rows 1-3 t/h/w).
        stacked_vision_rows: Extra inputs of the language program that carry rows of the vision
            program's output sliced per chunk exactly like ``vision_embeds`` (same rows, same
            ``vision_size``), stacked on a leading axis: name -> symbol of that axis. Each is also a
            vision-program output of the same name and has a ``_RetainedState`` output. Qwen3-VL's
            deepstack features are one. They become rows of the language IO table.
        extra_language_inputs: A family's own language inputs, rows of the IO table placed after
            ``position_ids`` (mllama's ``cross_attention_mask``). Their symbols are bound by
            :meth:`language_symbols` or :meth:`request_symbols`, their
            :class:`~qeff_vision.contract.language_io.Fixed` dimensions by :meth:`language_symbols`.
        decoder_kind: :data:`~qeff_vision.contract.decoder_kinds.TOKEN_MERGE` (image rows replace
            placeholder embeddings) or :data:`~qeff_vision.contract.decoder_kinds.CROSS_ATTENTION`
            (image states are cross-attention K/V); see :mod:`qeff_vision.contract.decoder_kinds`.
    """

    position_id_rows: int | None = None
    stacked_vision_rows: Mapping[str, str] = {}
    extra_language_inputs: tuple[IORow, ...] = ()
    decoder_kind: DecoderKind = TOKEN_MERGE

    # ---- family-specific language symbols ----

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

    # ---- the state of each layer (generic: read from the text config's layer types) ----

    def layer_types(self, model: ModelDescription) -> list[str]:
        """Attention type per decoder layer, as the text geometry reads it (``full_attention``, ...)."""
        return list(self.text_geometry(model).layer_types)

    def layer_caches(self, model: ModelDescription) -> list[LayerState]:
        """What each decoder layer keeps: one state per layer, the family's one declaration of it.

        The default gives each layer the default state of its ``layer_types`` entry
        (:func:`~qeff_vision.contract.states.state_for_layer_type`: a ``sliding_window`` ring, a
        ``chunk_ctx_len`` ring, a recurrent state, else a full ``ctx_len`` cache of the model's
        ``num_kv_heads`` x ``head_dim``). A family whose layers differ (per-layer head dims,
        layers that read an earlier layer's cache, cross-attention layers, another kind) overrides
        it; the IO table and so the export, zero caches, custom IO and specializations follow.
        """
        text = self.text_geometry(model)
        return [state_for_layer_type(layer_type, text) for layer_type in text.layer_types]

    def kv_cache_symbols(self, model: ModelDescription) -> list[str]:
        """Each layer's slot-axis symbol, read from :meth:`layer_caches` (a view, not a declaration).

        A shared layer shows its producer's; a layer without a slot axis (recurrent) ``ctx_len``.
        """
        states = self.layer_caches(model)
        sources = (state if state.reads is None else states[state.reads] for state in states)
        return [getattr(state, "length", symbols.CTX_LEN) for state in sources]

    def kv_cache_lengths(self, model: ModelDescription, ctx_len: int) -> dict[str, int]:
        """Values of the slot symbols for ``ctx_len``, each state binding its own.

        A ring never exceeds the context; a family binds its own symbols by overriding this.
        """
        values = {symbols.CTX_LEN: ctx_len}
        for state in self.layer_caches(model):
            values.update(state.symbol_values(ctx_len))
        return values

    # ---- language IO (one table: qeff_vision/contract/language_io.py) ----

    def language_io(
        self,
        num_layers: int,
        cache_symbols: Sequence[str | LayerState] | None = None,
        comp_ctx_lengths: bool = False,
        continuous_batching: bool = False,
    ) -> LanguageIO:
        """The language program's IO table, from which every consumer derives its names and shapes.

        ``cache_symbols`` (from :meth:`layer_caches`, or bare slot symbols) declares each layer's
        state; all ``ctx_len`` when omitted. ``comp_ctx_lengths`` adds that input last (CCL exports);
        ``continuous_batching`` gives the states ``full_batch_size`` slots and adds ``batch_index``.
        A family reshapes the table by data: :attr:`position_id_rows`, :attr:`stacked_vision_rows`,
        :attr:`extra_language_inputs`, :attr:`decoder_kind` and :meth:`layer_caches`.
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
