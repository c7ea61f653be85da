"""Progress bars (issue 42): the export's weight streaming shows a byte bar when stderr is a terminal
(a pseudo-terminal here), and none under ``-q`` or when stderr is a pipe; stdout never has one."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from qeff_vision import progress
from qeff_vision.cli import main

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "qwen2_5_vl"
BAR_MARKS = ("weights:", "%|", "B/s")


def _pty_pair() -> tuple[int, int]:
    """(master, slave) of a pseudo-terminal 120 columns wide (tqdm sizes its bar to the terminal)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, slave


def _drain(fd: int, into: list[bytes]) -> threading.Thread:
    """Read ``fd`` until its writer closes (EOF, or EIO on a pseudo-terminal) in a thread."""

    def read() -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            into.append(data)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_export_shows_a_weight_bar_on_a_terminal(tiny_checkpoint, tmp_path):
    master, slave = _pty_pair()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "qeff_vision",
        "export",
        str(tiny_checkpoint(FAMILY)),
        "-o",
        str(tmp_path / "out"),
    ]
    process = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave
    )
    os.close(slave)
    chunks: list[bytes] = []
    reader = _drain(master, chunks)
    stdout = process.stdout.read().decode()
    assert process.wait(timeout=600) == 0
    reader.join(timeout=30)
    os.close(master)
    stderr = b"".join(chunks).decode("utf-8", "replace")
    # One bar per program: bytes written of the total, a rate and a time estimate, redrawn in place.
    for program in ("vision", "lang"):
        assert f"{program} weights: 100%|" in stderr, stderr
    assert "B/s]" in stderr and "<00:00" in stderr and "\r" in stderr
    assert "[qeff-vision] write lang weights" in stderr  # the stage lines stay
    assert not any(mark in stdout for mark in BAR_MARKS) and "\r" not in stdout
    assert "export.json:" in stdout


@contextlib.contextmanager
def _stderr_to(fd: int):
    """``sys.stderr`` writing to ``fd`` (a terminal or a pipe) for an in-process CLI run."""
    stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
    saved = sys.stderr
    sys.stderr = stream
    try:
        yield
    finally:
        sys.stderr = saved
        stream.close()


def _in_process_stderr(args: list[str], *, terminal: bool, capsys) -> tuple[int, str, str]:
    read_end, write_end = _pty_pair() if terminal else os.pipe()
    chunks: list[bytes] = []
    reader = _drain(read_end, chunks)
    with _stderr_to(write_end):
        code = main(args)
    os.close(write_end)
    reader.join(timeout=30)
    os.close(read_end)
    return code, capsys.readouterr().out, b"".join(chunks).decode("utf-8", "replace")


def test_no_bar_under_quiet_on_a_terminal(tiny_checkpoint, tmp_path, capsys):
    args = ["export", str(tiny_checkpoint(FAMILY)), "-o", str(tmp_path / "out"), "-q"]
    code, stdout, stderr = _in_process_stderr(args, terminal=True, capsys=capsys)
    assert code == 0
    assert stderr == ""  # -q: neither stage lines nor bars
    assert "export.json:" in stdout and not any(mark in stdout for mark in BAR_MARKS)


def test_no_bar_when_stderr_is_a_pipe(tiny_checkpoint, tmp_path, capsys):
    args = ["export", str(tiny_checkpoint(FAMILY)), "-o", str(tmp_path / "out")]
    code, stdout, stderr = _in_process_stderr(args, terminal=False, capsys=capsys)
    assert code == 0
    assert "[qeff-vision] write vision weights" in stderr  # a log keeps the stage lines
    assert not any(mark in stderr for mark in BAR_MARKS) and "\r" not in stderr, stderr
    assert not any(mark in stdout for mark in BAR_MARKS)


def test_a_bar_is_drawn_only_on_a_terminal_and_when_enabled():
    master, slave = _pty_pair()
    with open(slave, "w", closefd=True) as terminal:
        assert progress.on_terminal(terminal)
        assert not progress.bar("x", total=1, stream=terminal).disable
        assert progress.bar("x", total=1, stream=terminal, enabled=False).disable
        with progress.silenced():  # -q for a whole command: no bar deep inside it either
            assert progress.bar("x", total=1, stream=terminal).disable
        assert not progress.bar("x", total=1, stream=terminal).disable
    os.close(master)
    assert progress.bar("x", total=1, stream=io.StringIO()).disable
    assert not progress.on_terminal(None)


def test_compile_on_a_terminal_shows_weight_and_calibration_bars(tiny_checkpoint, tmp_path, capsys):
    from tests.compile_fixtures import write_spec

    spec = write_spec(tmp_path / "tiny.yaml", model=str(tiny_checkpoint(FAMILY)), config=None, ctx_len=512)
    args = ["compile", str(spec), "-o", str(tmp_path / "out"), "--backend", "onnxruntime"]
    code, stdout, stderr = _in_process_stderr(args, terminal=True, capsys=capsys)
    assert code == 0, stderr
    assert "lang weights: 100%|" in stderr and re.search(r"calibration runs: 100%\|.*\d+/\d+", stderr), stderr
    assert "manifest:" in stdout and not any(mark in stdout for mark in BAR_MARKS)

    code, stdout, stderr = _in_process_stderr([*args, "--force", "-q"], terminal=True, capsys=capsys)
    assert code == 0 and "%|" not in stderr and "runs:" not in stderr, stderr
    assert "[qeff-vision]" not in stderr  # -q keeps only the notes worth reading


def test_compile_shows_a_bar_per_program_on_a_terminal(tmp_path):
    from qeff_vision.compile.driver import compile_spec
    from tests.compile_fixtures import stand_in, synthetic_export, write_spec

    spec, export = write_spec(tmp_path / "spec.yaml"), synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path, mode="slow", sleep=1)
    master, slave = _pty_pair()
    chunks: list[bytes] = []
    reader = _drain(master, chunks)
    with open(slave, "w", closefd=True) as terminal:
        compile_spec(
            spec,
            tmp_path / "out",
            compiler=compiler,
            export_dir=export,
            progress=None,
            status_stream=terminal,
        )
    reader.join(timeout=30)
    os.close(master)
    shown = b"".join(chunks).decode("utf-8", "replace")
    # Each program's bar: its name, the elapsed time, and the compiler's own last line.
    for program in ("vision", "lang"):
        assert f"{program}: 00:0" in shown, shown
    assert re.search(r"running, \d+ lines \| stand-in: graph checks passed", shown), shown
    assert "[qeff-vision] vision: ok in" in shown  # the finish events stay below the cleared bars


def test_compile_status_without_a_terminal_is_event_lines_only(tmp_path):
    from qeff_vision.compile.driver import compile_spec
    from tests.compile_fixtures import stand_in, synthetic_export, write_spec

    spec, export = write_spec(tmp_path / "spec.yaml"), synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path)
    status = io.StringIO()
    compile_spec(
        spec, tmp_path / "out", compiler=compiler, export_dir=export, progress=None, status_stream=status
    )
    lines = status.getvalue().splitlines()
    assert lines and all(line.startswith("[qeff-vision] ") for line in lines), lines
    assert "\r" not in status.getvalue()
