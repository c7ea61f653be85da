"""Progress of long stages off a terminal (issue 48): timed lines, with an injected clock.

On a non-terminal (a CI log, ``nohup``) a long stage writes ``DESC: P% (done/total UNIT), T
elapsed`` lines: at most one per 10 s as steps finish, at least one per 30 s while it runs (a
heartbeat, even when a single step is long). The clock is injected: no test sleeps. A compile
whose calibration runs on a pipe shows such lines for the calibration's slices; ``-q`` none.
"""

from __future__ import annotations

import io
import re

from qeff_vision import progress
from qeff_vision.progress import HEARTBEAT_INTERVAL, LINE_INTERVAL, SliceCounter, StageProgress

LINE = re.compile(
    r"^(?P<desc>[\w ]+): (?P<percent>\d+)% \((?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+)\), "
    r"(?P<elapsed>\S+) elapsed$"
)


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stage(clock, lines, total=20):
    return StageProgress(
        "calibration", total, unit="slices", say=lines.append, stream=io.StringIO(), clock=clock, thread=False
    )


def test_lines_at_most_every_ten_seconds_and_a_heartbeat_within_thirty():
    clock, lines, times = FakeClock(), [], []
    stage = _stage(clock, lines)

    def say(line):
        lines.append(line)
        times.append(clock.now)

    stage.say = say
    for step in range(1, 21):
        clock.now += 3.0  # a step every 3 s: one line per 4 steps (12 s)
        stage.update()
        if step == 10:  # one step takes 100 s: the heartbeat speaks while it runs
            for _ in range(50):
                clock.now += 2.0
                stage.heartbeat()
    stage.close()
    assert lines, lines
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert all(gap >= LINE_INTERVAL for gap in gaps), gaps
    assert all(gap <= 30.0 for gap in gaps), gaps  # the promise; the heartbeat speaks at 25 s
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert parsed[0]["done"] == "4" and parsed[0]["percent"] == "20" and parsed[0]["elapsed"] == "12s"
    assert any(p["elapsed"].endswith("s") and "m" in p["elapsed"] for p in parsed)  # 1m..s once past a minute
    # The end: its own line unless one was written in the last 10 s.
    assert int(parsed[-1]["done"]) >= 17 and parsed[-1]["total"] == "20"
    clock.now += LINE_INTERVAL
    stage.close()
    assert LINE.match(lines[-1])["percent"] == "100"


def test_a_short_stage_writes_nothing_and_a_silent_one_never():
    clock, lines = FakeClock(), []
    stage = _stage(clock, lines, total=3)
    for _ in range(3):
        clock.now += 1.0
        stage.update()
    stage.heartbeat()
    stage.close()
    assert lines == []
    quiet = StageProgress("x", 2, say=None, stream=io.StringIO(), clock=clock, thread=False)
    clock.now += 100.0
    quiet.update()
    quiet.heartbeat()
    quiet.close()  # nowhere to write: nothing raised


def test_a_stage_with_nothing_known_yet_says_zero_until_it_ends():
    """A calibration's heartbeat before its first pass (total 0) said 100% at full depth."""
    clock, lines = FakeClock(), []
    stage = _stage(clock, lines, total=0)
    clock.now += HEARTBEAT_INTERVAL
    stage.heartbeat()
    assert LINE.match(lines[-1])["percent"] == "0", lines
    clock.now += HEARTBEAT_INTERVAL
    stage.close()
    assert LINE.match(lines[-1])["percent"] == "100", lines


def test_slice_counter_adds_each_pass_and_its_cuts_to_the_total():
    clock, lines = FakeClock(), []
    stage = _stage(clock, lines, total=0)
    counter = SliceCounter(stage)
    for done in range(1, 5):  # a pass of 4 slices
        counter(done, 4)
    counter(1, 3)  # a second pass: 3 slices, a cut makes them 4
    counter(2, 4)
    assert (stage.done, stage.total) == (6, 8)
    for done in (3, 4):
        counter(done, 4)
    assert (stage.done, stage.total) == (8, 8)


def test_calibration_writes_timed_lines_on_a_pipe(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A compile's calibration on a pipe, the clock moving 4 s per reading: percent lines, 10 s apart."""
    from qeff_vision.cli import main
    from tests.compile_fixtures import write_spec

    clock = FakeClock()

    def ticking() -> float:
        clock.now += 4.0
        return clock.now

    monkeypatch.setattr(progress, "CLOCK", ticking)
    spec = write_spec(
        tmp_path / "tiny.yaml", model=str(tiny_checkpoint("qwen2_5_vl")), config=None, ctx_len=512
    )
    args = ["compile", str(spec), "-o", str(tmp_path / "out"), "--backend", "onnxruntime"]
    assert main(args) == 0
    err = capsys.readouterr().err
    shown = [line.removeprefix("[qeff-vision] ") for line in err.splitlines() if "calibration:" in line]
    assert shown, err
    for line in shown:
        match = LINE.match(line)
        assert match and match["unit"] == "slices" and 0 <= int(match["percent"]) <= 100, line
    assert "%|" not in err  # no bar on a pipe
    # Shape inference per specialization before the calibration: its own lines, ending at 100%.
    measured = [
        line.removeprefix("[qeff-vision] ") for line in err.splitlines() if "activation memory:" in line
    ]
    assert measured and all(LINE.match(line) for line in measured), err
    assert (
        LINE.match(measured[-1])["percent"] == "100" and LINE.match(measured[-1])["unit"] == "specializations"
    )


def test_hashing_a_large_file_writes_timed_lines(tmp_path, monkeypatch):
    """A graph's external data above PROGRESS_BYTES is hashed with progress lines (40 s at full depth)."""
    import hashlib

    from qeff_vision.compile import cache

    clock = FakeClock()

    def ticking() -> float:
        clock.now += 4.0
        return clock.now

    monkeypatch.setattr(progress, "CLOCK", ticking)
    monkeypatch.setattr(cache, "PROGRESS_BYTES", 2 << 20)
    data = bytes(range(256)) * (4096 * 9 + 7)  # 9 MiB and a bit: 10 chunks, the last one short
    (tmp_path / "big.data").write_bytes(data)
    (tmp_path / "small.data").write_bytes(data[: 1 << 20])
    lines: list[str] = []
    hasher = cache.ContentHasher(say=lines.append)
    assert hasher.file(tmp_path / "small.data") == hashlib.sha256(data[: 1 << 20]).hexdigest()
    assert lines == []  # below the size: silent
    assert hasher.file(tmp_path / "big.data") == hashlib.sha256(data).hexdigest()
    matches = [
        re.match(r"^hashing big\.data: (\d+)% \((\d+)/(\d+) MiB\), \S+ elapsed$", line) for line in lines
    ]
    assert matches and all(matches), lines
    assert [m[3] for m in matches] == ["10"] * len(matches)
    done = [int(m[2]) for m in matches]
    assert done == sorted(done) and done[-1] >= 9  # lines at most every 10 s: the last may be 90%
    lines.clear()
    hasher.file(tmp_path / "big.data")  # memoized: not read again, nothing to report
    assert lines == []
