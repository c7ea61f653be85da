"""The language program's IO declared once, as rows of a table (torch-free).

Every consumer of the language IO derives from one :class:`LanguageIO`: the export's input and
output names, dynamic axes and example inputs, the decoder wrapper's argument order, the runtime's
feeds, the specialization symbols and ``custom_io.yaml``. A family that adds or reshapes an input
declares a row (:attr:`Family.extra_language_inputs <qeff_vision.families.base.Family>`, a stacked
vision row, a per-layer cache symbol) instead of editing generic code. Names and axes follow
QEfficient's dual-QPC VLM export so vLLM's qaic backend loads our programs.

A row's shape lists every dimension: a symbol (a dynamic axis a specialization binds), a
:class:`Fixed` model dimension (static in the graph, read from the text config), or an int.

Each decoder layer declares what it keeps between calls (:class:`LayerCache`): its slot-axis
symbol (the whole context or a sliding-window ring), its own KV head count and head dim (Gemma 4's
full layers are wider than its sliding ones), the earlier layer whose cache it reads, in which
case it has no rows at all (Gemma 4's ``num_kv_shared_layers``), or that it is recurrent (conv and
recurrent state rows instead of a KV pair: Qwen3.5's linear-attention layers).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from qeff_vision import symbols

# Attention types of decoder layers, as transformers' text configs spell them (``layer_types``); a
# ``sliding_attention`` layer keeps a ring of ``sliding_window`` KV slots.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Llama 4's RoPE layers: causal attention inside fixed ``attention_chunk_size`` blocks of positions
# (ref: transformers v5 masking_utils.py, ``chunked_overlay``): a key is seen iff it is in the
# query's block and not later. They keep a ring of ``min(ctx_len, attention_chunk_size)`` slots.
CHUNKED_ATTENTION = "chunked_attention"
# A linear-attention layer keeps a recurrent state (conv + recurrent rows) instead of a KV cache.
LINEAR_ATTENTION = "linear_attention"

#: ``example(shape, values, image_token_id) -> array``: a row's own trace-time example (numpy).
Example = Callable[[tuple[int, ...], Mapping[str, int], int], np.ndarray]


def placeholder_chunk(shape: tuple[int, ...], values: Mapping[str, int], image_token_id: int) -> np.ndarray:
    """Token ids: a chunk with ``vision_size - 1`` placeholders after two text tokens."""
    ids = np.ones(shape, dtype=np.int64)
    ids[..., 2 : 2 + values[symbols.VISION_SIZE] - 1] = image_token_id
    return ids


def counting_positions(shape: tuple[int, ...], values: Mapping[str, int], image_token_id: int) -> np.ndarray:
    """Positions counting up along the last axis (every M-RoPE row alike)."""
    return np.broadcast_to(np.arange(shape[-1], dtype=np.int64), shape).copy()


def slot_one(shape: tuple[int, ...], values: Mapping[str, int], image_token_id: int) -> np.ndarray:
    """KV slot 1, not 0: a trace that read slot 0 or the cache's own batch would show."""
    return np.ones(shape, dtype=np.int64)


class Role(Enum):
    """What a row carries, independent of its name (the host fills inputs by role)."""

    TOKEN_IDS = "token_ids"
    POSITIONS = "positions"
    VISION_ROWS = "vision_rows"
    VISION_CURSOR = "vision_cursor"
    CROSS_MASK = "cross_mask"
    KV_KEY = "kv_key"
    KV_VALUE = "kv_value"
    COMP_CTX_LENGTHS = "comp_ctx_lengths"
    KV_SLOT = "kv_slot"
    LOGITS = "logits"
    CONV_STATE = "conv_state"
    RECURRENT_STATE = "recurrent_state"
    # The on-device sampler's rows (:mod:`qeff_vision.contract.sampler_io`).
    ACCEPTED_TOKENS = "accepted_tokens"
    PENALTY_BUFFER = "penalty_buffer"
    SAMPLING_PARAMETER = "sampling_parameter"
    RANDOM_NUMBERS = "random_numbers"
    TOKEN_BITMASK = "token_bitmask"
    NEXT_TOKENS = "next_tokens"
    PROBABILITIES = "probabilities"


class DType(Enum):
    """Element type class: int64, the compute, KV cache or recurrent-state dtype, or a fixed type.

    The fixed types (float32, int32, bool) keep their type whatever the export dtype: the
    on-device sampler's rows (:mod:`qeff_vision.contract.sampler_io`).
    """

    INT64 = "int64"
    COMPUTE = "compute"
    KV = "kv"
    STATE = "state"
    FLOAT32 = "float32"
    INT32 = "int32"
    BOOL = "bool"


class Fixed(str):
    """A static dimension named by a model dimension (``hidden_size``), resolved from values."""

    __slots__ = ()


HIDDEN_SIZE = Fixed("hidden_size")
NUM_KV_HEADS = Fixed("num_kv_heads")
HEAD_DIM = Fixed("head_dim")
VOCAB_SIZE = Fixed("vocab_size")
KV_ROLES = (Role.KV_KEY, Role.KV_VALUE)
# Recurrent (linear-attention) layers keep a fixed-size state instead of a KV cache: the last
# ``conv_kernel`` inputs of their causal convolution and a [value_heads, key_dim, value_dim] matrix.
CONV_DIM = Fixed("conv_dim")
CONV_KERNEL = Fixed("conv_kernel")
STATE_VALUE_HEADS = Fixed("state_value_heads")
STATE_KEY_DIM = Fixed("state_key_dim")
STATE_VALUE_DIM = Fixed("state_value_dim")
STATE_ROLES = (Role.CONV_STATE, Role.RECURRENT_STATE)
# Every per-slot retained row: what continuous batching indexes by ``batch_index``.
SLOT_ROLES = (*KV_ROLES, *STATE_ROLES)


#: The kinds of layer cache (:attr:`LayerCache.kind`), named once: code compares against these.
FULL_CACHE = "full"
RING_CACHE = "ring"
SHARED_CACHE = "shared"
RECURRENT_CACHE = "recurrent"
CACHE_KINDS = (FULL_CACHE, RING_CACHE, SHARED_CACHE, RECURRENT_CACHE)
#: The slot symbols that make a layer's cache a ring (its slot = position mod the ring's length).
RING_SYMBOLS = (symbols.SLIDING_WINDOW, symbols.CHUNK_CTX_LEN)


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer keeps between calls, declared once; its rows follow from it.

    A layer is of one of four kinds (:attr:`kind`): a full-context KV cache (``length`` is
    ``ctx_len`` or a family's own symbol), a ring (``length`` is ``sliding_window``, or
    ``chunk_ctx_len`` for a chunked-attention layer), shared (``reads`` names the earlier layer
    whose cache it reads: no rows), or recurrent (``recurrent``: conv and recurrent state rows
    instead of a KV pair).

    Attributes:
        length: Symbol of the slot axis: ``ctx_len``, ``sliding_window`` / ``chunk_ctx_len`` for a
            ring, or a family's own symbol (cross-attention states). Unused by a recurrent or
            shared layer.
        kv_heads: KV heads of this layer's cache: a :class:`Fixed` model dimension or an int.
        head_dim: Head dim of this layer's cache: a :class:`Fixed` model dimension or an int.
        reads: For a layer that computes no K/V of its own, the earlier layer whose cache it reads;
            such a layer has no rows. None for a layer with its own cache.
        recurrent: A linear-attention layer: ``conv_state.{i}`` and ``recurrent_state.{i}`` rows,
            no KV pair.
    """

    length: str = symbols.CTX_LEN
    kv_heads: str | int = NUM_KV_HEADS
    head_dim: str | int = HEAD_DIM
    reads: int | None = None
    recurrent: bool = False

    def __post_init__(self):
        if self.recurrent and self.reads is not None:
            raise ValueError("a recurrent layer keeps its own state; it cannot read another layer's cache")

    @property
    def shared(self) -> bool:
        """The layer reads another layer's cache and has no rows of its own."""
        return self.reads is not None

    @property
    def kind(self) -> str:
        """The layer's kind: one of :data:`CACHE_KINDS`.

        :data:`RECURRENT_CACHE`, :data:`SHARED_CACHE`, :data:`RING_CACHE` (a slot axis of
        :data:`RING_SYMBOLS`) or :data:`FULL_CACHE`.
        """
        if self.recurrent:
            return RECURRENT_CACHE
        if self.shared:
            return SHARED_CACHE
        return RING_CACHE if self.length in RING_SYMBOLS else FULL_CACHE

    @property
    def has_kv(self) -> bool:
        """The layer has past_key/past_value rows of its own (neither shared nor recurrent)."""
        return not (self.shared or self.recurrent)


#: A recurrent (linear-attention) layer's declaration.
RECURRENT = LayerCache(recurrent=True)


def layer_caches(
    declared: Sequence[str | LayerCache], num_layers: int, recurrent_layers: Collection[int] = ()
) -> tuple[LayerCache, ...]:
    """Each layer's :class:`LayerCache` from symbols or declarations, checked.

    Args:
        declared: One slot symbol or :class:`LayerCache` per layer.
        num_layers: Decoder layers.
        recurrent_layers: Layers declared recurrent here rather than in ``declared`` (their entry
            there is unused).

    Raises:
        ValueError: Not one entry per layer, a recurrent layer out of range, or a shared layer
            reads a later layer, itself, or a layer without KV rows (shared or recurrent).
    """
    caches = tuple(entry if isinstance(entry, LayerCache) else LayerCache(entry) for entry in declared)
    if len(caches) != num_layers:
        raise ValueError(f"{len(caches)} cache symbols for {num_layers} layers")
    recurrent = set(recurrent_layers)
    if not recurrent <= set(range(num_layers)):
        raise ValueError(f"recurrent layers {sorted(recurrent)} outside 0..{num_layers - 1}")
    caches = tuple(RECURRENT if layer in recurrent else cache for layer, cache in enumerate(caches))
    for layer, cache in enumerate(caches):
        if cache.shared and not (0 <= cache.reads < layer and caches[cache.reads].has_kv):
            raise ValueError(f"layer {layer} reads layer {cache.reads}'s cache: not an earlier one with rows")
    return caches


@dataclass(frozen=True)
class IORow:
    """One graph input (or output) of the language program.

    Attributes:
        name: ONNX name.
        role: What it carries.
        dtype: Element type class.
        shape: Every dimension: a symbol, a :class:`Fixed` model dimension or an int. Outputs
            only need their symbolic dimensions to be right (the rest is read from the graph).
        retained: On an input, the ``_RetainedState`` output paired with it; on that output, the
            input it returns. None for a row that is not retained state.
        layer: Decoder layer of a per-layer row, else None.
        example: The row's own example for tracing (:data:`Example`); None: random values for a
            compute-dtype row, zeros otherwise.
    """

    name: str
    role: Role
    dtype: DType
    shape: tuple[str | int, ...] = ()
    retained: str | None = None
    layer: int | None = None
    example: Example | None = field(default=None, compare=False, repr=False)

    @property
    def axes(self) -> dict[int, str]:
        """Symbolic axes by dimension index (the dynamic axes of the export)."""
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str) and not isinstance(d, Fixed)}

    def concrete_shape(self, values: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with every symbol and model dimension bound from ``values``.

        Raises:
            KeyError: ``values`` lacks a symbol or model dimension of this row.
        """
        try:
            return tuple(d if isinstance(d, int) else int(values[d]) for d in self.shape)
        except KeyError as exc:
            raise KeyError(f"{self.name}: no value for dimension {exc.args[0]!r}") from None


@dataclass(frozen=True)
class LanguageIO:
    """Inputs and outputs of one language graph, in graph order."""

    inputs: tuple[IORow, ...]
    outputs: tuple[IORow, ...]
    #: Each decoder layer's cache declaration (a shared layer has no rows); empty for a table
    #: built without layers.
    layers: tuple[LayerCache, ...] = ()

    def shared_layers(self) -> dict[int, int]:
        """Layer -> the earlier layer whose cache it reads, for every layer without rows."""
        return {layer: cache.reads for layer, cache in enumerate(self.layers) if cache.reads is not None}

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
    cache_symbols: Sequence[str | LayerCache] | None = None,
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
        num_layers: Decoder layers (one key and one value cache row each, unless shared or
            recurrent).
        position_id_rows: Leading rows of ``position_ids`` (3 for M-RoPE), None for [batch, seq].
        cache_symbols: Each layer's slot-axis symbol (``sliding_window`` for a ring layer, a
            family's own symbol for cross-attention states) or its whole :class:`LayerCache`
            (own head count and head dim, the layer whose cache it reads: then no rows, or
            :data:`RECURRENT`); ``ctx_len`` for every layer when omitted.
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
    caches = layer_caches(cache_symbols or [symbols.CTX_LEN] * num_layers, num_layers, recurrent_layers)
    cache_batch = symbols.FULL_BATCH_SIZE if continuous_batching else batch
    for layer, cache in enumerate(caches):
        if cache.recurrent:
            conv = (cache_batch, CONV_DIM, CONV_KERNEL)
            state = (cache_batch, STATE_VALUE_HEADS, STATE_KEY_DIM, STATE_VALUE_DIM)
            inputs.append(IORow(symbols.conv_state(layer), Role.CONV_STATE, DType.STATE, conv, layer=layer))
            inputs.append(
                IORow(symbols.recurrent_state(layer), Role.RECURRENT_STATE, DType.STATE, state, layer=layer)
            )
            continue
        if cache.shared:  # reads an earlier layer's rows: none of its own
            continue
        shape = (cache_batch, cache.kv_heads, cache.length, cache.head_dim)
        inputs.append(IORow(symbols.past_key(layer), Role.KV_KEY, DType.KV, shape, layer=layer))
        inputs.append(IORow(symbols.past_value(layer), Role.KV_VALUE, DType.KV, shape, layer=layer))
    if continuous_batching:  # QEfficient's order: after the caches, before comp_ctx_lengths
        inputs.append(IORow(symbols.BATCH_INDEX, Role.KV_SLOT, DType.INT64, (batch, 1), example=slot_one))
    if comp_ctx_lengths:
        ccl = symbols.COMP_CTX_LENGTHS
        inputs.append(IORow(ccl, Role.COMP_CTX_LENGTHS, DType.INT64, (ccl,)))
    # Vision rows and caches are retained state: the compiler pairs input X with X_RetainedState.
    retained_roles = (Role.VISION_ROWS, *SLOT_ROLES)
    inputs = [
        replace(row, retained=symbols.retained(row.name))
        if row.retained is None and row.role in retained_roles
        else row
        for row in inputs
    ]
    outputs = [IORow(symbols.LOGITS, Role.LOGITS, DType.COMPUTE, (batch, 1, VOCAB_SIZE))]
    for row in inputs:
        if row.role is Role.VISION_CURSOR:
            outputs.append(IORow(symbols.IMAGE_IDX_OUTPUT, row.role, row.dtype, ()))
        elif row.retained is not None:
            outputs.append(IORow(row.retained, row.role, row.dtype, row.shape, row.name, row.layer))
    return LanguageIO(tuple(inputs), tuple(outputs), caches)
