"""Precision plans kept across outputs: a calibration is run once per (graph, weights, inputs).

A compile records what its calibration found next to the plan in OUT (``node_precision.record.json``,
:mod:`qeff_vision.compile.precision`), so a recompile into the same OUT reuses it. The same record
is also kept here, under the user's cache directory, named by its key: a hash of the graph and its
external data (the weights), the calibration inputs (resolutions, images, prompts, the
specializations whose generated inputs join them) and the rule. A compile of another spec, into
another OUT, that needs the same program finds the plan here and runs no calibration.

The directory is ``$QEFF_VISION_CACHE/plans`` (``$XDG_CACHE_HOME/qeff-vision`` or
``~/.cache/qeff-vision`` when unset); ``QEFF_VISION_CACHE=off`` turns the store off. It is a
cache: a record that cannot be read or written costs a calibration, never a failure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qeff_vision.fsutil import atomic_write_json, read_record_json

CACHE_ENV = "QEFF_VISION_CACHE"
OFF = "off"


def store_dir() -> Path | None:
    """Where plan records are kept (``None`` when the store is off)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", OFF) else Path(value) / "plans"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qeff-vision" / "plans"


def load(key: str) -> dict[str, Any] | None:
    """The record stored under ``key``, if any (its own ``key`` field must match)."""
    directory = store_dir()
    if directory is None:
        return None
    record = read_record_json(directory / f"{key}.json")
    return record if record is not None and record.get("key") == key else None


def save(key: str, record: Mapping[str, Any]) -> None:
    """Keep ``record`` under ``key`` (atomically; a failure to write is ignored)."""
    directory = store_dir()
    if directory is None:
        return
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(directory / f"{key}.json", {**record, "key": key})
