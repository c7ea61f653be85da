"""Benchmark pages are written by their benchmarks (issue 55): ``--write-docs`` into a copy of docs/.

Every ``benchmarks/*.py`` has a page ``docs/benchmarks/<name>.md`` with a marked region and takes
``--write-docs``; three counted benchmarks (no timing, about a second each) run here with
``--smoke --write-docs --docs-dir <a temporary copy of docs/>`` and the rewritten region must hold
tables of the committed page's shape (the same tables, each row as wide as its header), the prose
around it unchanged. ``tests/test_benchmarks_smoke.py`` (slow) does the same for every documented
benchmark command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _docs_page():
    directory = REPO / "benchmarks"
    if str(directory) not in sys.path:
        sys.path.append(str(directory))
    from _lib import docs_page

    return docs_page


def benchmark_names() -> list[str]:
    return sorted(path.stem for path in (REPO / "benchmarks").glob("*.py"))


def check_region_shape(page: Path, name: str, committed: str | None = None) -> list[list[list[str]]]:
    """The region's tables; each is rectangular with a data row, and matches ``committed``'s headers."""
    module = _docs_page()
    region = module.region(page.read_text(encoding="utf-8"), name)
    tables = module.tables(region)
    assert tables, f"{page}: no table in the region"
    for table in tables:
        header, *rows = table
        assert rows, f"{page}: a table without rows: {header}"
        assert all(len(row) == len(header) for row in rows), f"{page}: ragged table under {header}"
    if committed is not None and committed.lstrip().startswith("*Written by"):
        # A smoke run may print fewer columns (fewer context lengths, sizes); the tables stay the same.
        first = [table[0][0] for table in module.tables(committed)]
        assert [table[0][0] for table in tables] == first, f"{page}: not the committed page's tables"
    return tables


@pytest.mark.parametrize("name", benchmark_names())
def test_every_benchmark_has_a_page_it_writes(name):
    page = _docs_page().page(DOCS, name)
    assert page.is_file(), f"benchmarks/{name}.py has no page docs/benchmarks/{name}.md"
    check_region_shape(page, name)
    source = (REPO / "benchmarks" / f"{name}.py").read_text(encoding="utf-8")
    assert "add_docs_arguments(parser)" in source and f'recording(args, "{name}"' in source


def test_to_markdown_tables_and_text():
    module = _docs_page()
    printed = (
        "Part 1: a note\n"
        "  image  tokens    S  protocol\n"
        "-----------------------------\n"
        "224x224      64  128     chunk\n"
        "224x224      64  128      full\n"
        "target met\n"
        "plot: /tmp/x.png\n"
        "| a | b | c |\n|---|---:|---|\n| 1 | 2 | 3 |\n"
    )
    markdown = module.to_markdown(printed)
    assert "/tmp/x.png" not in markdown  # where this run's files went is not a result
    tables = module.tables(markdown)
    assert tables == [
        [
            ["image", "tokens", "S", "protocol"],
            ["224x224", "64", "128", "chunk"],
            ["224x224", "64", "128", "full"],
        ],
        [["a", "b", "c"], ["1", "2", "3"]],
    ]
    assert "```text\nPart 1: a note\n```" in markdown and "```text\ntarget met\n```" in markdown


def test_replace_region_keeps_the_prose_and_refuses_a_page_without_one():
    module = _docs_page()
    text = "intro\n<!-- benchmark-output:x -->\nold\n<!-- /benchmark-output:x -->\noutro\n"
    assert module.replace_region(text, "x", "new") == (
        "intro\n<!-- benchmark-output:x -->\nnew\n<!-- /benchmark-output:x -->\noutro\n"
    )
    with pytest.raises(ValueError):
        module.replace_region("no markers", "x", "new")


def _run(command: list[str], docs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    argv = [sys.executable, *command, "--smoke", "--write-docs", "--docs-dir", str(docs)]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["kv_memory", "specialize_speed", "sampler_bytes"])
def test_write_docs_rewrites_the_region_of_a_copy(name, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    page = docs / "benchmarks" / f"{name}.md"
    before = page.read_text(encoding="utf-8")
    done = _run([f"benchmarks/{name}.py"], docs)
    assert done.returncode == 0, done.stderr[-2000:]
    after = page.read_text(encoding="utf-8")
    committed = _docs_page().region(before, name)
    check_region_shape(page, name, committed)
    region = _docs_page().region(after, name)
    assert f"`python benchmarks/{name}.py --smoke`" in region  # names the run that wrote it
    # Only the region changed, and the repository's own page did not.
    assert re.sub(r"(?s)<!-- benchmark-output.*?-->.*?<!-- /benchmark-output", "", after) == re.sub(
        r"(?s)<!-- benchmark-output.*?-->.*?<!-- /benchmark-output", "", before
    )
    assert (DOCS / "benchmarks" / f"{name}.md").read_text(encoding="utf-8") == before
    if name == "sampler_bytes":
        assert (docs / "benchmarks" / "sampler_bytes.png").stat().st_mtime >= page.stat().st_mtime - 60


def test_write_docs_without_a_region_is_one_line(tmp_path):
    docs = tmp_path / "docs"
    (docs / "benchmarks").mkdir(parents=True)
    (docs / "benchmarks" / "kv_memory.md").write_text("# no region\n")
    done = _run(["benchmarks/kv_memory.py"], docs)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "benchmark-output:kv_memory" in done.stderr
    assert (docs / "benchmarks" / "kv_memory.md").read_text() == "# no region\n"
