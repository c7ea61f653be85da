"""The language program's IO declared once, as rows of a table (torch-free).

Every consumer of the language IO derives from one :class:`LanguageIO`: the export's input and
output names, dynamic axes and example inputs, the decoder wrapper's argument order, the runtime's
feeds, the specialization symbols and ``custom_io.yaml``. A family that adds or reshapes an input
declares a row (:attr:`Family.extra_language_inputs <qeff_vision.families.base.Family>`, a stacked
vision row, a per-layer cache symbol) instead of editing generic code. Names and axes follow
QEfficient's dual-QPC VLM export so vLLM's qaic backend loads our programs.

A row's shape lists every dimension: a symbol (a dynamic axis a specialization binds), a
:class:`Fixed` model dimension (static in the graph, read from the text config), or an int.

Each decoder layer declares what it keeps between calls as one state of a registered kind
(:mod:`qeff_vision.contract.states`: a full-context cache, a sliding or chunked ring, a shared
layer that reads an earlier one and has no rows, a recurrent state, cross-attention K/V); the
state declares its own rows, which this table places in layer order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.io_rows import (  # noqa: F401 - the table's vocabulary, imported from here
    CONV_DIM,
    CONV_KERNEL,
    HEAD_DIM,
    HIDDEN_SIZE,
    KV_ROLES,
    NUM_KV_HEADS,
    STATE_KEY_DIM,
    STATE_ROLES,
    STATE_VALUE_DIM,
    STATE_VALUE_HEADS,
    VOCAB_SIZE,
    DType,
    Example,
    Fixed,
    IORow,
    Role,
    counting_positions,
    placeholder_chunk,
    slot_one,
)
from qeff_vision.contract.states import (  # noqa: F401 - layer types and kinds, imported from here
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    RECURRENT,
    SLIDING_ATTENTION,
    FullAttention,
    LayerState,
    RecurrentState,
    RingState,
    SharedKV,
    check_states,
    declared_state,
    slot_roles,
)

# Every per-slot retained row, over all registered state kinds: what continuous batching
# indexes by ``batch_index``, what starts at zero and what ``kv_cache_prefix`` renames.
SLOT_ROLES = slot_roles()

#: Display names of the first four kinds (``LayerState.kind``); code asks the state, never these.
FULL_CACHE = FullAttention.kind
RING_CACHE = RingState.kind
SHARED_CACHE = SharedKV.kind
RECURRENT_CACHE = RecurrentState.kind
CACHE_KINDS = (FULL_CACHE, RING_CACHE, SHARED_CACHE, RECURRENT_CACHE)

#: A layer's state from the symbol-and-flags spelling (:func:`~qeff_vision.contract.states.declared_state`).
LayerCache = declared_state


def layer_caches(
    declared: Sequence[str | LayerState], num_layers: int, recurrent_layers: Collection[int] = ()
) -> tuple[LayerState, ...]:
    """Each layer's :class:`~qeff_vision.contract.states.LayerState` from states or slot symbols, checked.

    Args:
        declared: One state or slot symbol per layer.
        num_layers: Decoder layers.
        recurrent_layers: Layers declared recurrent here rather than in ``declared`` (their entry
            there is unused).

    Raises:
        ValueError: Not one entry per layer, a recurrent layer out of range, or a declaration the
            other layers make wrong (a shared layer reading a later layer, itself, or a layer
            without K/V).
    """
    states = tuple(entry if isinstance(entry, LayerState) else declared_state(entry) for entry in declared)
    if len(states) != num_layers:
        raise ValueError(f"{len(states)} cache symbols for {num_layers} layers")
    recurrent = set(recurrent_layers)
    if not recurrent <= set(range(num_layers)):
        raise ValueError(f"recurrent layers {sorted(recurrent)} outside 0..{num_layers - 1}")
    states = tuple(RECURRENT if layer in recurrent else state for layer, state in enumerate(states))
    check_states(states)
    return states


@dataclass(frozen=True)
class LanguageIO:
    """Inputs and outputs of one language graph, in graph order."""

    inputs: tuple[IORow, ...]
    outputs: tuple[IORow, ...]
    #: Each decoder layer's state (a shared layer has no rows); empty for a table built without
    #: layers.
    layers: tuple[LayerState, ...] = ()

    def shared_layers(self) -> dict[int, int]:
        """Layer -> the earlier layer whose cache it reads, for every layer without rows."""
        return {layer: state.reads for layer, state in enumerate(self.layers) if state.reads is not None}

    def source_state(self, layer: int) -> LayerState:
        """The state whose rows ``layer`` reads: its own, or its producer's for a shared layer."""
        state = self.layers[layer]
        return state if state.reads is None else self.layers[state.reads]

    def layer_rows(self, layer: int) -> list[IORow]:
        """The per-layer state input rows of ``layer``, in graph order (none for a shared layer)."""
        return [row for row in self.inputs if row.layer == layer and row.role in SLOT_ROLES]

    @property
    def input_names(self) -> list[str]:
        """Graph input names, in order (the decoder wrapper's positional arguments)."""
        return [row.name for row in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Graph output names, in order (what the decoder wrapper returns)."""
        return [row.name for row in self.outputs]

    def input_axes(self) -> dict[str, dict[int, str]]:
        """Symbolic axes of every input, in graph input order."""
        return {row.name: row.axes for row in self.inputs}

    def output_axes(self) -> dict[str, dict[int, str]]:
        """Symbolic axes of every output, in graph output order."""
        return {row.name: row.axes for row in self.outputs}

    def symbols(self) -> set[str]:
        """Every symbol that appears on an input or output."""
        return {sym for row in (*self.inputs, *self.outputs) for sym in row.axes.values()}

    def rows(self, *roles: Role) -> list[IORow]:
        """Input rows of any of ``roles``, in graph order."""
        return [row for row in self.inputs if row.role in roles]

    def name(self, role: Role, output: bool = False) -> str:
        """Name of the one input (or ``output``) of ``role``.

        Raises:
            KeyError: No row, or several rows, of that role.
        """
        found = [row.name for row in (self.outputs if output else self.inputs) if row.role is role]
        if len(found) != 1:
            raise KeyError(f"{len(found)} language rows of role {role.value}, expected one")
        return found[0]

    def has(self, role: Role) -> bool:
        """Whether an input of ``role`` exists."""
        return any(row.role is role for row in self.inputs)

    def output_of(self, row: IORow) -> str:
        """The output name that returns input ``row`` (its retained pair)."""
        if row.retained is None:
            raise KeyError(f"{row.name} is not retained state")
        return row.retained

    def retained_outputs(self) -> dict[str, str]:
        """Input name -> the ``_RetainedState`` output that returns it, for every retained input."""
        return {row.name: row.retained for row in self.inputs if row.retained is not None}

    def custom_io(self, precision: Mapping[DType, str]) -> list[tuple[str, str]]:
        """(name, precision) of every retained row whose dtype class has a precision, inputs first.

        Retained state is what the compiler keeps on the device, so its precision is declared;
        logits and int64 inputs keep the graph's types.
        """
        return [
            (row.name, precision[row.dtype])
            for row in (*self.inputs, *self.outputs)
            if row.retained is not None and row.dtype in precision
        ]

    def feeds(self, by_role: Mapping[Role, Any], skip: Iterable[str] = ()) -> dict[str, Any]:
        """One call's inputs in graph order from values by role.

        Args:
            by_role: Role -> array for a role with one row; role -> {name: array} for a role with
                several (vision rows, KV caches). A role absent here is not fed (retained state a
                device keeps resident, or an input another caller adds).
            skip: Input names not to feed even if given.

        Raises:
            KeyError: A multi-row role lacks one of its rows, or a value is given for a role the
                graph does not have.
        """
        unknown = [role.value for role in by_role if not self.has(role)]
        if unknown:
            raise KeyError(f"no language input of role(s) {', '.join(unknown)}")
        skipped = set(skip)
        feeds = {}
        for row in self.inputs:
            if row.role not in by_role or row.name in skipped:
                continue
            value = by_role[row.role]
            if isinstance(value, Mapping):
                if row.name not in value:
                    raise KeyError(f"no value for language input {row.name}")
                value = value[row.name]
            feeds[row.name] = value
        return feeds


def language_io(
    num_layers: int,
    position_id_rows: int | None = None,
    cache_symbols: Sequence[str | LayerState] | None = None,
    comp_ctx_lengths: bool = False,
    stacked_rows: Mapping[str, str] | None = None,
    *,
    merges_vision_rows: bool = True,
    extra_inputs: Sequence[IORow] = (),
    continuous_batching: bool = False,
    recurrent_layers: Collection[int] = (),
) -> LanguageIO:
    """The language program's IO table.

    Args:
        num_layers: Decoder layers (each with the rows its state declares).
        position_id_rows: Leading rows of ``position_ids`` (3 for M-RoPE), None for [batch, seq].
        cache_symbols: Each layer's state (:class:`~qeff_vision.contract.states.LayerState`) or
            a bare slot symbol (``sliding_window`` for a ring layer: :data:`LayerCache`);
            ``ctx_len`` for every layer when omitted.
        comp_ctx_lengths: Add the compute-context-length input last.
        stacked_rows: Extra vision inputs after ``vision_embeds`` (Qwen3-VL ``deepstack_features``),
            name -> symbol of their leading stack axis; each is retained like ``vision_embeds``.
        merges_vision_rows: The token-merge decoder kind (``vision_embeds``, stacked rows and the
            ``image_idx`` cursor); False for a cross-attention decoder, which has none of them.
        extra_inputs: A family's own inputs, after ``position_ids`` (mllama's
            ``cross_attention_mask``); a row with ``retained`` set gets its output too.
        continuous_batching: QEfficient's continuous-batching IO: the caches hold
            ``full_batch_size`` sequence slots on dim 0 and ``batch_index`` [batch_size, 1] (role
            ``KV_SLOT``) after them names the slot each row of a call reads and writes.
        recurrent_layers: Layers of the recurrent kind (linear attention): instead of a KV pair
            each has ``conv_state.{i}`` [slots, conv_dim, conv_kernel] and ``recurrent_state.{i}``
            [slots, state_value_heads, state_key_dim, state_value_dim] (dtype class ``STATE``),
            retained and slot-indexed like the caches; its entry of ``cache_symbols`` is unused
            (the same as declaring it :data:`RECURRENT` there).

    Returns:
        The table; outputs pair each retained input with its ``_RetainedState`` output.
    """
    batch, seq = symbols.BATCH_SIZE, symbols.SEQ_LEN
    positions = (batch, seq) if position_id_rows is None else (position_id_rows, batch, seq)
    inputs = [
        IORow(symbols.INPUT_IDS, Role.TOKEN_IDS, DType.INT64, (batch, seq), example=placeholder_chunk),
        IORow(symbols.POSITION_IDS, Role.POSITIONS, DType.INT64, positions, example=counting_positions),
        *extra_inputs,
    ]
    if merges_vision_rows:
        vision = (symbols.VISION_BATCH_SIZE, symbols.VISION_SIZE, HIDDEN_SIZE)
        inputs.append(IORow(symbols.VISION_EMBEDS, Role.VISION_ROWS, DType.COMPUTE, vision))
        inputs += [
            IORow(name, Role.VISION_ROWS, DType.COMPUTE, (stack, *vision))
            for name, stack in (stacked_rows or {}).items()
        ]
        # image_idx_output is a running cursor returned under its own name, not X_RetainedState.
        inputs.append(IORow(symbols.IMAGE_IDX, Role.VISION_CURSOR, DType.INT64, (1, 1)))
    states = layer_caches(cache_symbols or [symbols.CTX_LEN] * num_layers, num_layers, recurrent_layers)
    slots = symbols.FULL_BATCH_SIZE if continuous_batching else batch
    for layer, state in enumerate(states):  # each kind declares its own rows (none: a shared layer)
        inputs += state.rows(layer, slots)
    if continuous_batching:  # QEfficient's order: after the caches, before comp_ctx_lengths
        inputs.append(IORow(symbols.BATCH_INDEX, Role.KV_SLOT, DType.INT64, (batch, 1), example=slot_one))
    if comp_ctx_lengths:
        ccl = symbols.COMP_CTX_LENGTHS
        inputs.append(IORow(ccl, Role.COMP_CTX_LENGTHS, DType.INT64, (ccl,)))
    # Vision rows are retained state (the compiler pairs input X with X_RetainedState), as is every
    # layer state row, which its kind pairs itself.
    inputs = [
        replace(row, retained=symbols.retained(row.name))
        if row.retained is None and row.role is Role.VISION_ROWS
        else row
        for row in inputs
    ]
    outputs = [IORow(symbols.LOGITS, Role.LOGITS, DType.COMPUTE, (batch, 1, VOCAB_SIZE))]
    for row in inputs:
        if row.role is Role.VISION_CURSOR:
            outputs.append(IORow(symbols.IMAGE_IDX_OUTPUT, row.role, row.dtype, ()))
        elif row.retained is not None:
            outputs.append(IORow(row.retained, row.role, row.dtype, row.shape, row.name, row.layer))
    return LanguageIO(tuple(inputs), tuple(outputs), states)
