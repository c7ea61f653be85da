"""The language program's IO declared once, as rows of a table (torch-free).

Every consumer of the language IO (export dynamic axes, the decoder wrapper's signature, runtime
feeds, specialization symbols, custom IO) is meant to derive from :func:`language_io`, so a
family that adds or reshapes an input declares a row instead of editing generic code. Names and
axes follow QEfficient's dual-QPC VLM export so vLLM's qaic backend loads our programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from qeff_vision import symbols


class Role(Enum):
    """What a row carries, independent of its name."""

    TOKEN_IDS = "token_ids"
    POSITIONS = "positions"
    VISION_ROWS = "vision_rows"
    VISION_CURSOR = "vision_cursor"
    KV_KEY = "kv_key"
    KV_VALUE = "kv_value"
    COMP_CTX_LENGTHS = "comp_ctx_lengths"
    LOGITS = "logits"


class DType(Enum):
    """Element type class: fixed int64, the model's compute dtype, or the KV cache dtype."""

    INT64 = "int64"
    COMPUTE = "compute"
    KV = "kv"


@dataclass(frozen=True)
class IORow:
    """One graph input (or output) of the language program.

    Attributes:
        name: ONNX name.
        role: What it carries.
        dtype: Element type class.
        axes: Symbolic axes by dimension index (empty for a fixed-shape tensor).
        retained: Name of the ``_RetainedState`` output paired with this input, if any.
        layer: Decoder layer of a per-layer row, else None.
    """

    name: str
    role: Role
    dtype: DType
    axes: dict[int, str] = field(default_factory=dict)
    retained: str | None = None
    layer: int | None = None


@dataclass(frozen=True)
class LanguageIO:
    """Inputs and outputs of one language graph, in graph order."""

    inputs: tuple[IORow, ...]
    outputs: tuple[IORow, ...]

    def input_axes(self) -> dict[str, dict[int, str]]:
        """Symbolic axes of every input, in graph input order."""
        return {row.name: dict(row.axes) for row in self.inputs}

    def output_axes(self) -> dict[str, dict[int, str]]:
        """Symbolic axes of every output, in graph output order."""
        return {row.name: dict(row.axes) for row in self.outputs}

    def symbols(self) -> set[str]:
        """Every symbol that appears on an input or output."""
        return {sym for row in (*self.inputs, *self.outputs) for sym in row.axes.values()}


def language_io(
    num_layers: int,
    position_id_rows: int | None = None,
    cache_symbols: list[str] | None = None,
    comp_ctx_lengths: bool = False,
    stacked_rows: Mapping[str, str] | None = None,
) -> LanguageIO:
    """The language program's IO table.

    Args:
        num_layers: Decoder layers (one key and one value cache row each).
        position_id_rows: Leading rows of ``position_ids`` (3 for M-RoPE), None for [batch, seq].
        cache_symbols: Each layer's slot-axis symbol (``sliding_window`` for a ring layer);
            ``ctx_len`` for every layer when omitted.
        comp_ctx_lengths: Add the compute-context-length input last.
        stacked_rows: Extra vision inputs after ``vision_embeds`` (Qwen3-VL ``deepstack_features``),
            name -> symbol of their leading stack axis; each is retained like ``vision_embeds``.

    Returns:
        The table; outputs pair each retained input with its ``_RetainedState`` output.
    """
    position_axes = (
        {0: symbols.BATCH_SIZE, 1: symbols.SEQ_LEN}
        if position_id_rows is None
        else {1: symbols.BATCH_SIZE, 2: symbols.SEQ_LEN}
    )
    vision_axes = {0: symbols.VISION_BATCH_SIZE, 1: symbols.VISION_SIZE}
    inputs = [
        IORow(symbols.INPUT_IDS, Role.TOKEN_IDS, DType.INT64, {0: symbols.BATCH_SIZE, 1: symbols.SEQ_LEN}),
        IORow(symbols.POSITION_IDS, Role.POSITIONS, DType.INT64, position_axes),
        IORow(
            symbols.VISION_EMBEDS,
            Role.VISION_ROWS,
            DType.COMPUTE,
            vision_axes,
            retained=symbols.retained(symbols.VISION_EMBEDS),
        ),
        *(
            IORow(
                name,
                Role.VISION_ROWS,
                DType.COMPUTE,
                {0: stack, 1: symbols.VISION_BATCH_SIZE, 2: symbols.VISION_SIZE},
                retained=symbols.retained(name),
            )
            for name, stack in (stacked_rows or {}).items()
        ),
        IORow(symbols.IMAGE_IDX, Role.VISION_CURSOR, DType.INT64, retained=symbols.IMAGE_IDX_OUTPUT),
    ]
    slots = cache_symbols or [symbols.CTX_LEN] * num_layers
    if len(slots) != num_layers:
        raise ValueError(f"{len(slots)} cache symbols for {num_layers} layers")
    for layer, slot in enumerate(slots):
        kv_axes = {0: symbols.BATCH_SIZE, 2: slot}
        for name, role in (
            (symbols.past_key(layer), Role.KV_KEY),
            (symbols.past_value(layer), Role.KV_VALUE),
        ):
            inputs.append(IORow(name, role, DType.KV, kv_axes, retained=symbols.retained(name), layer=layer))
    if comp_ctx_lengths:
        inputs.append(
            IORow(symbols.COMP_CTX_LENGTHS, Role.COMP_CTX_LENGTHS, DType.INT64, {0: symbols.COMP_CTX_LENGTHS})
        )
    by_retained = {row.retained: row for row in inputs if row.retained}
    outputs = [IORow(symbols.LOGITS, Role.LOGITS, DType.COMPUTE, {0: symbols.BATCH_SIZE})]
    for name, row in by_retained.items():
        # image_idx_output is a running cursor, not a resident copy: it has no axes.
        outputs.append(IORow(name, row.role, row.dtype, dict(row.axes), layer=row.layer))
    return LanguageIO(tuple(inputs), tuple(outputs))
