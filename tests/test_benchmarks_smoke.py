"""Every benchmark the README (or a docs/benchmarks, docs/guide page) names runs as written (issue 36 item 7).

The README's benchmark commands (``python benchmarks/NAME.py ...`` or ``.venv/bin/python ...`` in
an inline code span or a code block) run in a subprocess from the repository root with
``--smoke`` appended: each benchmark's smallest arguments that still take every code path. Each
must exit 0 and print a table. A benchmark that imports ``tests`` (or anything but the package and
its sibling scripts) fails here as it fails for a user. Every ``benchmarks/*.py`` must be named in
the README, and one the README names without a command runs as ``python benchmarks/NAME.py``.

Cost: one subprocess per command, most of it exports of tiny checkpoints; ``slow`` (about 5 min
on this 2-core machine), so ``make test-all`` runs it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# Benchmark pages of the docs name their commands too (README.md is a short front door).
DOC_PAGES = ("docs/benchmarks", "docs/guide")


def documented_text() -> str:
    """README.md and every docs page that may document a benchmark, concatenated."""
    pages = [README, *(p for d in DOC_PAGES for p in sorted((REPO / d).glob("*.md")))]
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)


COMMAND = re.compile(r"^(?:\$\s+)?((?:\.venv/bin/)?python\s+benchmarks/(\w+)\.py\b.*)$")
TIMEOUT = 600


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(benchmark name, command) for every benchmark command in ``text``, in order, without repeats.

    Inline code spans may wrap onto the next line; a code block's line may end in a ``#`` comment
    and start with a ``$`` prompt; ``[...]`` marks optional arguments, left out.
    """
    blocks = re.split(r"^```.*$", text, flags=re.M)
    candidates: list[str] = []
    for index, block in enumerate(blocks):
        if index % 2:  # inside a fenced block: one command a line
            candidates += block.splitlines()
        else:
            candidates += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", block)]
    found: dict[str, str] = {}
    for candidate in candidates:
        match = COMMAND.match(candidate.strip())
        if match:
            command = re.sub(r"\s+#.*$", "", match.group(1))
            command = " ".join(re.sub(r"\[[^\]]*\]", "", command).split())
            found.setdefault(command, match.group(2))
    return [(name, command) for command, name in found.items()]


def benchmark_files() -> list[str]:
    return sorted(path.stem for path in (REPO / "benchmarks").glob("*.py"))


def _cases() -> list[tuple[str, str]]:
    text = documented_text()
    commands = readme_commands(text)
    named = {name for name, _ in commands}
    # Named without a command (only the path): run as the plain command.
    bare = [
        (name, f"python benchmarks/{name}.py")
        for name in benchmark_files()
        if name not in named and f"benchmarks/{name}.py" in text
    ]
    return commands + bare


MARKDOWN_RULE = re.compile(r"^\|(\s*:?-{3,}:?\s*\|){3,}$")


def has_table(output: str) -> bool:
    """A table of three or more columns: two consecutive lines of three or more cells (split on runs of
    spaces or on ``|``), or a Markdown header followed by its ``|---|`` rule (a one-row table).
    """
    lines = [line.strip() for line in output.splitlines()]
    counts = [len([c for c in re.split(r"\s{2,}|\s\|\s", line) if c]) for line in lines]
    rows = any(a >= 3 and b >= 3 for a, b in zip(counts, counts[1:]))
    ruled = any(a >= 3 and MARKDOWN_RULE.match(b) for a, b in zip(counts, lines[1:]))
    return rows or ruled


def test_every_benchmark_is_named_in_the_readme():
    text = documented_text()
    missing = [name for name in benchmark_files() if f"benchmarks/{name}.py" not in text]
    assert not missing, f"benchmarks not named in README.md or docs/benchmarks, docs/guide: {missing}"


def test_readme_commands_are_found():
    text = "run `python benchmarks/a.py --x 1` or `python\nbenchmarks/b.py`\n```\n$ python benchmarks/c.py\n"
    text += (
        ".venv/bin/python benchmarks/d.py --steps 5   # a comment\n```\n`python benchmarks/e.py [--work DIR]`"
    )
    assert readme_commands(text) == [
        ("a", "python benchmarks/a.py --x 1"),
        ("b", "python benchmarks/b.py"),
        ("c", "python benchmarks/c.py"),
        ("d", ".venv/bin/python benchmarks/d.py --steps 5"),
        ("e", "python benchmarks/e.py"),
    ]
    assert {name for name, _ in _cases()} == set(benchmark_files())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "command"), _cases(), ids=[command for _, command in _cases()])
def test_readme_benchmark_command_runs_with_smoke(name, command, tmp_path):
    # A bare `python` is the project's interpreter; `.venv/bin/python` runs as written.
    argv = re.sub(r"^python\b", shlex.quote(sys.executable), command)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),  # this tree's package, as `PYTHONPATH=$PWD` in the project's rules
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "TMPDIR": str(tmp_path),  # temporary checkpoints and plots go away with the test
    }
    done = subprocess.run(
        ["bash", "-c", f"{argv} --smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    tail = (done.stdout[-1500:] + "\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"{command} --smoke exited {done.returncode}:\n{tail}"
    assert has_table(done.stdout), f"{command} --smoke printed no table:\n{tail}"
