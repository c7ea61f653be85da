"""Content-hash cache of compiled programs, and the lock that serializes compiles into one OUT.

A program directory is named by a hash of everything that decides the compiled binary: the ONNX
content (graph and external data), the compiler argv without paths, the specializations, the
custom IO, the partition file and the SDK version. It is reused only when its record
(``qeff_program.json``, written last and atomically after the compiler succeeded) names the same
key and the binary it describes is still there with the recorded size. Anything else is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from qeff_vision.fsutil import atomic_write_json, read_record_json
from qeff_vision.interrupts import removed_on_exit

RECORD_FILE = "qeff_program.json"
QPC_FILE = "programqpc.bin"
RECORD_FORMAT = 1
HASH_MEMO_FILE = ".content-hashes.json"
LOCK_SUFFIX = ".compile.lock"
KEY_LENGTH = 16  # hex digits in directory names; the record keeps the full key
_CHUNK = 1 << 20


# Files from this size on are hashed with progress lines (a 12 GB language graph's data takes
# 40 s at 330 MB/s off disk: a CI log would show nothing for that long).
PROGRESS_BYTES = 1 << 30


def sha256_file(path: Path, on_chunk: Callable[[int], None] | None = None) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (``on_chunk`` gets each chunk's size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return digest.hexdigest()


def external_data_files(onnx_path: Path) -> list[Path]:
    """Every external-data file an ONNX model refers to (sorted, relative to the model's directory)."""
    import onnx

    from qeff_vision.graph_file import check_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)
    locations: set[str] = set()

    def visit_tensor(tensor: Any) -> None:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)

    def visit_graph(graph: Any) -> None:
        for tensor in graph.initializer:
            visit_tensor(tensor)
        for node in graph.node:
            visit_nodes([node])

    def visit_nodes(nodes: Any) -> None:
        for node in nodes:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    visit_tensor(attribute.t)
                for tensor in attribute.tensors:
                    visit_tensor(tensor)
                if attribute.HasField("g"):
                    visit_graph(attribute.g)
                for graph in attribute.graphs:
                    visit_graph(graph)

    visit_graph(model.graph)
    for function in model.functions:
        visit_nodes(function.node)
    # Every compile hashes its graphs first: a truncated data file is refused here in one line,
    # before the compiler or onnxruntime reads it.
    check_external_data(model, onnx_path)
    return sorted(onnx_path.parent / location for location in locations)


class ContentHasher:
    """SHA-256 of files, remembered by (size, mtime) in a small JSON memo so a 15 GB graph is read once.

    Files under ``root`` are remembered by their path relative to it: a compile works in a
    staging directory of another name each time, whose files are hard links to OUT's (same size
    and mtime), so the memo still finds them. Files outside ``root`` (an export given with
    ``--export``) are also remembered in the user's cache (:func:`shared_memo_path`), so compiles
    into other OUTs of the same export do not read its 15 GB again.
    """

    def __init__(
        self,
        memo_path: Path | None = None,
        root: Path | None = None,
        say: Callable[[str], None] | None = None,
    ):
        self.memo_path = memo_path
        self.root = root.resolve() if root is not None else None
        self.say = say  # progress lines while a large file is hashed (None: none)
        self.memo: dict[str, dict] = {}
        if memo_path is not None:
            self.memo = read_record_json(memo_path) or {}
        self.shared_path = shared_memo_path() if memo_path is not None else None
        self.shared = (read_record_json(self.shared_path) or {}) if self.shared_path else {}

    def _name(self, path: Path) -> str:
        if self.root is not None and path.is_relative_to(self.root):
            return path.relative_to(self.root).as_posix()
        return str(path)

    def file(self, path: Path) -> str:
        """Hash of one file (memoized)."""
        path = path.resolve()
        stat = path.stat()
        name = self._name(path)
        outside = name == str(path)  # not under root: an absolute path, valid in any OUT
        for entry in (self.memo.get(name), self.shared.get(name) if outside else None):
            if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
                self.memo[name] = entry
                return entry["sha256"]
        digest = self._hashed(path, stat.st_size)
        self.memo[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        if outside:
            self.shared[name] = self.memo[name]
        return digest

    def _hashed(self, path: Path, size: int) -> str:
        """SHA-256 of ``path``; a large one reports progress (a bar, or timed lines off a terminal)."""
        if self.say is None or size < PROGRESS_BYTES:
            return sha256_file(path)
        from qeff_vision.progress import StageProgress

        mib = 1 << 20
        with StageProgress(f"hashing {path.name}", -(-size // mib), unit="MiB", say=self.say) as stage:
            done = [0]

            def chunk(count: int) -> None:
                done[0] += count
                stage.update(done[0] // mib)

            return sha256_file(path, chunk)

    def onnx(self, onnx_path: Path) -> str:
        """Hash of a graph and its external data, independent of where the files live."""
        digest = hashlib.sha256()
        digest.update(self.file(onnx_path).encode())
        for data in external_data_files(onnx_path):
            digest.update(data.name.encode() + b"\0" + self.file(data).encode())
        return digest.hexdigest()

    def save(self) -> None:
        """Write the memo back (atomically); a failure to write only costs a re-hash next time."""
        if self.memo_path is not None:
            with contextlib.suppress(OSError):
                atomic_write_json(self.memo_path, self.memo)
        if self.shared_path is not None and self.shared:
            # Another compile may have added entries since: theirs and ours (ours win on a clash).
            merged = {**(read_record_json(self.shared_path) or {}), **self.shared}
            with contextlib.suppress(OSError):
                self.shared_path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.shared_path, merged)


def shared_memo_path() -> Path | None:
    """The memo of files outside any OUT, beside the plan store (``None`` when the store is off)."""
    from qeff_vision.compile import plan_store

    directory = plan_store.store_dir()
    return directory.parent / "content-hashes.json" if directory is not None else None


def program_key(key_inputs: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the canonical JSON of ``key_inputs``."""
    canonical = json.dumps(key_inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def binary_dir_name(key: str) -> str:
    """``qpc-<first 16 hex digits of the key>``."""
    return f"qpc-{key[:KEY_LENGTH]}"


def read_record(binary_dir: Path) -> dict | None:
    """The record of a program directory, ``None`` when missing or unreadable."""
    return read_record_json(binary_dir / RECORD_FILE)


def cached_program(binary_dir: Path, key: str) -> dict | None:
    """The record when ``binary_dir`` holds a complete compile for ``key``; ``None`` otherwise."""
    record = read_record(binary_dir)
    if record is None or record.get("format") != RECORD_FORMAT or record.get("key") != key:
        return None
    qpc = binary_dir / QPC_FILE
    try:
        size = qpc.stat().st_size
    except OSError:
        return None
    if size != record.get("qpc_size") or size == 0:
        return None
    return record


def write_record(binary_dir: Path, record: Mapping[str, Any]) -> dict:
    """Complete a program directory: record the key and binary size, atomically, as the last write."""
    qpc = binary_dir / QPC_FILE
    full = {**record, "format": RECORD_FORMAT, "qpc_size": qpc.stat().st_size, "finished": time.time()}
    atomic_write_json(binary_dir / RECORD_FILE, full)
    return full


def discard(directory: Path) -> None:
    """Remove a program directory that must not look valid (failed, cancelled or stale)."""
    shutil.rmtree(directory, ignore_errors=True)


def lock_path(out_dir: Path) -> Path:
    """The lock file of ``out_dir``: beside it, since OUT itself is replaced when a compile ends."""
    return out_dir.parent / f".{out_dir.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def output_lock(out_dir: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` for the block; a second compile waits for the first.

    The lock is an ``flock`` on ``.OUT.compile.lock`` beside OUT: the kernel drops it when the
    holder exits, even on a crash, so a stale lock never blocks. The holder removes the file when
    it is done (nothing is left beside OUT); a waiter that then gets the lock of a removed file
    tries again on the current one.
    """
    path = lock_path(out_dir)
    waited = False
    while True:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed below
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if on_wait and not waited:
                    on_wait(f"waiting for another compile into {out_dir} (lock held by {holder})")
                waited = True
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(handle.fileno()).st_ino:
                continue  # the previous holder removed this file: lock the current one
            try:
                with removed_on_exit(path):  # a second stop signal skips the finally below
                    handle.seek(0)
                    handle.truncate()
                    # Who holds it, for a waiter. Unbuffered, so a full disk refuses it here and
                    # not again when the handle closes.
                    with contextlib.suppress(OSError):
                        os.write(handle.fileno(), f"pid {os.getpid()}\n".encode())
                    yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return
        finally:
            handle.close()  # closing drops the flock
