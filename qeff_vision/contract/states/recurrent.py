"""The recurrent state kind: a linear-attention layer's conv and recurrent states (Qwen3.5).

Rules (docs/design.md, "Recurrent layers"); the export-time object is
:class:`~qeff_vision.export.recurrent_state.RecurrentStates`, one per call for every recurrent
layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qeff_vision import symbols
from qeff_vision.contract.io_rows import (
    CONV_DIM,
    CONV_KERNEL,
    STATE_KEY_DIM,
    STATE_ROLES,
    STATE_VALUE_DIM,
    STATE_VALUE_HEADS,
    DType,
    IORow,
    Role,
)
from qeff_vision.contract.states.base import KeptPrefix, LayerState, retained_row

# A linear-attention layer keeps a recurrent state (conv + recurrent rows) instead of a KV cache.
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class RecurrentState(LayerState):
    """A linear-attention layer's ``conv_state.{i}`` and ``recurrent_state.{i}``, no KV pair.

    ``conv_state.{i}`` [slots, conv_dim, conv_kernel] and ``recurrent_state.{i}`` [slots,
    state_value_heads, state_key_dim, state_value_dim], dtype class STATE.

    A padding token or an idle row leaves both states exactly as they were; a row at text
    position 0 reads zeros. Its size does not grow with the sequence, and it cannot be rolled
    back: a kept prefix resumes where it stopped (or from the copy kept at the prompt's end).
    """

    kind: ClassVar[str] = "recurrent"
    stems: ClassVar[tuple[str, ...]] = ("conv_state", "recurrent_state")
    roles: ClassVar[tuple] = STATE_ROLES
    layer_type: ClassVar[str | None] = LINEAR_ATTENTION
    kept_prefix: ClassVar[KeptPrefix] = KeptPrefix.AT_END

    def rows(self, layer: int, slots: str) -> tuple[IORow, ...]:
        """The conv state, then the recurrent state."""
        conv = (slots, CONV_DIM, CONV_KERNEL)
        state = (slots, STATE_VALUE_HEADS, STATE_KEY_DIM, STATE_VALUE_DIM)
        return (
            retained_row(symbols.conv_state(layer), Role.CONV_STATE, DType.STATE, conv, layer),
            retained_row(symbols.recurrent_state(layer), Role.RECURRENT_STATE, DType.STATE, state, layer),
        )


#: A recurrent (linear-attention) layer's declaration.
RECURRENT = RecurrentState()
