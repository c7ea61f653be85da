"""A Hugging Face cache on disk, in the layout ``huggingface_hub`` reads, holding a local checkpoint.

``models--org--name/blobs/<sha256>`` holds each file once; ``snapshots/<commit>/<file>`` links to
its blob (relative symlinks, as huggingface_hub writes them); ``refs/<branch>`` names the commit.
Tests point ``HF_HUB_CACHE`` here and set ``HF_HUB_OFFLINE=1``: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_id(seed: str) -> str:
    """A 40-hex commit id derived from ``seed`` (huggingface_hub tells commits from branches by it)."""
    return hashlib.sha1(seed.encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, checkpoint: Path, commit: str, ref: str | None = "main") -> Path:
    """Put ``checkpoint``'s top-level files into ``cache`` as ``repo_id`` at ``commit``; return the snapshot.

    Args:
        cache: The ``HF_HUB_CACHE`` directory.
        repo_id: ``org/name``.
        checkpoint: A checkpoint directory (config, safetensors, processor and tokenizer files).
        commit: The commit id (40 hex digits).
        ref: The branch that points at the commit (``None``: none does).
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for entry in sorted(checkpoint.iterdir()):
        if not entry.is_file():
            continue
        data = entry.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / entry.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
