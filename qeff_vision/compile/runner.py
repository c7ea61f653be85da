"""Run the compilers of both programs concurrently, logging everything they print.

Each compiler's stdout and stderr go, interleaved as printed, into ``<program>/compile.log``; the
last lines are kept in memory for the failure message. Each program has a progress bar while it
runs (elapsed time and the compiler's last line, on a terminal), one line per event otherwise. A
program that runs past its timeout is killed with its whole process group; when one program fails
the other is stopped too, since the compile as a whole has failed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from qeff_vision import interrupts
from qeff_vision.interrupts import raise_if_interrupted
from qeff_vision.progress import bar as progress_bar
from qeff_vision.progress import on_terminal

TAIL_LINES = 30
POLL_SECONDS = 0.1
REFRESH_SECONDS = 0.5
# After a stop signal the compilers get SIGTERM and this long to exit (a compiler may remove its
# own temporary files) before SIGKILL; a second stop signal does not wait (qeff_vision.interrupts).
TERM_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class Job:
    """One compiler invocation.

    Attributes:
        program: ``vision`` or ``lang``.
        argv: Full command line.
        log_path: Where stdout and stderr go.
        timeout: Seconds before the compiler is killed; ``None`` waits forever.
    """

    program: str
    argv: Sequence[str]
    log_path: Path
    timeout: float | None = None


@dataclass
class JobResult:
    """How a job ended.

    Attributes:
        state: ``ok``, ``failed`` (non-zero exit), ``timeout``, ``stopped`` (a sibling failed) or
            ``error`` (could not start).
        returncode: Exit code (negative for a signal), ``None`` when it never started.
        seconds: Wall time.
        lines: Lines printed.
        tail: The last lines printed.
    """

    program: str
    log_path: Path
    state: str = "running"
    returncode: int | None = None
    seconds: float = 0.0
    lines: int = 0
    tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the compiler exited 0."""
        return self.state == "ok"

    def describe(self, timeout: float | None = None) -> str:
        """One line: what happened and where the log is."""
        if self.state == "timeout":
            what = f"timed out after {timeout:g} s and was killed" if timeout else "timed out"
        elif self.state == "failed":
            what = f"compiler exited with code {self.returncode}"
        elif self.state == "stopped":
            what = "stopped because the other program failed"
        elif self.state == "error":
            what = "compiler could not be started"
        else:
            what = self.state
        return f"{self.program}: {what} (log: {self.log_path})"


class StatusLine:
    """Compile progress on ``stream``: a bar per program on a terminal, event lines otherwise.

    On a terminal each program has a tqdm bar (:mod:`qeff_vision.progress`) showing its elapsed
    time, the lines its compiler printed and the last of them (the compiler's own progress, when it
    reports any), redrawn in place; event lines are written above the bars. Elsewhere (a log, a
    pipe) only the event lines appear.
    """

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.live = on_terminal(stream)
        self._last = 0.0
        self._bars: dict[str, Any] = {}

    def event(self, text: str) -> None:
        """A line that stays (start, finish)."""
        if self.stream is None:
            return
        line = f"[qeff-vision] {text}"
        if self._bars:
            from tqdm import tqdm

            tqdm.write(line, file=self.stream)  # above the bars, which are redrawn below it
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def programs(self, runs: Sequence[_Running], force: bool = False) -> None:
        """Redraw every program's bar (terminals only; throttled unless ``force``)."""
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last < REFRESH_SECONDS:
            return
        self._last = now
        for run in runs:
            shown = self._bars.get(run.job.program)
            if shown is None:
                shown = self._bars[run.job.program] = progress_bar(
                    run.job.program,
                    unit="line",
                    stream=self.stream,
                    position=len(self._bars),
                    leave=False,
                    bar_format="{desc}: {elapsed}{postfix}",
                )
            state = "running" if run.running() else run.result.state
            last = run.last_line.strip()
            shown.set_postfix_str(f"{state}, {run.result.lines} lines" + (f" | {last[:80]}" if last else ""))

    def close(self) -> None:
        """Remove the bars (the finish events say how each program ended)."""
        for shown in self._bars.values():
            shown.close()
        self._bars.clear()


class _Running:
    def __init__(self, job: Job, env: Mapping[str, str] | None):
        self.job = job
        self.result = JobResult(job.program, job.log_path)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.last_line = ""
        self.start = time.monotonic()
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(job.log_path, "wb")  # noqa: SIM115 - closed by the reader thread
        self.log.write(("$ " + subprocess.list2cmdline(list(job.argv)) + "\n").encode())
        self.log.flush()
        try:
            self.process: subprocess.Popen | None = subprocess.Popen(
                list(job.argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a kill reaches its children too
                env=dict(env) if env is not None else None,
            )
        except OSError as exc:
            self.process = None
            message = f"cannot start {job.argv[0]}: {exc}"
            self.log.write((message + "\n").encode())
            self.log.close()
            self.tail.append(message)
            self.result.state = "error"
            self.result.tail = list(self.tail)
            self.reader = None
            return
        # With start_new_session its pid is its process-group id: a second stop signal, which ends
        # us at once, still kills it (qeff_vision.interrupts).
        interrupts.track_child(self.process.pid)
        self.reader = threading.Thread(target=self._read, name=f"compile-log-{job.program}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            for raw in iter(self.process.stdout.readline, b""):
                self.log.write(raw)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.tail.append(line)
                self.last_line = line
                self.result.lines += 1
        finally:
            self.log.flush()
            self.log.close()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, state: str, how: signal.Signals = signal.SIGKILL) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if self.result.state == "running":  # a timed-out job stays "timeout" when its sibling stops it
            self.result.state = state
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, how)

    def terminate(self, deadline: float) -> None:
        """Wait for a process group sent SIGTERM until ``deadline`` (monotonic), then SIGKILL it."""
        if self.process is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # what is left of the group, the leader included

    def finish(self) -> JobResult:
        if self.process is not None:
            self.process.wait()
            interrupts.untrack_child(self.process.pid)
            if self.reader is not None:
                self.reader.join()
            self.result.returncode = self.process.returncode
            if self.result.state == "running":
                self.result.state = "ok" if self.process.returncode == 0 else "failed"
            else:  # killed by us: say so at the end of its log
                note = f"[qeff-vision] compiler killed ({self.result.state}) after {self.elapsed:.1f} s"
                with open(self.job.log_path, "a", encoding="utf-8") as log:
                    log.write(note + "\n")
                self.tail.append(note)
        self.result.seconds = self.elapsed
        self.result.tail = list(self.tail)
        return self.result


def run_jobs(
    jobs: Sequence[Job], status: StatusLine | None = None, env: Mapping[str, str] | None = None
) -> dict[str, JobResult]:
    """Run every job at once; return each program's result when all have ended.

    Args:
        jobs: The compiler invocations.
        status: Progress display; ``None`` shows nothing.
        env: Environment of the compilers (the current one by default).
    """
    status = status or StatusLine(None)
    runs = []
    for job in jobs:
        status.event(f"{job.program}: compiling, log {job.log_path}")
        runs.append(_Running(job, env))
    failed = any(run.result.state == "error" for run in runs)
    try:
        while any(run.running() for run in runs):
            for run in runs:
                if run.running() and run.job.timeout is not None and run.elapsed > run.job.timeout:
                    run.kill("timeout")
                    failed = True
                elif not run.running() and run.process is not None and run.process.returncode != 0:
                    failed = True
            if failed:
                for run in runs:
                    run.kill("stopped")
            status.programs(runs)
            time.sleep(POLL_SECONDS)
            raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt was lost must not wait forever
    except BaseException:
        # A stop signal or an internal error: the compilers run in their own process groups, so
        # they would outlive us; terminate and reap them before giving up.
        status.close()
        deadline = time.monotonic() + TERM_GRACE_SECONDS
        for run in runs:
            run.kill("stopped", signal.SIGTERM)
        for run in runs:
            run.terminate(deadline)
            run.finish()
        raise
    status.close()
    results = {}
    for run in runs:
        result = run.finish()
        results[run.job.program] = result
        status.event(f"{run.job.program}: {result.state} in {result.seconds:.1f} s ({result.lines} lines)")
    return results
