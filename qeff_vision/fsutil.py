"""Atomic writes (nothing half-written is ever left under a final name) and the JSON readers.

Also :func:`release_memory`, which hands freed heap pages back between the stages of a long run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qeff_vision.errors import UserError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: str | os.PathLike, *, missing: str | None = None) -> dict[str, Any]:
    """Read a JSON object; I/O and syntax errors become one-line user errors.

    Args:
        path: The file.
        missing: The message when the file does not exist (default: ``PATH: file not found``).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UserError(missing or f"{path}: file not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def read_record_json(path: str | os.PathLike) -> dict[str, Any] | None:
    """Read a JSON object a tool wrote for itself (a cache record), or ``None``.

    Missing, unreadable or not an object all mean the same thing to a cache: no record; the
    caller rebuilds it. User-facing files go through :func:`read_json` instead.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def atomic_write_json(path: str | os.PathLike, data: object) -> None:
    """Write ``data`` as indented, key-sorted JSON, atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final`` only when the block succeeds.

    On any exception the staging directory is removed and ``final`` is left as it was, so an
    interrupted export or compile never leaves a directory that looks complete.

    Args:
        final: The directory the finished content should live in.
        force: Replace an existing non-empty ``final``; without it the caller must have checked.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging.", dir=final.parent))
    os.chmod(staging, 0o755)  # mkdtemp creates 0700; the result is an ordinary directory
    try:
        yield staging
        if final.exists():
            if not force and any(final.iterdir()):
                raise FileExistsError(f"{final} appeared while writing; refusing to replace it")
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, trash / final.name)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def is_nonempty_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory with at least one entry."""
    path = Path(path)
    return path.is_dir() and any(path.iterdir())


def release_memory(collect: bool = True) -> None:
    """Collect garbage (unless ``collect`` is false) and hand freed heap pages back to the OS.

    glibc keeps freed pages otherwise. A collection costs time in a large heap; a caller that just
    dropped the last reference to something (refcounting frees it at once) can skip it.
    """
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
