"""Rows of the language IO table and the model dimensions they name (torch-free).

:mod:`qeff_vision.contract.language_io` builds the table from these rows; the per-layer state
kinds (:mod:`qeff_vision.contract.states`) declare their own rows with them. A row's role is a
:class:`Role`, or a role a state kind defines for its own rows (a member of that kind's ``Enum``):
code finds rows by role identity, never by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from qeff_vision import symbols

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
    # The pooling programs' outputs (:mod:`qeff_vision.contract.tasks`).
    EMBEDDING = "embedding"
    SCORE = "score"


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
