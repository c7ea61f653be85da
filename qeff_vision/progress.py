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
