"""Deferred calls of a sliced graph: a prompt's prefill chunks recorded in one pass over the weights.

A calibration prompt runs through the ordinary generation loop, one language call per prefill
chunk, each taking the KV cache the previous one left. Run one by one, every call is a pass over
all the graph's slices, each slice's session built and its weights read again (a 1080p image's
prompt is 22 chunks of 128 tokens: 22 reads of every weight). Here a call returns
:class:`Pending` outputs instead of arrays, and the calls pile up on a :class:`Tape` until the host
needs a value (the last chunk's logits, to choose a token): then every pending call runs in one
slice-major pass (:meth:`~qeff_vision.numerics.recording.SlicedRecorder.run_many`), each cache
handed from one chunk to the next inside the slice that updates it. The values are those of the
calls run one by one; only the order of the work changes.

A pending output knows its shape when it is a retained state (the shape of the input it
replaces), which is all the loop asks of a cache it passes on. Anything else (``np.asarray``,
``int``, ``reshape``) runs the pending calls first. Each computed output is kept only while a
:class:`Pending` for it is alive or a pending call reads it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.numerics.recording import Ref, SlicedRecorder

# Input arrays up to this size are copied when a call is queued: a host may refill its small
# buffers (token ids, positions) in place for the next call before the queued one runs.
COPIED_BYTES = 1 << 20


class TapeFrozen(RuntimeError):
    """A frozen tape was asked for a value: the caller only collects calls (nothing runs)."""


class Tape:
    """Calls of one sliced graph waiting to run, and the outputs computed so far that are still used.

    Args:
        recorder: Runs the calls (and records their peaks; its ``on_slice`` reports progress).
    """

    def __init__(self, recorder: SlicedRecorder):
        self.recorder = recorder
        self.calls = 0  # calls added so far (a call's number is its index in that order)
        self.evaluations = 0  # times the pending calls ran (each one or more passes)
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._results: dict[tuple[int, str], np.ndarray] = {}
        self._live: dict[tuple[int, str], int] = {}  # (call, output) -> Pending objects alive
        #: While True, reading a value not computed yet raises :class:`TapeFrozen` instead of
        #: running the pending calls (calls are being collected for one later pass).
        self.frozen = False

    def add(self, feeds: Mapping[str, Any], output_names: list[str]) -> dict[str, Pending]:
        """Queue one call; its outputs as :class:`Pending` values."""
        number = self.calls
        self.calls += 1
        queued = {
            name: value.copy() if isinstance(value, np.ndarray) and value.nbytes <= COPIED_BYTES else value
            for name, value in feeds.items()
        }
        self._pending.append((number, queued))
        outputs = {}
        for name in output_names:
            retained = name.endswith(symbols.RETAINED_SUFFIX)
            source = feeds.get(name[: -len(symbols.RETAINED_SUFFIX)]) if retained else None
            shape = tuple(source.shape) if source is not None else None
            dtype = source.dtype if source is not None else None
            outputs[name] = Pending(self, number, name, shape, dtype)
        return outputs

    def value(self, call: int, name: str) -> np.ndarray:
        """An output's array (running the pending calls if it is not computed yet)."""
        if (call, name) not in self._results:
            if self.frozen:
                raise TapeFrozen(f"call {call}'s {name} is not computed (the tape is collecting calls)")
            self.run()
        return self._results[(call, name)]

    def run(self) -> None:
        """Run every pending call in one pass over the slices (the rest after it, if the graph forces it)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self.evaluations += 1
        local = {number: index for index, (number, _) in enumerate(pending)}
        feeds = [
            {name: self._as_feed(value, local) for name, value in call_feeds.items()}
            for _, call_feeds in pending
        ]
        numbers = [number for number, _ in pending]
        # The queued feeds' Pending objects go now: an output only the next chunk reads is not kept.
        del pending
        keep = [{name for (call, name) in self._live if call == number} for number in numbers]
        results = self.recorder.run_many(feeds, None, keep)
        for number, outputs in zip(numbers, results):
            for name, array in outputs.items():
                if (number, name) in self._live:
                    self._results[(number, name)] = array

    def discard(self) -> None:
        """Drop the pending calls (they never run; their outputs cannot be read)."""
        self._pending = []

    def _as_feed(self, value: Any, local: Mapping[int, int]) -> Any:
        """A queued feed for the pass: a reference to a call of the pass, or an array."""
        if isinstance(value, Lazy) or (isinstance(value, Pending) and value.tape is not self):
            return value.array()  # computed from another tape's output (vision rows)
        if not isinstance(value, Pending):
            return value
        if value.call in local:
            return Ref(local[value.call], value.name, value._shape, value._dtype)
        return value.array()

    def _born(self, key: tuple[int, str]) -> None:
        self._live[key] = self._live.get(key, 0) + 1

    def _died(self, key: tuple[int, str]) -> None:
        count = self._live.get(key, 0) - 1
        if count > 0:
            self._live[key] = count
            return
        self._live.pop(key, None)
        self._results.pop(key, None)


class Pending:
    """One output of a queued call: its array once the pending calls ran.

    ``shape`` and ``dtype`` are known without running for a retained state; the rest (and any
    use as an array: ``np.asarray``, indexing, ``reshape``, ``int``) runs the pending calls.
    """

    __array_priority__ = 1000

    def __init__(self, tape: Tape, call: int, name: str, shape=None, dtype=None):
        self.tape, self.call, self.name = tape, call, name
        self._shape, self._dtype = shape, dtype
        key = (call, name)
        tape._born(key)
        weakref.finalize(self, tape._died, key)

    def array(self) -> np.ndarray:
        """The computed output."""
        return self.tape.value(self.call, self.name)

    @property
    def shape(self) -> tuple[int, ...]:
        """The output's shape (known for a retained state; otherwise computed)."""
        return self._shape if self._shape is not None else self.array().shape

    @property
    def dtype(self):
        """The output's element type."""
        return self._dtype if self._dtype is not None else self.array().dtype

    @property
    def ndim(self) -> int:
        """Its rank."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def __array__(self, dtype=None, copy=None):
        array = self.array()
        return array if dtype is None else array.astype(dtype)

    def __getitem__(self, key):
        return Lazy(lambda: self.array()[key])

    def reshape(self, *shape):
        """The computed array, reshaped."""
        return self.array().reshape(*shape)

    def copy(self) -> np.ndarray:
        """A copy of the computed array."""
        return self.array().copy()


class Lazy:
    """A value computed from a :class:`Pending` output when first used as an array."""

    __array_priority__ = 1000

    def __init__(self, compute: Callable[[], np.ndarray]):
        self._compute = compute

    def array(self) -> np.ndarray:
        """The value."""
        return np.asarray(self._compute())

    def __array__(self, dtype=None, copy=None):
        array = self.array()
        return array if dtype is None else array.astype(dtype)

    def __getitem__(self, key):
        return Lazy(lambda: self.array()[key])

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape (computed)."""
        return self.array().shape

    @property
    def ndim(self) -> int:
        """Its rank (computed)."""
        return self.array().ndim

    def copy(self) -> np.ndarray:
        """A copy of the value."""
        return self.array().copy()

    def __int__(self) -> int:
        return int(self.array())
