"""Progress bars for the stages a person waits on: weight streaming, compiling, calibration.

They are ``tqdm`` bars (what transformers and huggingface_hub show) on stderr, and only when that
stream is a terminal: a log file or a pipe gets the one-line stage messages and no bar, and stdout,
where output is parsed, never gets one. ``-q`` turns them off with the stage lines (callers pass
``enabled=False``). A disabled bar has the same methods and prints nothing, so the stage code does
not branch on it.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


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
        enabled: False under ``-q``.
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
        disable=not (enabled and on_terminal(stream)),
        dynamic_ncols=True,
        **options,
    )
