"""Every benchmark the docs name runs as written from the repository root (issue 36 item 7).

The benchmark commands of the documentation site's pages (docs/benchmarks/ and docs/guide/, where
the README's benchmark narratives moved in issue 55; ``python benchmarks/NAME.py ...`` or
``.venv/bin/python ...`` in an inline code span or a code block) run in a subprocess from the
repository root with ``--smoke --write-docs`` appended, into a copy of docs/: each benchmark's
smallest arguments that still take every code path. Each must exit 0, print a table and rewrite
its page's region with tables of the committed page's shape. A benchmark that imports ``tests``
(or anything but the package and its sibling scripts) fails here as it fails for a user. Every
``benchmarks/*.py`` must be named in those pages, and one they name without a command runs as
``python benchmarks/NAME.py``.

Cost: one subprocess per command, most of it exports of tiny checkpoints; ``slow`` (about 5 min
on this 2-core machine), so ``make test-all`` runs it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_benchmark_docs import _docs_page, check_region_shape

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
COMMAND = re.compile(r"^(?:\$\s+)?((?:\.venv/bin/)?python\s+benchmarks/(\w+)\.py\b.*)$")
TIMEOUT = 600


def region(text: str, name: str) -> str:
    return _docs_page().region(text, name)


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
            # A page's `--write-docs` line is its plain command (every run here writes the docs).
            command = " ".join(re.sub(r"\[[^\]]*\]", "", command).replace("--write-docs", "").split())
            found.setdefault(command, match.group(2))
    return [(name, command) for command, name in found.items()]


def docs_text() -> str:
    """The benchmark and user-guide pages of the site, in path order, as one text."""
    pages = sorted((DOCS / "benchmarks").glob("*.md")) + sorted((DOCS / "guide").glob("*.md"))
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    # A region a benchmark wrote names the run that wrote it; the commands are the pages' own.
    return re.sub(r"(?s)<!-- benchmark-output:(\w+) -->.*?<!-- /benchmark-output:\1 -->", "", text)


def benchmark_files() -> list[str]:
    return sorted(path.stem for path in (REPO / "benchmarks").glob("*.py"))


def _cases() -> list[tuple[str, str]]:
    text = docs_text()
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


def test_every_benchmark_is_named_in_the_docs():
    text = docs_text()
    missing = [name for name in benchmark_files() if f"benchmarks/{name}.py" not in text]
    assert not missing, f"benchmarks not named in docs/benchmarks or docs/guide: {missing}"


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
    # Into a copy of docs/: the run rewrites its page's marked region (tests/test_benchmark_docs.py).
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    committed = _docs_page().page(docs, name).read_text(encoding="utf-8")
    done = subprocess.run(
        ["bash", "-c", f"{argv} --smoke --write-docs --docs-dir {shlex.quote(str(docs))}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    tail = (done.stdout[-1500:] + "\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"{command} --smoke exited {done.returncode}:\n{tail}"
    assert has_table(done.stdout), f"{command} --smoke printed no table:\n{tail}"
    page = _docs_page().page(docs, name)
    # The committed tables are the shape to keep when the page was written by this same command.
    stamp = re.search(r"Written by `([^`]*)`", region(committed, name))
    ran = re.sub(r"^(\.venv/bin/)?python ", "python ", command)
    same = stamp is not None and stamp.group(1).replace(" --smoke", "") == ran
    check_region_shape(page, name, region(committed, name) if same else None)
    assert f"python benchmarks/{name}.py" in region(page.read_text(encoding="utf-8"), name)
