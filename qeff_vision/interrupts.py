"""Stop signals that always end a command the same way: one line, a fixed exit code, nothing left behind.

Ctrl-C (SIGINT), ``kill``/``docker stop``/``systemctl stop``/Kubernetes (SIGTERM) and a closed
terminal or a service reload (SIGHUP) are one event to a command: stop, terminate and reap the
compilers it started, remove its staging directory and lock, print one line and exit with the
shell's code for the signal, 128 + its number (130, 143, 129). So every one of them raises
``KeyboardInterrupt`` in the main thread, and the code that cleans up after Ctrl-C cleans up after
all three.

Python turns the signal into that exception at the next bytecode of the main thread. It can be
lost: raised inside a finalizer or a library callback it is printed as "ignored", and one raised
inside C++ code that runs Python (pybind11) is remembered by the interpreter, which then kills
itself with SIGINT at exit whatever ``sys.exit`` said. So the CLI records every signal here
(:func:`install`), the commit points of the outputs (:func:`qeff_vision.fsutil.staged_directory`)
and the compiler wait loop ask :func:`raise_if_interrupted` again, and the entry point ends the
process with ``os._exit`` once its cleanup has run (:func:`qeff_vision.cli.entry`).

A second signal while the first is being cleaned up ends the process at once (a user who presses
Ctrl-C twice, a service manager's stop after its grace period), but first kills the process groups
of the children still registered (:func:`track_child`): the compilers run in their own sessions
and would outlive us otherwise. It also removes the paths registered with :func:`removed_on_exit`
(the staging directory, the lock file): a removal is quick, the wait for a child is what it skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_LINES = {
    signal.SIGINT: "interrupted",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP)",
}

_received = threading.Event()
_first: list[int] = []  # the first stop signal since install(), by number
_children: set[int] = set()  # process-group ids of running children (the compilers)
_paths: dict[str, None] = {}  # staging directories and lock files, removed by a second signal
_lock = threading.Lock()


def _ours(handler: object) -> bool:
    return handler in (_on_signal, _record_only)


def _on_signal(signum, frame) -> None:
    if _received.is_set():
        _end_now(signum)
    _first[:] = [signum]
    _received.set()
    raise KeyboardInterrupt


def _end_now(signum: int) -> None:
    """A second signal during cleanup: kill the children, print the line and leave at once."""
    kill_children()
    with _lock:
        paths = list(_paths)
    for path in reversed(paths):  # the staging directory before the lock that guards it
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    code = exit_code()
    with contextlib.suppress(Exception):  # a hung-up terminal refuses the write; leave anyway
        sys.stderr.write(f"qeff-vision: {exit_line()}\n")
        sys.stderr.flush()
    os._exit(code)


def install() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP into ``KeyboardInterrupt`` (main thread only).

    A signal the process was started with ignored (``nohup`` ignores SIGHUP, a shell's background
    job SIGINT) stays ignored: whoever started us asked for that.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    _received.clear()
    _first.clear()
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        if current in (default, signal.SIG_DFL) or _ours(current):
            signal.signal(signum, _on_signal)


def interrupted() -> bool:
    """True once a stop signal arrived since :func:`install`."""
    return _received.is_set()


def exit_code() -> int:
    """The shell's code for the first stop signal: 128 + its number (130 when none was recorded)."""
    return 128 + (_first[0] if _first else signal.SIGINT)


def exit_line() -> str:
    """What the one line says after the first stop signal (``interrupted`` for Ctrl-C)."""
    return _LINES.get(_first[0] if _first else signal.SIGINT, "interrupted")


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt again if a stop signal arrived and its first exception was lost."""
    if _received.is_set():
        raise KeyboardInterrupt


def _record_only(signum, frame) -> None:
    if not _first:
        _first[:] = [signum]
    _received.set()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold stop signals for the block (a few renames that must not be cut in half); they count after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if handler not in (signal.SIG_IGN, None) and (signum == signal.SIGINT or _ours(handler)):
            previous[signum] = signal.signal(signum, _record_only)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def track_child(pgid: int) -> None:
    """Register a child's process group, killed by a second signal if still running then."""
    with _lock:
        _children.add(pgid)


def untrack_child(pgid: int) -> None:
    """Forget a child's process group once it has been reaped."""
    with _lock:
        _children.discard(pgid)


def kill_children() -> None:
    """SIGKILL every registered child process group (each compiler runs in its own session)."""
    with _lock:
        groups = list(_children)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def removed_on_exit(path: str | os.PathLike) -> Iterator[None]:
    """Have a second stop signal remove ``path`` (a staging directory, a lock) during the block.

    The block itself removes it on the ordinary paths; this covers the exit that skips them.
    """
    key = os.fspath(path)
    with _lock:
        _paths[key] = None
    try:
        yield
    finally:
        with _lock:
            _paths.pop(key, None)
