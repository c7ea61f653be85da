"""The backend axis of the runner: where a program's retained state lives, as two objects.

A compiled program pairs each ``X_RetainedState`` output with its input ``X`` (the KV caches, a
single program's row buffer, the sampler's penalty buffers). On onnxruntime the host keeps those
tensors and feeds them back on every call (:data:`HOST_SESSION`); a device keeps them resident and
the host never sends them again after the first call (:data:`DEVICE_RUNTIME`). Everything the
runner does differently for the two is a method here, so the runner, the slots, the deployment
modes and the artifact loader ask the backend object and never test which backend they have:

========================  =====================================  ==============================
question                  onnxruntime session                    device runtime (``qaicrt``)
========================  =====================================  ==============================
host-held state           made (zero caches, decode rows)        none
a call                    ``past`` sent, may be updated in place ``past`` sent once, then emptied
after a call              the returned state replaces ``past``   ``past`` emptied (resident)
state a call supplies     written into the host's ``past``       sent as an input (one slot only)
several host slots        yes                                    one resident cache: refused
a kept turn still held    always                                 only if nothing ran since
KV moved between programs the host copies it                     the serving stack's: refused
default precision         ``fp32``                               ``device`` (only)
========================  =====================================  ==============================

A program says which it is by its ``retains_state`` attribute (:class:`~qeff_vision.runtime.session.
CompiledProgram`); :func:`backend_of` is the one place that reads it. An artifact's ``backend``
record names its object in :data:`BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision.compile_record import ONNXRUNTIME, QAIC
from qeff_vision.errors import UserError
from qeff_vision.runtime.session import OnnxProgram, QaicProgram, require_qaic_runtime

State = dict[str, np.ndarray]


class HostSession:
    """onnxruntime: the host holds every retained tensor and feeds it back (see the module docstring)."""

    name = ONNXRUNTIME
    #: The precision a run takes when none is asked for (the exported graph as it is).
    default_precision = "fp32"

    def check_available(self, where: Path) -> None:
        """Onnxruntime is always here."""

    def host_state(self, make: Callable[[], State]) -> State:
        """State the host sends: ``make()`` (zero caches, a decode call's vision rows)."""
        return make()

    def keep_returned(
        self, past: State, outputs: Mapping[str, np.ndarray], retained: Mapping[str, str]
    ) -> None:
        """``past``'s entries replaced by the call's returned state (``retained``: input -> output)."""
        for name in list(past):
            past[name] = outputs[retained[name]]

    def call(
        self,
        program: Any,
        feeds: Mapping[str, np.ndarray],
        past: State,
        retained: Mapping[str, str],
        in_place: bool,
    ) -> dict[str, np.ndarray]:
        """One call of ``program`` over the host's ``past``, which then holds the returned state.

        ``in_place``: ``past``'s own arrays may take the new state (a cache nobody else holds,
        :meth:`~qeff_vision.runtime.session.CompiledProgram.run_retained`); otherwise its entries
        are replaced by new arrays.
        """
        if in_place and past:
            return program.run_retained(feeds, past, retained)
        outputs = program.run({**feeds, **past})
        self.keep_returned(past, outputs, retained)
        return outputs

    def supply_state(
        self,
        feeds: State,
        past: State,
        name: str,
        value: np.ndarray,
        place: Callable[[np.ndarray], np.ndarray],
        slots: int,
        what: str,
    ) -> None:
        """State a call supplies beside the cache (``value`` of ``name``) goes into the host's copy.

        ``place(held)`` returns the new array from the held one (the decoder kind writes
        ``value`` into the request's slot); ``feeds``, ``slots`` and ``what`` are the device's
        concern.
        """
        past[name] = place(past[name])

    def check_slots(self, full_batch_size: int) -> None:
        """Any number of host caches, one per slot."""

    def holds_turn(self, calls: int, held_calls: int) -> bool:
        """True: the host's copy of a kept turn's caches is what the program holds."""
        return True

    def check_state_transfer(self, message: str) -> None:
        """Nothing to refuse: the host copies state between programs (a prefill/decode hand-off)."""

    def check_precision(self, precision: str, where: Path) -> None:
        """Every precision runs here (``device`` emulates the compiler's numerics)."""

    def emulates_device(self, precision: str | None) -> bool:
        """Whether a run at ``precision`` emulates the device's numerics on the host."""
        return precision is not None and precision != "fp32"

    def at_device_precision(self, precision: str | None) -> bool:
        """Whether a run at ``precision`` computes with the device's numerics (emulated here)."""
        return self.emulates_device(precision)

    def open_program(
        self,
        path: Path,
        specializations: Any,
        describe: Callable[[], Mapping[str, Any]],
        fp32_values: Any = None,
        mx: Any = None,
    ) -> Any:
        """An :class:`~qeff_vision.runtime.session.OnnxProgram` over ``path`` (``describe`` unused)."""
        return OnnxProgram(path, specializations, fp32_values=fp32_values, mx=mx)


class DeviceRuntime:
    """Cloud AI 100 through ``qaicrt``: retained state stays resident on the device."""

    name = QAIC
    default_precision = "device"

    def check_available(self, where: Path) -> None:
        """The SDK's runtime must be importable.

        Raises:
            UserError: It is not (the message names ``where``).
        """
        require_qaic_runtime(where)

    def host_state(self, make: Callable[[], State]) -> State:
        """None: the device holds it (zeroed caches, rows, buffers are never sent)."""
        return {}

    def keep_returned(
        self, past: State, outputs: Mapping[str, np.ndarray], retained: Mapping[str, str]
    ) -> None:
        """``past`` emptied: what it sent is resident on the device from now on (sent once)."""
        past.clear()

    def call(
        self,
        program: Any,
        feeds: Mapping[str, np.ndarray],
        past: State,
        retained: Mapping[str, str],
        in_place: bool,
    ) -> dict[str, np.ndarray]:
        """One call of ``program``; what ``past`` holds is sent once and is resident from then on."""
        outputs = program.run({**feeds, **past})
        self.keep_returned(past, outputs, retained)
        return outputs

    def supply_state(
        self,
        feeds: State,
        past: State,
        name: str,
        value: np.ndarray,
        place: Callable[[np.ndarray], np.ndarray],
        slots: int,
        what: str,
    ) -> None:
        """State a call supplies (``value`` of ``name``) is sent as an input (the buffer is one slot).

        Raises:
            UserError: The program has several slots (``slots``): writing one slot of a resident
                buffer is not supported; ``what`` names the state.
        """
        if slots > 1:
            raise UserError(
                f"a device-resident continuous-batching program cannot take one request's {what} "
                "into its slot yet; serve it on onnxruntime"
            )
        feeds[name] = value

    def check_slots(self, full_batch_size: int) -> None:
        """One resident cache: a program without ``batch_index`` serves one request at a time.

        Raises:
            UserError: ``full_batch_size`` > 1.
        """
        if full_batch_size > 1:
            raise UserError(
                "this language program was compiled without full_batch_size and keeps one KV cache "
                "on the device: it serves one request at a time (compile with full_batch_size)"
            )

    def holds_turn(self, calls: int, held_calls: int) -> bool:
        """The resident caches are the held ones only if no call ran since (``calls`` then and now)."""
        return calls == held_calls

    def check_state_transfer(self, message: str) -> None:
        """Refused: moving resident state between device programs is the serving stack's KV transfer.

        Raises:
            UserError: Always, with ``message``.
        """
        raise UserError(message)

    def check_precision(self, precision: str, where: Path) -> None:
        """The device computes: ``fp32`` cannot be asked of it.

        Raises:
            UserError: ``precision`` is ``fp32``.
        """
        if precision == "fp32":
            raise UserError(
                f"{where}: qaic programs run at device precision; --precision fp32 needs the "
                "onnxruntime backend"
            )

    def emulates_device(self, precision: str | None) -> bool:
        """False: the device computes its own numerics (nothing to emulate on the host)."""
        return False

    def at_device_precision(self, precision: str | None) -> bool:
        """True: the device computes."""
        return True

    def open_program(
        self,
        path: Path,
        specializations: Any,
        describe: Callable[[], Mapping[str, Any]],
        fp32_values: Any = None,
        mx: Any = None,
    ) -> Any:
        """A :class:`~qeff_vision.runtime.session.QaicProgram` (``describe()``: its inputs and outputs).

        Raises:
            UserError: The SDK runtime is not importable here.
        """
        require_qaic_runtime(path)
        return QaicProgram(path, describe(), specializations)


HOST_SESSION = HostSession()
DEVICE_RUNTIME = DeviceRuntime()
#: Each backend an artifact's manifest may record, by its ``backend`` value.
BACKENDS: dict[str, HostSession | DeviceRuntime] = {b.name: b for b in (HOST_SESSION, DEVICE_RUNTIME)}


def backend_named(name: Any, where: Path | str) -> HostSession | DeviceRuntime:
    """The backend object a manifest's ``backend`` names.

    Raises:
        UserError: It names none.
    """
    if name not in BACKENDS:
        raise UserError(f"{where}: unknown backend {name!r}")
    return BACKENDS[name]


def backend_of(*programs: Any) -> HostSession | DeviceRuntime:
    """The backend of programs opened together: the device's if any keeps its state resident.

    The one place a program's ``retains_state`` declaration is read (a program without one, a
    stand-in of a test, runs on the host); a program that holds others names their ``backend``.
    """
    resident = any(
        getattr(program, "retains_state", False) or getattr(program, "backend", None) is DEVICE_RUNTIME
        for program in programs
    )
    return DEVICE_RUNTIME if resident else HOST_SESSION
