"""A checkpoint named by its Hugging Face Hub id, resolved through ``huggingface_hub``'s cache.

transformers (``from_pretrained("Qwen/...")``), vLLM (``vllm serve Qwen/...``) and QEfficient take
a Hub id and read the standard cache; so do ``export``, ``compile`` and ``run --compare-hf``.
``huggingface_hub`` does the work and reads its own environment: ``HF_HOME`` / ``HF_HUB_CACHE``
(where the cache is), ``HF_HUB_OFFLINE`` (never reach the network) and ``HF_TOKEN`` (gated and
private models). Only the files an export or the runtime reads come down: config, processor,
tokenizer and chat-template files first (which also pins the revision to one commit), then the
safetensors files the index names, at that commit. Every failure is one :class:`UserError` line.

Torch-free, and ``huggingface_hub`` is imported only when an id is resolved (``--help`` stays fast).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision.bad_input import first_line
from qeff_vision.errors import UserError

# ``org/name`` or a bare ``name`` (the Hub's own rule is stricter; it reports what we let through).
HUB_ID_PATTERN = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# Small files a checkpoint's config, processor, tokenizer and chat template live in (fnmatch
# patterns of huggingface_hub's allow_patterns). Weights are asked for by name afterwards.
RUNTIME_PATTERNS = (
    "*.json",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "additional_chat_templates/*",
)
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class HubCheckpoint:
    """A Hub checkpoint resolved to one commit of the local cache.

    Attributes:
        repo_id: The id as given (``Qwen/Qwen2.5-VL-3B-Instruct``).
        revision: The revision asked for (branch, tag or commit); ``None`` means ``main``.
        commit: The commit the revision resolved to: what the weights are, exactly.
        directory: The cache's snapshot directory of that commit.
    """

    repo_id: str
    revision: str | None
    commit: str
    directory: Path

    def record(self) -> dict[str, str | None]:
        """What export.json and manifest.json keep: id, revision asked for, commit resolved."""
        return {"id": self.repo_id, "revision": self.revision, "commit": self.commit}

    def weight_files(self) -> list[str]:
        """The safetensors files of this commit: the ones the index names, else the single file."""
        index = self.directory / WEIGHTS_INDEX
        if not index.is_file():
            return [SINGLE_WEIGHTS]
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return sorted({str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(
                f"{self.repo_id}@{self.commit}: unreadable {WEIGHTS_INDEX} ({first_line(exc)})"
            ) from None

    def with_weights(self, *, quiet: bool = False) -> HubCheckpoint:
        """Download (or find in the cache) this commit's safetensors files; return ``self``.

        Raises:
            UserError: The download failed, or the commit has no safetensors weights.
        """
        files = self.weight_files()
        _snapshot(self.repo_id, self.commit, files, quiet=quiet, asked=self.revision)
        missing = [name for name in files if not (self.directory / name).is_file()]
        if missing:
            raise UserError(
                f"{self.repo_id}@{self.commit[:12]}: {_missing_weights(missing)}; export reads safetensors "
                f"weights ({SINGLE_WEIGHTS} or the shards {WEIGHTS_INDEX} names)"
            )
        return self


@dataclass(frozen=True)
class HubReference:
    """Weights an export recorded by id and commit, whose snapshot directory is not here.

    The cache was cleared, or OUT moved to another machine: the commit is resolved, and its
    weights downloaded if needed, on first use (``run --compare-hf``).
    """

    repo_id: str
    commit: str

    def directory(self, *, quiet: bool = False) -> Path:
        """The snapshot of the commit, with its weights (see :func:`resolve`)."""
        return resolve(self.repo_id, self.commit, quiet=quiet).directory


def is_hub_id(text: str | Path) -> bool:
    """``text`` could be a Hub id and is not an existing directory (a directory always wins)."""
    text = str(text)
    if not HUB_ID_PATTERN.fullmatch(text):
        return False
    try:
        return not Path(text).is_dir()
    except OSError:
        return True


def resolve(
    repo_id: str, revision: str | None = None, *, weights: bool = True, quiet: bool = False
) -> HubCheckpoint:
    """Resolve ``repo_id`` at ``revision`` to a snapshot of the local cache, downloading what is missing.

    Args:
        repo_id: The Hub id.
        revision: Branch, tag or commit (``None``: ``main``).
        weights: Also fetch the safetensors files (export needs them; a spec check or the
            runtime's config, processor and chat template do not).
        quiet: No download progress bars (huggingface_hub's own, shown on a terminal otherwise).

    Raises:
        UserError: One line for a gated model without a token, an unknown id, a revision that
            does not exist, no network (or ``HF_HUB_OFFLINE``) without a cached copy, or a
            snapshot without config.json or safetensors weights.
    """
    found = Path(_snapshot(repo_id, revision, RUNTIME_PATTERNS, quiet=quiet, asked=revision))
    checkpoint = HubCheckpoint(repo_id, revision, found.name, found)
    if not (found / "config.json").is_file():
        raise UserError(f"{repo_id}@{checkpoint.commit[:12]}: no config.json; not a transformers checkpoint")
    return checkpoint.with_weights(quiet=quiet) if weights else checkpoint


def cached(repo_id: str, revision: str | None = None) -> HubCheckpoint | None:
    """``repo_id`` at ``revision`` as the local cache holds it (never reaches the network), else None."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=list(RUNTIME_PATTERNS), local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, ValueError):  # not cached (or not an id the cache could hold)
        return None
    if not (found / "config.json").is_file():
        return None
    return HubCheckpoint(repo_id, revision, found.name, found)


def cached_config(repo_id: str, revision: str | None = None) -> Path | None:
    """config.json of ``repo_id`` at ``revision`` from the local cache, if there (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - any hub-side validation error means "not usable offline"
        return None
    return Path(found) if isinstance(found, str) else None


def hub_record(record: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The ``hub`` block of an export or compile record, if it names an id and a commit."""
    hub = (record or {}).get("hub")
    if isinstance(hub, Mapping) and isinstance(hub.get("id"), str) and isinstance(hub.get("commit"), str):
        return dict(hub)
    return None


def _snapshot(
    repo_id: str, revision: str | None, patterns: Sequence[str], *, quiet: bool, asked: str | None
) -> str:
    import huggingface_hub

    with _as_user_errors(repo_id, asked), _download_bars(quiet):
        return huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns))


@contextlib.contextmanager
def _download_bars(quiet: bool) -> Iterator[None]:
    """huggingface_hub's own bars during the block: none when quiet, else on (it shows them on a terminal).

    Switched for the block and restored after: transformers turns them off process-wide when our
    stages quiet it (:func:`qeff_vision.hf_logging.quiet_transformers`), which must not silence a
    later download. ``HF_HUB_DISABLE_PROGRESS_BARS`` still wins (huggingface_hub warns; we do not).
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if are_progress_bars_disabled() == quiet:
        yield
        return
    switch, restore = (
        (disable_progress_bars, enable_progress_bars)
        if quiet
        else (enable_progress_bars, disable_progress_bars)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        switch()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restore()


@contextlib.contextmanager
def _as_user_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Every way resolving an id fails, as one line naming the id and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" revision {revision!r}" if revision else ""
    cache = constants.HF_HUB_CACHE
    try:
        yield
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        raise UserError(
            f"{repo_id}: a gated model; accept its terms on huggingface.co and set HF_TOKEN "
            "(or run `hf auth login`) with an account that has access"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{repo_id}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise UserError(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except HFValidationError as exc:
        raise UserError(f"{repo_id}: not a Hugging Face id ({first_line(exc)})") from None
    except LocalEntryNotFoundError as exc:
        raise UserError(_not_cached(repo_id, revision, at, cache, constants.is_offline_mode(), exc)) from None
    except HfHubHTTPError as exc:
        raise UserError(f"{repo_id}{at}: the Hugging Face Hub refused ({first_line(exc)})") from None
    except OSError as exc:  # a connection that broke mid-download, a full disk in the cache
        raise UserError(f"{repo_id}{at}: download failed ({type(exc).__name__}: {first_line(exc)})") from None
    except Exception as exc:
        # httpx's transport errors are not OSErrors; anything else is ours and must surface.
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
            reason = f"{type(exc).__name__}: {first_line(exc)}"
            raise UserError(f"{repo_id}{at}: the Hugging Face Hub cannot be reached ({reason})") from None
        raise


def _not_cached(
    repo_id: str, revision: str | None, at: str, cache: str, offline: bool, exc: Exception
) -> str:
    """Why a snapshot was not found: offline or unreachable, and whether the cache knows the id."""
    known = (Path(cache) / ("models--" + repo_id.replace("/", "--"))).is_dir()
    what = f"revision {revision!r} of {repo_id} is" if (known and revision) else f"{repo_id}{at} is"
    if type(exc).__name__ == "IncompleteSnapshotError":
        return f"{repo_id}{at}: the cached snapshot in {cache} is incomplete; download it again online"
    if offline:
        return (
            f"{what} not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; unset it to download"
        )
    return (
        f"{what} not in the Hugging Face cache ({cache}) and the Hub cannot be reached "
        "(no network?); connect, or point HF_HUB_CACHE at a cache that holds it"
    )


def _missing_weights(missing: Sequence[str]) -> str:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return f"weight file(s) {shown} not in the snapshot"
