"""A checkpoint by its Hugging Face id (issue 42): resolved from a local cache in huggingface_hub's
layout, offline; the manifest and export.json name the id and the commit; another commit is another
checkpoint; each way resolving fails is one line and exit 2. Nothing downloads: the cache is built
here, HF_HUB_OFFLINE is set, and the online failures are huggingface_hub's own errors raised by a
replaced ``snapshot_download``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors

from qeff_vision.cli import main
from tests.compile_fixtures import CONFIG_3B, calls, stand_in, write_spec
from tests.hub_cache import add_snapshot, commit_id

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "qwen2_5_vl"
REPO_ID = "tiny-org/tiny-qwen"
FIRST, SECOND = commit_id("first"), commit_id("second")


@pytest.fixture
def cache(tmp_path, tiny_checkpoint, monkeypatch):
    """A cache holding the tiny checkpoint as REPO_ID at FIRST (main); in-process calls see it offline."""
    root = tmp_path / "hub-cache"
    add_snapshot(root, REPO_ID, tiny_checkpoint(FAMILY), FIRST)
    # huggingface_hub reads its environment once, at import: the constants are what it uses.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "qeff_vision", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_compile_by_hub_id_works_offline_and_records_id_and_commit(cache, tmp_path):
    spec = write_spec(tmp_path / "hub.yaml", model=REPO_ID, config=None, ctx_len=512)
    compiler, record = stand_in(tmp_path)
    out = tmp_path / "out"
    done = _cli("compile", str(spec), "-o", str(out), "--compiler", str(compiler), cache=cache)
    assert done.returncode == 0, done.stderr
    assert len(calls(record)) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == REPO_ID
    assert manifest["hub"] == {"id": REPO_ID, "revision": None, "commit": FIRST}
    export = json.loads((out / "export" / "export.json").read_text())
    assert export["hub"] == {"id": REPO_ID, "revision": None, "commit": FIRST}
    assert Path(export["model"]) == cache / "models--tiny-org--tiny-qwen" / "snapshots" / FIRST
    assert (out / "model" / "config.json").is_file()  # the runtime files, copied from the snapshot

    # main moves to another commit (same config, other weights): the export is another checkpoint's.
    add_snapshot(cache, REPO_ID, Path(export["model"]), SECOND)
    done = _cli("compile", str(spec), "-o", str(out), "--compiler", str(compiler), cache=cache)
    assert done.returncode == 0, done.stderr
    assert "the previous export is stale" in done.stderr
    assert json.loads((out / "export" / "export.json").read_text())["hub"]["commit"] == SECOND

    # --revision pins the first commit again: stale once more, and the manifest names what was asked.
    done = _cli(
        "compile", str(spec), "-o", str(out), "--compiler", str(compiler), "--revision", FIRST, cache=cache
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hub"] == {"id": REPO_ID, "revision": FIRST, "commit": FIRST}


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    print(lines[0])  # shown with -s: the line a user reads
    return lines[0]


@pytest.mark.parametrize(
    ("model", "revision", "expected"),
    [
        ("other-org/not-cached", None, "other-org/not-cached is not in the Hugging Face cache"),
        (REPO_ID, "v9", "revision 'v9' of tiny-org/tiny-qwen is not in the Hugging Face cache"),
    ],
    ids=["unknown-id", "missing-revision"],
)
@pytest.mark.parametrize("command", ["export", "compile", "compile-pinned-config"])
def test_offline_failures_are_one_line(cache, tmp_path, capsys, model, revision, expected, command):
    out = tmp_path / "out"
    if command == "export":
        args = ["export", model, "-o", str(out), "-q"]
    else:  # without config: the spec check resolves the id; with a pinned one, the export does
        config = CONFIG_3B if command == "compile-pinned-config" else None
        spec = write_spec(tmp_path / "hub.yaml", model=model, config=config, ctx_len=512)
        args = ["compile", str(spec), "-o", str(out), "--backend", "onnxruntime", "-q"]
    if revision:
        args += ["--revision", revision]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert expected in line and "HF_HUB_OFFLINE" in line, line
    assert not out.exists()


def _response(status: int):
    from huggingface_hub.errors import Response  # the HTTP library huggingface_hub itself uses

    return Response(
        status, request=__import__("httpx2").Request("GET", "https://huggingface.co/api/models/x")
    )


ONLINE_FAILURES = {
    "gated": (lambda: hub_errors.GatedRepoError("403 gated", response=_response(403)), "a gated model"),
    "unknown-id": (
        lambda: hub_errors.RepositoryNotFoundError("404 not found", response=_response(404)),
        "no such model on the Hugging Face Hub",
    ),
    "missing-revision": (
        lambda: hub_errors.RevisionNotFoundError("404 revision", response=_response(404)),
        "no revision 'v9' on the Hugging Face Hub",
    ),
    # What snapshot_download raises when the Hub cannot be reached and nothing is cached.
    "no-network": (
        lambda: hub_errors.LocalEntryNotFoundError("An error happened while trying to locate the files"),
        "the Hub cannot be reached",
    ),
}


@pytest.mark.parametrize("case", sorted(ONLINE_FAILURES))
@pytest.mark.parametrize("command", ["export", "compile"])
def test_online_failures_are_one_line(cache, tmp_path, capsys, monkeypatch, case, command):
    make_error, expected = ONLINE_FAILURES[case]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the replaced download is all that runs
    asked = []

    def refuse(repo_id, **kwargs):
        asked.append((repo_id, kwargs.get("revision")))
        raise make_error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    out = tmp_path / "out"
    model = "gated-org/model"
    if command == "export":
        args = ["export", model, "-o", str(out), "--revision", "v9", "-q"]
    else:
        spec = write_spec(tmp_path / "hub.yaml", model=model, config=None, ctx_len=512)
        args = ["compile", str(spec), "-o", str(out), "--revision", "v9", "-q"]
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert expected in line and model in line, line
    assert asked and asked[-1] == (model, "v9")
    assert not out.exists()


def test_a_connection_error_of_the_http_library_is_one_line(cache, tmp_path, capsys, monkeypatch):
    import httpx2

    def broken(repo_id, **kwargs):
        raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", broken)
    assert main(["export", "some-org/model", "-o", str(tmp_path / "out"), "-q"]) == 2
    line = _one_error_line(capsys)
    assert "some-org/model" in line and "cannot be reached" in line, line


def test_export_by_hub_id_records_the_commit(cache, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", REPO_ID, "-o", str(out), "-q"]) == 0, capsys.readouterr().err
    record = json.loads((out / "export.json").read_text())
    assert record["hub"] == {"id": REPO_ID, "revision": None, "commit": FIRST}


def test_a_snapshot_without_its_weights_is_one_line(cache, tmp_path, capsys):
    snapshot = cache / "models--tiny-org--tiny-qwen" / "snapshots" / FIRST
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    assert main(["export", REPO_ID, "-o", str(tmp_path / "out"), "-q"]) == 2
    line = _one_error_line(capsys)
    assert "model.safetensors not in the snapshot" in line, line


def test_a_directory_takes_no_revision(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(tiny_checkpoint(FAMILY)), "-o", str(out), "--revision", "v1", "-q"]) == 2
    assert "--revision applies to a Hugging Face id only" in _one_error_line(capsys)


def test_run_compare_hf_reaches_the_weights_by_id_and_commit(cache, tmp_path, capsys, monkeypatch):
    from tests import helpers

    spec = write_spec(tmp_path / "hub.yaml", model=REPO_ID, config=None, ctx_len=512)
    out = tmp_path / "out"
    assert main(["compile", str(spec), "-o", str(out), "--backend", "onnxruntime", "-q"]) == 0
    capsys.readouterr()
    # The cache moves (another HF_HUB_CACHE, or OUT on another machine): the recorded snapshot
    # path is gone, the id and commit the export recorded still name the weights.
    moved = tmp_path / "moved-cache"
    cache.rename(moved)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(moved))
    from qeff_vision.hub import HubReference
    from qeff_vision.runtime.artifacts import load_artifacts

    assert load_artifacts(out).checkpoint_dir == HubReference(REPO_ID, FIRST)
    picture = tmp_path / "picture.png"
    helpers.image(224, 224).save(picture)
    args = ["run", str(out), "--image", str(picture), "--prompt", "Describe.", "--max-new-tokens", "4"]
    assert main([*args, "--compare-hf"]) == 0
    assert "compare-hf: tokens identical to transformers generate" in capsys.readouterr().err


def test_download_bars_are_huggingface_hubs_and_quiet_under_q(cache, tmp_path, monkeypatch, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    seen = []
    disable_progress_bars()  # as transformers leaves them once a stage has quieted it

    def record(repo_id, **kwargs):
        seen.append(are_progress_bars_disabled())
        raise hub_errors.RepositoryNotFoundError("404 not found", response=_response(404))

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", record)
    assert main(["export", "some-org/model", "-o", str(tmp_path / "a"), "-q"]) == 2
    assert main(["export", "some-org/model", "-o", str(tmp_path / "b")]) == 2
    capsys.readouterr()
    # -q: off while downloading; otherwise on, and huggingface_hub shows them on a terminal.
    assert seen == [True, False]
    assert are_progress_bars_disabled()  # the state before each command is restored after it
    enable_progress_bars()


def test_the_real_environment_variables_reach_huggingface_hub(tiny_checkpoint, tmp_path):
    # HF_HOME (the cache is HF_HOME/hub) and HF_HUB_OFFLINE as a user sets them, in a fresh process.
    home = tmp_path / "hf-home"
    add_snapshot(home / "hub", REPO_ID, tiny_checkpoint(FAMILY), FIRST)
    spec = write_spec(tmp_path / "hub.yaml", model=REPO_ID, config=None, ctx_len=512)
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "qeff_vision"]
    done = subprocess.run([*command, "validate", str(spec)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # the config came from HF_HOME/hub
    other = write_spec(tmp_path / "other.yaml", model="other-org/absent", config=None, ctx_len=512)
    compile_other = [*command, "compile", str(other), "-o", str(tmp_path / "out")]
    done = subprocess.run(compile_other, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"not in the Hugging Face cache ({home / 'hub'}) and HF_HUB_OFFLINE is set" in done.stderr


def test_a_revision_on_a_directory_model_is_a_spec_problem(tiny_checkpoint, tmp_path, capsys):
    spec = write_spec(tmp_path / "dir.yaml", model=str(tiny_checkpoint(FAMILY)), config=None, ctx_len=512)
    spec.write_text(spec.read_text() + "revision: v1\n")
    assert main(["validate", str(spec)]) == 2
    assert "applies to a Hugging Face id only" in capsys.readouterr().err


def test_validate_reads_the_config_of_the_spec_revision_from_the_cache(cache, tmp_path, capsys):
    spec = write_spec(tmp_path / "hub.yaml", model=REPO_ID, config=None, ctx_len=512)
    spec.write_text(spec.read_text() + f"revision: {FIRST}\n")
    assert main(["validate", str(spec)]) == 0, capsys.readouterr().err
    spec.write_text(spec.read_text().replace(FIRST, SECOND))  # not cached: validate never downloads
    assert main(["validate", str(spec)]) == 2
    assert "no local copy; add `config:`" in capsys.readouterr().err


def _export_recording(directory: Path, repo_id: str, commit: str) -> Path:
    from tests.compile_fixtures import synthetic_export

    export = synthetic_export(directory)
    record = json.loads((export / "export.json").read_text())
    record["hub"] = {"id": repo_id, "revision": None, "commit": commit}
    (export / "export.json").write_text(json.dumps(record))
    return export


def test_export_dir_of_another_commit_is_refused(cache, tmp_path, capsys):
    export = _export_recording(tmp_path / "export", REPO_ID, SECOND)  # the cache's main is FIRST
    spec = write_spec(tmp_path / "hub.yaml", model=REPO_ID)  # the pinned 3B config, as the synthetic graphs
    compiler, record = stand_in(tmp_path)
    out = tmp_path / "out"
    assert (
        main(["compile", str(spec), "-o", str(out), "--export", str(export), "--compiler", str(compiler)])
        == 2
    )
    line = _one_error_line(capsys)
    assert (
        f"exported from {REPO_ID} commit {SECOND[:12]}" in line and f"resolves to commit {FIRST[:12]}" in line
    )
    assert not out.exists() and not calls(record)


def test_a_reused_export_names_its_commit_in_the_manifest_without_any_download(cache, tmp_path, capsys):
    absent = "elsewhere-org/not-cached-here"  # exported on another machine; this cache lacks it
    export = _export_recording(tmp_path / "export", absent, SECOND)
    spec = write_spec(tmp_path / "hub.yaml", model=absent)
    compiler, _ = stand_in(tmp_path)
    out = tmp_path / "out"
    args = ["compile", str(spec), "-o", str(out), "--export", str(export), "--compiler", str(compiler), "-q"]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["hub"] == {
        "id": absent,
        "revision": None,
        "commit": SECOND,
    }
