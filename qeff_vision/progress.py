"""Progress bars for the stages a person waits on: weight streaming, compiling, calibration.

They are ``tqdm`` bars (what transformers and huggingface_hub show) on stderr, and only when that
stream is a terminal: a log file or a pipe gets the one-line stage messages and no bar, and stdout,
where output is parsed, never gets one. ``-q`` turns them off with the stage lines: a caller passes
``enabled=False``, or runs a whole command under :func:`silenced` (a stage deep inside it, such as
calibration, needs no flag passed down). A disabled bar has the same methods and prints nothing, so
the stage code does not branch on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

_SILENCED = contextvars.ContextVar("qeff_vision_progress_silenced", default=False)


@contextlib.contextmanager
def silenced(quiet: bool = True) -> Iterator[None]:
    """No bar inside the block when ``quiet`` (a command run with ``-q``)."""
    token = _SILENCED.set(_SILENCED.get() or quiet)
    try:
        yield
    finally:
        _SILENCED.reset(token)


def on_terminal(stream: TextIO | None) -> bool:
    """``stream`` is an open terminal (False for None, files, pipes and closed streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


def bar(
    desc: str,
    *,
    total: float | None = None,
    unit: str = "it",
    enabled: bool = True,
    stream: TextIO | None = None,
    **options: Any,
):
    """A tqdm bar on ``stream`` (stderr by default), shown only when enabled and on a terminal.

    Args:
        desc: What is progressing (``"lang weights"``).
        total: The amount at the end (bytes, runs); ``None`` shows the count and elapsed time only.
        unit: ``"B"`` scales to kB/MB/GB and shows a byte rate.
        enabled: False under ``-q`` (as is every bar inside :func:`silenced`).
        stream: Where the bar is drawn (``sys.stderr`` as the call sees it by default).
        options: More tqdm options (``bar_format``, ``position``, ``leave``).
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=stream,
        disable=not (enabled and not _SILENCED.get() and on_terminal(stream)),
        dynamic_ncols=True,
        **options,
    )


# The clock of the stages (tests replace it, so that no test sleeps).
CLOCK = time.monotonic
# Off a terminal: a line at most this often (a CI log stays short) ...
LINE_INTERVAL = 10.0
# ... and at least this often while a stage runs, even when one step is long (the job is alive):
# 25 s, so that a line comes within the promised 30 s on a loaded host too (the heartbeat thread
# wakes once a second, and a full-depth compile on a host loaded 16 deep logged gaps up to 30.9 s).
HEARTBEAT_INTERVAL = 25.0


class StageProgress:
    """Progress of a long stage: a bar with ETA on a terminal, timed lines elsewhere.

    On a terminal (and not silenced), a :func:`bar`. Elsewhere (a CI log, ``nohup``), lines through
    ``say`` such as ``calibration lang: 45% (9/20 slices), 1m23s elapsed``: at most one per
    :data:`LINE_INTERVAL` seconds as steps finish (and where a long stage ended), and, while it
    runs, one at least every :data:`HEARTBEAT_INTERVAL` seconds even when no step finishes
    (a background thread; :meth:`heartbeat` is what it calls). ``clock`` is injectable so that
    tests need not sleep.

    Args:
        desc: What progresses (``"calibration lang"``).
        total: Steps at the end (may grow with :meth:`add`).
        unit: What a step is (``"slices"``).
        say: Where lines go (``None``: nowhere; a ``-q`` run passes none).
        stream: The terminal test's stream (stderr by default).
        clock: Seconds, monotonic.
        thread: Start the heartbeat thread off a terminal (tests call :meth:`heartbeat` instead).
    """

    def __init__(
        self,
        desc: str,
        total: int,
        *,
        unit: str = "steps",
        say=None,
        stream: TextIO | None = None,
        clock=None,
        thread: bool = True,
    ):
        import threading

        stream = sys.stderr if stream is None else stream
        self.desc, self.total, self.unit, self.say = desc, total, unit, say
        self.clock = clock if clock is not None else CLOCK
        self.done = 0
        self.started = self.last_line = self.clock()
        self._lock = threading.Lock()
        self._bar = None
        self._stop = threading.Event()
        self._thread = None
        if on_terminal(stream) and not _SILENCED.get():
            self._bar = bar(desc, total=total, unit=unit.rstrip("s") or "it", stream=stream)
        elif say is not None and thread:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()

    def add(self, steps: int) -> None:
        """The stage has ``steps`` more to do than thought (a slice cut in two)."""
        with self._lock:
            self.total += steps
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def update(self, done: int | None = None) -> None:
        """One more step done (or ``done`` steps in all)."""
        with self._lock:
            previous = self.done
            self.done = self.done + 1 if done is None else done
            if self._bar is not None:
                self._bar.update(self.done - previous)
                return
            now = self.clock()
            if now - self.last_line >= LINE_INTERVAL:
                self._line(now)

    def heartbeat(self) -> None:
        """A line if none was written for :data:`HEARTBEAT_INTERVAL` seconds."""
        with self._lock:
            now = self.clock()
            if self._bar is None and now - self.last_line >= HEARTBEAT_INTERVAL:
                self._line(now)

    def close(self) -> None:
        """The stage ended: the bar is cleared, the heartbeat stops, a long stage says where it ended."""
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
            return
        with self._lock:
            now = self.clock()
            if now - self.started >= LINE_INTERVAL and now - self.last_line >= LINE_INTERVAL:
                self._line(now)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, now: float) -> None:
        self.last_line = now
        if self.say is None:
            return
        # Nothing known to do yet (a calibration before its first pass): 0%, not 100%.
        percent = 100.0 * self.done / self.total if self.total else (100.0 if self._stop.is_set() else 0.0)
        self.say(
            f"{self.desc}: {percent:.0f}% ({self.done}/{self.total} {self.unit}), "
            f"{_duration(now - self.started)} elapsed"
        )

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            self.heartbeat()


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m07s`` or ``12s``."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class SliceCounter:
    """An ``on_slice(done, slices)`` callback of sliced passes feeding one :class:`StageProgress`.

    Each pass adds its slices to the stage's total when it starts (a pass's ``done`` restarts at
    1), and the slices a cut adds during it.
    """

    def __init__(self, stage: StageProgress):
        self.stage = stage
        self.pass_done = self.pass_total = 0

    def __call__(self, done: int, slices: int) -> None:
        """``done`` of the current pass's ``slices`` are done."""
        if done <= self.pass_done:  # a new pass
            self.pass_done = self.pass_total = 0
        if slices > self.pass_total:
            self.stage.add(slices - self.pass_total)
            self.pass_total = slices
        self.stage.update(self.stage.done + done - self.pass_done)
        self.pass_done = done
