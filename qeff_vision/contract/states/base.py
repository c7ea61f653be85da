"""What every kind of per-layer state answers (torch-free): the base class of the state kinds.

A decoder layer keeps one state between calls of the language program, of one kind (a class
here, registered in :mod:`qeff_vision.contract.states`): a full-context KV cache, a sliding or
chunked ring, a reference to an earlier layer's cache, a recurrent state, cross-attention K/V.
The kind owns every rule about it; generic code asks the instance (its rows, what a kept prefix
may restore, its bytes per position) and never compares a kind by name. The kind's
export-time cache object (torch) is registered beside it in :mod:`qeff_vision.export.state_caches`.

ref: vLLM ``v1/kv_cache_interface.py`` (one ``KVCacheSpec`` subclass per kind, its page size and
rules its own), for the shape of the idea.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from math import prod
from typing import ClassVar

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.io_rows import DType, IORow


class KeptPrefix(Enum):
    """What a kept prefix may restore of a state (:mod:`qeff_vision.runtime.retained_prefix`).

    ``ANY``: slot p holds position p, so any prefix is kept as is (later slots are overwritten
    before they are read). ``AT_END``: the state cannot be rolled back (a ring, a recurrent
    state): only where it stopped, or a copy taken at the last prompt's end. ``IMAGES``: the state
    belongs to the request's images, kept with them (cross-attention K/V).
    """

    ANY = "any"
    AT_END = "at_end"
    IMAGES = "images"


@dataclass(frozen=True)
class LayerState:
    """One decoder layer's state between calls; subclasses are the kinds.

    Class attributes:
        kind: The kind's display name (reports, ``repr``); code never compares it.
        stems: Stems of the per-layer IO names its rows carry (``past_key`` -> ``past_key.{i}``):
            what ``kv_cache_prefix`` renames and the untouched-slot check reads.
        roles: Roles of its rows (an empty tuple for a kind without rows).
        layer_type: The text config's ``layer_types`` entry it is the default state of, or None.
        kept_prefix: What a kept prefix may restore (:class:`KeptPrefix`).
        ring: Its slot axis is a ring (slot = position mod its length): what ``retain_full_kv``
            makes full length.
        slot_axis: Axis of its rows that holds positions (None without one).
    """

    kind: ClassVar[str] = ""
    stems: ClassVar[tuple[str, ...]] = ()
    roles: ClassVar[tuple[Enum, ...]] = ()
    layer_type: ClassVar[str | None] = None
    kept_prefix: ClassVar[KeptPrefix] = KeptPrefix.ANY
    ring: ClassVar[bool] = False
    slot_axis: ClassVar[int | None] = None

    # ---- declaration ----

    @classmethod
    def for_layer_type(cls, text) -> LayerState:
        """The default state of a layer of :attr:`layer_type` (``text``: the family's text geometry)."""
        return cls()

    @classmethod
    def for_slot_symbol(cls, symbol: str, kv_heads, head_dim) -> LayerState | None:
        """The state a bare slot symbol declares, if it is this kind's own symbol (None by default)."""
        return None

    @property
    def reads(self) -> int | None:
        """The earlier layer whose state this layer reads (no rows of its own), else None."""
        return None

    @property
    def holds_kv(self) -> bool:
        """It holds attention K/V another layer may read (a shared layer's producer)."""
        return False

    def problems(self, layer: int, states: Sequence[LayerState]) -> list[str]:
        """What is wrong with this declaration among every layer's ``states`` (none by default)."""
        return []

    def full_length(self) -> LayerState:
        """The state ``retain_full_kv`` keeps instead: itself unless it is a ring."""
        return self

    # ---- IO rows ----

    def rows(self, layer: int, slots: str) -> tuple[IORow, ...]:
        """Its input rows for ``layer``, each paired with its ``_RetainedState`` output.

        Args:
            layer: Decoder layer.
            slots: Symbol of dim 0, the sequence slots: ``batch_size``, or ``full_batch_size``
                under continuous batching (the CB slot rule: row r of a call reads and writes
                slot ``batch_index[r]``; every other slot comes back unchanged).
        """
        return ()

    def symbol_values(self, ctx_len: int) -> dict[str, int]:
        """Values of the slot symbols this state binds itself for ``ctx_len`` (none by default)."""
        return {}

    # ---- host ----

    def initial(self, row: IORow, values: Mapping[str, int]) -> np.ndarray:
        """A fresh sequence's value of ``row`` (zeros: the graphs also reset on a text position 0)."""
        return np.zeros(row.concrete_shape(values), np.float32)

    @classmethod
    def idle_slots_unchanged(cls, before: np.ndarray, after: np.ndarray, named: np.ndarray) -> bool:
        """Whether a call left every slot outside ``named`` (its ``batch_index``) as it was.

        What an idle slot must leave unchanged: all of it, for every kind with rows.
        """
        others = np.setdiff1d(np.arange(before.shape[0]), np.asarray(named).reshape(-1))
        return bool(np.array_equal(after[others], before[others]))

    # ---- memory ----

    def bytes_per_position(self, values: Mapping[str, int], element_bytes: Mapping[DType, int]) -> int:
        """Bytes one more sequence position adds to this layer's state (0: fixed size or none)."""
        return 0

    def state_bytes(
        self, layer: int, values: Mapping[str, int], element_bytes: Mapping[DType, int], slots: str
    ) -> int:
        """Bytes of its rows at ``values`` (every symbol bound), each at its dtype class's size."""
        return sum(
            prod(row.concrete_shape(values)) * element_bytes[row.dtype] for row in self.rows(layer, slots)
        )


def retained_row(name: str, role: Enum, dtype: DType, shape: tuple, layer: int) -> IORow:
    """A per-layer state row paired with its ``_RetainedState`` output."""
    return IORow(name, role, dtype, shape, symbols.retained(name), layer)
