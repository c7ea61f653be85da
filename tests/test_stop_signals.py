"""SIGTERM and SIGHUP end a command as Ctrl-C does (issue 53): one line, 128 + N, nothing left.

A service manager (``systemctl stop``, ``docker stop``, Kubernetes) sends SIGTERM, a closed
terminal SIGHUP. At every stage (export, compile's export and calibration, the compilers running,
``run --requests`` serving) the command must end with exit 143 (129), one ``qeff-vision:`` line,
no process of ours left, nothing beside OUT and OUT absent or unchanged. Every run waits for a
marker the command or the stand-in compiler writes (a progress line, a finished request, the
stand-in's ``hanging`` record), never for a time.

The default tier sends SIGTERM at every stage and SIGHUP where it is cheap (compilers, run); the
slow tier sends SIGHUP at the exporting stages too (each is a subprocess exporting a checkpoint).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import helpers
from tests.compile_fixtures import REPO, hanging, stand_in, synthetic_export, tree_state, write_spec
from tests.test_bad_input import compiled, inputs, one_error_line, temporary_directory  # noqa: F401

LINES = {signal.SIGTERM: "qeff-vision: terminated (SIGTERM)", signal.SIGHUP: "qeff-vision: hung up (SIGHUP)"}


def _command(args: list) -> list[str]:
    return [sys.executable, "-m", "qeff_vision", *map(str, args)]


def _records(record: Path, event: str) -> list[dict]:
    if not record.exists():
        return []
    entries = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if entry.get("event") == event]


def _gone(pids) -> bool:
    """No process of ``pids`` is alive (a zombie not yet reaped by init counts as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def _wait_gone(pids, limit: float = 30.0) -> bool:
    """Poll until ``pids`` are gone (init reaps an orphan on its own schedule); bounded, not a sleep."""
    end = time.monotonic() + limit
    while not _gone(pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _signal_at(args: list, marker, signum: int, stream: str = "stderr") -> tuple[int, str, list[int]]:
    """Run a command, send ``signum`` once ``marker(text so far)`` holds on ``stream``; wait for the end.

    Returns the exit code, stderr, and the pids of every process the command had started.
    """
    process = subprocess.Popen(
        _command(args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watched = process.stdout if stream == "stdout" else process.stderr
    seen = []
    while not marker("".join(seen)):
        line = watched.readline()
        assert line, f"the command ended before the marker: {''.join(seen)}"
        seen.append(line)
    children = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    if stream == "stderr":
        err = "".join(seen) + err
    return process.returncode, err, children


def _assert_one_line(code: int, err: str, signum: int) -> None:
    assert code == 128 + signum, err  # not -15: the interpreter must not die of the signal
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("qeff-vision:")]
    assert errors == [LINES[signum]], err


def _beside(directory: Path) -> set[str]:
    """What sits beside OUT, less the stand-in SDKs and their call record (the test's own files)."""
    return {p.name for p in directory.iterdir() if not p.name.startswith("sdk-")} - {"stand_in_calls.jsonl"}


def _stage_line(text: str):
    return lambda err: f"[qeff-vision] {text}" in err


EXPORT_STAGES = {
    "export": ("export", _stage_line("export language")),
    "compile-export": ("compile", _stage_line("export language")),
    "calibration": ("compile", _stage_line("calibrating device precision")),
}
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}


def _tier(name: str, stage_is_cheap: bool):
    """SIGHUP at an exporting stage goes to the slow tier (the default tier keeps SIGTERM there)."""
    return [pytest.mark.slow] if name == "SIGHUP" and not stage_is_cheap else []


@pytest.mark.parametrize(
    "name,stage",
    [pytest.param(name, stage, marks=_tier(name, False)) for name in SIGNALS for stage in EXPORT_STAGES],
)
def test_signal_while_exporting(name, stage, inputs, tmp_path, temporary_directory):  # noqa: F811
    paths, _, _ = inputs
    command, marker = EXPORT_STAGES[stage]
    out = tmp_path / "out"
    if command == "export":
        args = ["export", paths["model"], "-o", out]
    else:
        args = ["compile", paths["spec"], "-o", out, "--backend", "onnxruntime"]
    code, err, children = _signal_at(args, marker, SIGNALS[name])
    _assert_one_line(code, err, SIGNALS[name])
    assert tree_state(out) is None and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    assert not list(temporary_directory.glob("qeff-vision-*"))
    assert _wait_gone(children)


@pytest.mark.parametrize("previous", ["none", "valid"])
@pytest.mark.parametrize("name", list(SIGNALS))
def test_signal_while_the_compilers_run(name, previous, tmp_path, temporary_directory):  # noqa: F811
    """Both stand-ins hang with a partial output: reaped, no staging, no lock, OUT as it was."""
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export")
    out = tmp_path / "out"
    if previous == "valid":
        good, _ = stand_in(tmp_path)
        done = subprocess.run(
            _command(["compile", spec, "-o", out, "--export", export, "--compiler", good, "-q"]),
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    before = tree_state(out)
    beside = _beside(tmp_path)
    compiler, record = stand_in(tmp_path, mode="hang")
    force = ["--force"] if previous == "valid" else []
    process = subprocess.Popen(
        _command(["compile", spec, "-o", out, "--export", export, "--compiler", compiler, "-q", *force]),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    while hanging(record) < 2:  # both stand-ins wrote their partial output and said so
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    pids = [entry["pid"] for entry in _records(record, "hanging")]
    process.send_signal(SIGNALS[name])
    _, err = process.communicate(timeout=120)
    _assert_one_line(process.returncode, err, SIGNALS[name])
    assert _gone(pids), "a compiler outlived the compile"  # reaped by us before we exited: no wait
    assert tree_state(out) == before
    assert _beside(tmp_path) == beside, "staging or lock left beside OUT"
    assert not list(temporary_directory.glob("qeff-vision-*"))


def test_a_second_signal_ends_at_once_and_still_kills_the_compilers(tmp_path, temporary_directory):  # noqa: F811
    """The stand-ins ignore SIGTERM: the first signal waits for them, the second one does not wait."""
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export")
    compiler, record = stand_in(tmp_path, mode="stubborn")
    out = tmp_path / "out"
    process = subprocess.Popen(
        _command(["compile", spec, "-o", out, "--export", export, "--compiler", compiler, "-q"]),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    while hanging(record) < 2:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    pids = [entry["pid"] for entry in _records(record, "hanging")]
    process.send_signal(signal.SIGTERM)
    while len(_records(record, "ignored")) < 2:  # cleaning up: both compilers were asked to stop
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    _assert_one_line(process.returncode, err, signal.SIGTERM)
    assert _wait_gone(pids, limit=10), "the second signal left a compiler running"
    assert tree_state(out) is None
    assert _beside(tmp_path) == {"spec.yaml", "export", "tmp"}, "staging or lock left beside OUT"


@pytest.mark.parametrize("name", list(SIGNALS))
def test_signal_while_serving_requests(name, compiled, tmp_path):  # noqa: F811
    """``run --requests`` stopped after its first reply, with many requests still to serve."""
    before = tree_state(compiled)
    image = tmp_path / "ok.png"
    helpers.image(112, 112).save(image)
    requests = tmp_path / "requests.jsonl"
    lines = [
        {"prompt": f"request {i}", "images": ["ok.png"] if i % 2 else [], "max_new_tokens": 16}
        for i in range(400)
    ]
    lines[0]["max_new_tokens"] = 1  # the marker: one reply printed early, the rest still to serve
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, err, children = _signal_at(
        ["run", compiled, "--requests", requests], lambda out: "[request 0]" in out, SIGNALS[name], "stdout"
    )
    _assert_one_line(code, err, SIGNALS[name])
    assert tree_state(compiled) == before and not children
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.png", "requests.jsonl", "tmp"]
