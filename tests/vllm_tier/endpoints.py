"""Start, watch and stop the printed ``vllm serve`` endpoints (runs in the project venv).

The commands are the ``plugin_serve`` section of what ``compile --print-serve`` prints for OUT
(:func:`qeff_vision.compile.vllm_handoff.serve_text` of the spec's hand-off with OUT's ``vision``
and ``lang`` directories and its ``model`` copy, the form the golden ``vllm_serve.txt`` files
show), run in OUT as the title says. Two words are changed, and only these: the port of
``--port`` (a free loopback port instead of 8001/8002, which other programs on a shared machine
may hold) and ``--host 127.0.0.1`` appended (loopback only). vLLM's own multiprocessing stays on
(the API server and its engine-core process); the device runtime is the stand-in
(tests/device_double, first on ``PYTHONPATH``).

Every server is a process-group leader (``start_new_session``), so a stop reaches the engine
core too; a server also gets SIGTERM when the test process dies (``PR_SET_PDEATHSIG``), and the
module fixtures stop every server in their teardown, failed test or not.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from qeff_vision.compile.vllm_handoff import handoff_for_spec, serve_sections, serve_text
from qeff_vision.spec import load_spec

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 300.0  # two servers starting at once on a loaded 2-core host
STOP_TIMEOUT_S = 30.0


def printed_serve_lines(spec_file: Path) -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, argv) of each ``vllm serve`` line --print-serve writes for OUT."""
    handoff = handoff_for_spec(load_spec(spec_file), "vision", "lang", "model")
    section = serve_sections(serve_text({"vllm": handoff}))["plugin_serve"]
    lines = []
    for line in section.splitlines():
        words = shlex.split(line)
        if words and words[-1] == "&":
            words = words[:-1]
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        assert words[:2] == ["vllm", "serve"], line
        lines.append((env, words))
    return lines


def on_loopback(argv: list[str], port: int) -> list[str]:
    """``argv`` with its ``--port`` value replaced by ``port`` and ``--host 127.0.0.1`` appended."""
    at = argv.index("--port")
    return [*argv[: at + 1], str(port), *argv[at + 2 :], "--host", LOOPBACK]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Nothing listens on the loopback ``port`` (a server could bind it now).

    SO_REUSEADDR as uvicorn sets it: the closed connections' TIME_WAIT entries do not hold the port.
    """
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies (Linux prctl PR_SET_PDEATHSIG = 1)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """GET ``url``'s status, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc.

    Zombies are left out: a killed server's engine core is reparented to PID 1, which need not reap
    it promptly, and a zombie holds no port, memory or file.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone while we looked
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


@dataclass
class Server:
    """One printed ``vllm serve`` line, started as its own process group on a loopback port."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> Server:
        handle = self.log.open("ab")
        self.process = subprocess.Popen(
            on_loopback(self.argv, self.port),
            cwd=self.cwd,
            env=self.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        handle.close()
        return self

    def wait_ready(self, deadline: float) -> None:
        """Until ``/health`` answers 200 (AssertionError with the log's tail if it exits or times out)."""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            if http_status(f"{self.base_url}/health", timeout=2.0) == 200:
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.name} not ready in {START_TIMEOUT_S:g} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def send(self, number: int) -> None:
        if self.process is not None and group_alive(self.process.pid):
            os.killpg(self.process.pid, number)

    def stop(self, number: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> tuple[bool, float]:
        """Signal the group, wait for every process of it to go; SIGKILL what is left after ``timeout``.

        Returns (whether the group was gone within ``timeout`` without SIGKILL, seconds waited).
        """
        if self.process is None:
            return True, 0.0
        began = time.monotonic()
        self.send(number)
        clean = True
        while group_alive(self.process.pid):
            if time.monotonic() - began > timeout:
                clean = False
                self.send(signal.SIGKILL)
                time.sleep(0.5)
                break
            self.process.poll()  # reap the leader so the group can empty
            time.sleep(0.2)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            clean = False
        return clean, time.monotonic() - began


def start_pair(spec_file: Path, out: Path, base_env: dict[str, str], vllm_bin: Path) -> dict[str, Server]:
    """The two printed endpoints of OUT (``encode`` on the vision program, ``language``), started at once."""
    (encode_env, encode_argv), (language_env, language_argv) = printed_serve_lines(spec_file)
    assert "--runner" in encode_argv and "--enable-mm-embeds" in language_argv
    path = f"{vllm_bin}{os.pathsep}{base_env.get('PATH', '')}"  # the printed `vllm` is the vLLM venv's
    logs = out.with_name(f"{out.name}-logs")
    logs.mkdir(exist_ok=True)
    lines = {"encode": (encode_env, encode_argv), "language": (language_env, language_argv)}
    servers = {
        name: Server(name, argv, {**base_env, **env, "PATH": path}, cwd=out, log=logs / f"{name}.log")
        for name, (env, argv) in lines.items()
    }
    try:
        for server in servers.values():
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers.values():
            server.wait_ready(deadline)
    except BaseException:
        for server in servers.values():
            server.stop(signal.SIGKILL, timeout=10)
        raise
    return servers
