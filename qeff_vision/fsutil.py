"""Atomic writes (nothing half-written is ever left under a final name) and the JSON readers.

Also :func:`release_memory`, which hands freed heap pages back between the stages of a long run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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


def check_output_dir(path: str | os.PathLike) -> Path:
    """Refuse, before anything is read or written, an output directory that cannot be made here.

    Every command that writes a directory calls this first (through :func:`staged_directory` or
    directly), so an impossible ``-o`` is one line and exit 2, not a traceback after minutes of
    work. It tries what the command will do: create an entry in the directory the output (or its
    staging sibling) goes into, and in the output itself when it exists. Trying is the only check
    that holds for every user: root ignores permission bits, a path under ``/proc`` or a read-only
    mount refuses everyone.

    Raises:
        UserError: ``path`` exists and is not a directory, a parent is a file, or a directory that
            would be written in refuses a new entry.
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"{path}: exists and is not a directory")
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{path}: cannot create it, {ancestor} is not a directory")
    for directory in (ancestor, path) if path.is_dir() else (ancestor,):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".qeff-vision-write-check.", dir=directory))
        except OSError as exc:
            raise UserError(f"{path}: cannot write in {directory} ({exc.strerror or exc})") from None
    return path


def _make_parents(path: Path) -> list[Path]:
    """Create the missing parents of ``path``; return those created, outermost first."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        directory.mkdir()
    return list(reversed(missing))


def _remove_empty(directories: list[Path]) -> None:
    for directory in reversed(directories):  # innermost first
        with contextlib.suppress(OSError):
            directory.rmdir()


def link_tree(source: Path, target: Path, shared: tuple[str, ...] = ()) -> None:
    """Recreate ``source`` under ``target`` with hard links to its files (a copy where links fail).

    Cheap for any size. The linked files are shared with ``source``: whoever writes in the copy
    must replace a file (write a new one and rename it), never write into it. The top-level
    directories named in ``shared`` become symlinks to ``source``'s instead (onnx refuses
    external data with more than one hard link, so an export is used in place).

    Raises:
        UserError: ``source`` holds something that is neither a file, a directory nor a symlink.
    """
    for name in shared:
        if (source / name).is_dir() and not (source / name).is_symlink():
            os.symlink(os.path.abspath(source / name), target / name)
    for root, directories, files in os.walk(source):
        relative = Path(root).relative_to(source)
        if relative == Path("."):
            directories[:] = [name for name in directories if not (target / name).is_symlink()]
        for name in directories:
            entry, copy = Path(root) / name, target / relative / name
            if entry.is_symlink():
                os.symlink(os.readlink(entry), copy)
            else:
                copy.mkdir()
                shutil.copymode(entry, copy)
        directories[:] = [name for name in directories if not (Path(root) / name).is_symlink()]
        for name in files:
            entry, copy = Path(root) / name, target / relative / name
            if entry.is_symlink():
                os.symlink(os.readlink(entry), copy)
            elif not entry.is_file():
                raise UserError(f"{entry}: not a regular file; an output directory holds files only")
            else:
                try:
                    os.link(entry, copy)
                except OSError:  # another file system below source, or no hard links there
                    shutil.copy2(entry, copy)


@contextlib.contextmanager
def staged_directory(
    final: str | os.PathLike,
    *,
    force: bool = False,
    start_from_final: bool = False,
    shared: tuple[str, ...] = (),
    lock: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final`` only when the block succeeds.

    On any exception (Ctrl-C included) the staging directory and any parent this made are
    removed and ``final`` is left as it was, so a failed or interrupted command never leaves a
    directory that looks complete, nor changes one that was. Every command that writes goes
    through here, so this is also the one guard against a full disk: whatever raised it (an
    ``OSError``, safetensors' or onnx's own error type), a disk-full or quota error becomes one
    ``UserError`` naming ``final``, after the staging directory is gone.

    Args:
        final: The directory the finished content should live in (checked by
            :func:`check_output_dir` first).
        force: Replace an existing non-empty ``final``; without it the caller must have checked.
        start_from_final: Start the staging directory as :func:`link_tree` of ``final`` (a compile
            reuses its earlier export and programs); implies replacing ``final``.
        shared: With ``start_from_final``: top-level directories of ``final`` used in place through
            a symlink; one still a symlink at the end moves into the result. Files the block
            adds there (derived graphs beside an export's) are removed when it fails.
        lock: Makes a context manager held from before the staging directory is made until
            ``final`` is replaced or left (a lock beside ``final``; its parent exists by then).
    """
    from qeff_vision.interrupts import deferred, raise_if_interrupted, removed_on_exit

    final = check_output_dir(final)
    created = _make_parents(final)
    staging = None
    present: dict[str, set[Path]] = {}
    try:
        with lock() if lock else contextlib.nullcontext():
            staging = _stage(final, start_from_final, shared)
            present = {name: _files(final / name) for name in shared if (staging / name).is_symlink()}
            with removed_on_exit(staging):
                yield staging
                raise_if_interrupted()  # a stop signal whose exception was lost stops here
                with deferred():  # the renames of the commit are not cut in half
                    _commit(staging, final, force or start_from_final, shared)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)  # a symlink is removed, not followed
        for name, before in present.items():  # files derived into a shared directory (single.onnx)
            for added in _files(final / name) - before:
                added.unlink(missing_ok=True)
        _remove_empty(created)
        if isinstance(exc, Exception) and not isinstance(exc, UserError) and disk_full(exc):
            raise UserError(f"{final}: {_full_text(exc)} while writing it ({_first_line(exc)})") from exc
        raise


# What a full disk (or an exhausted quota) raises, by errno, and the text libraries that wrap it
# in their own exception keep: safetensors' SafetensorError "I/O error: No space left on device
# (os error 28)", protobuf's and onnxruntime's messages, torch's RuntimeError.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def disk_full(exc: BaseException) -> bool:
    """True when ``exc`` (or one it was raised from) is a full disk or an exhausted quota."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in _FULL_ERRNOS:
            return True
        if disk_full_text(str(link)):
            return True
    return False


def disk_full_text(text: str) -> bool:
    """True when ``text`` (an error message, a line of a compiler's log) reports a full disk or quota."""
    return any(os.strerror(code) in text for code in _FULL_ERRNOS)


def no_space_left(path: str | os.PathLike) -> bool:
    """True when the file system holding ``path`` (or its nearest existing parent) has no free block."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _full_text(exc: BaseException) -> str:
    quota = any(
        (isinstance(link, OSError) and link.errno == errno.EDQUOT) or os.strerror(errno.EDQUOT) in str(link)
        for link in _chain(exc)
    )
    return "disk quota exceeded" if quota else "no space left on device"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _files(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()} if directory.is_dir() else set()


def _stage(final: Path, start_from_final: bool, shared: tuple[str, ...]) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging.", dir=final.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp creates 0700; the result is an ordinary directory
        if start_from_final and final.is_dir():
            shutil.copymode(final, staging)
            link_tree(final, staging, shared)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _commit(staging: Path, final: Path, replace: bool, shared: tuple[str, ...]) -> None:
    if not final.exists():
        os.replace(staging, final)
        return
    if not replace and any(final.iterdir()):
        raise UserError(f"{final} appeared while writing; refusing to replace it")
    moved = []
    try:
        for name in shared:
            if (staging / name).is_symlink():  # used in place: the directory itself moves over
                (staging / name).unlink()
                os.replace(final / name, staging / name)
                moved.append(name)
        trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
        os.replace(final, trash / final.name)
    except BaseException:
        for name in moved:  # the caller removes the staging directory: give them back first
            os.replace(staging / name, final / name)
        raise
    os.replace(staging, final)
    shutil.rmtree(trash, ignore_errors=True)


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
