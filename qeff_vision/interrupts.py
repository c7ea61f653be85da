"""Ctrl-C that always ends a command the same way: "interrupted", exit code 130, nothing left behind.

Python turns SIGINT into ``KeyboardInterrupt`` at the next bytecode of the main thread. That
exception can be lost: raised inside a finalizer or a library callback it is printed as "ignored",
and one raised inside C++ code that runs Python (pybind11) is remembered by the interpreter, which
then kills itself with SIGINT at exit whatever ``sys.exit`` said. So the CLI records every SIGINT
here (:func:`install`), the commit points of the outputs (:func:`qeff_vision.fsutil.staged_directory`)
and the compiler wait loop ask :func:`raise_if_interrupted` again, and the entry point ends the
process with ``os._exit`` once its cleanup has run (:func:`qeff_vision.cli.entry`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_received = threading.Event()


def _on_sigint(signum, frame) -> None:
    _received.set()
    raise KeyboardInterrupt


def install() -> None:
    """Record SIGINT before raising KeyboardInterrupt (main thread; an ignored SIGINT stays ignored)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
        signal.default_int_handler,
        _on_sigint,
    ):
        _received.clear()
        signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """True once a SIGINT arrived since :func:`install`."""
    return _received.is_set()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt again if a SIGINT arrived and its first exception was lost."""
    if _received.is_set():
        raise KeyboardInterrupt


def _record_only(signum, frame) -> None:
    _received.set()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C for the block (a few renames that must not be cut in half); it counts after."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) in (
        signal.SIG_IGN,
        None,
    ):
        yield
        return
    previous = signal.signal(signal.SIGINT, _record_only)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
