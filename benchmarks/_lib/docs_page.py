"""``--write-docs``: a benchmark's printed tables become the marked region of its documentation page.

Every benchmark takes ``--write-docs`` (and ``--docs-dir``, the ``docs/`` tree to write into, this
repository's by default). With it, what the run prints is recorded and, when the run ends, replaces
the region of ``docs/benchmarks/<name>.md`` between ``<!-- benchmark-output:<name> -->`` and
``<!-- /benchmark-output:<name> -->``: each printed table (aligned columns, or Markdown already)
as a Markdown table, other lines as text, under a line naming the command. Plots a benchmark
draws go beside the page (``docs/benchmarks/<name>.png``, :func:`plot_path`). The page's own
prose stays as written; only the region is the benchmark's. ``tests/test_benchmark_docs.py``
runs benchmarks with ``--smoke --write-docs`` into a temporary copy of ``docs/`` and checks the
tables' shape against the committed page.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
BEGIN = "<!-- benchmark-output:{name} -->"
END = "<!-- /benchmark-output:{name} -->"
# Cells of an aligned table are separated by two or more spaces (or Markdown pipes).
CELL_SPLIT = re.compile(r"\s+\|\s+|\s{2,}")
MARKDOWN_RULE = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")
# A line of rule characters under an aligned header carries no data.
TEXT_RULE = re.compile(r"^[-=+ ]{3,}$")
# Lines that name where this run's files went: a page records results, not this machine's paths.
LOCAL_LINE = re.compile(r"^(plot|wrote|manifest): ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--write-docs`` and ``--docs-dir`` to a benchmark's parser."""
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="Replace the marked region of docs/benchmarks/NAME.md with this run's tables (plots beside it).",
    )
    parser.add_argument(
        "--docs-dir",
        type=Path,
        default=DOCS,
        help="The docs/ tree --write-docs writes into (default: this repo's).",
    )


def page(docs_dir: Path, name: str) -> Path:
    """The page of benchmark ``name`` under ``docs_dir``: ``<name>.md``, or its hyphenated spelling.

    ``activation_memory.py`` may document itself on ``activation-memory.md``; the underscore
    spelling wins when both exist.
    """
    folder = Path(docs_dir) / "benchmarks"
    hyphenated = folder / f"{name.replace('_', '-')}.md"
    plain = folder / f"{name}.md"
    return hyphenated if hyphenated.exists() and not plain.exists() else plain


def plot_path(args: argparse.Namespace, name: str, default: Path | None) -> Path | None:
    """Where a plot goes: beside the page with ``--write-docs``, else ``default``."""
    if getattr(args, "write_docs", False):
        return page(args.docs_dir, name).with_suffix(".png")
    return default


def cells(line: str) -> list[str]:
    """The cells of one table line: Markdown pipes, or runs of two or more spaces."""
    stripped = line.strip()
    if stripped.startswith("|") and stripped.endswith("|"):
        return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", stripped[1:-1])]
    return [cell for cell in CELL_SPLIT.split(stripped) if cell]


def _markdown_row(row: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"


def to_markdown(text: str) -> str:
    """Printed output as Markdown: tables as tables (header, rule, rows), other lines as text blocks."""
    local = (tempfile.gettempdir() + os.sep, str(REPO) + os.sep)
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if not TEXT_RULE.match(line.strip())
        and not LOCAL_LINE.match(line.strip())
        and not any(path in line for path in local)  # where this run kept its files
    ]
    out: list[str] = []
    prose: list[str] = []

    def flush_prose() -> None:
        while prose and not prose[0].strip():
            prose.pop(0)
        while prose and not prose[-1].strip():
            prose.pop()
        if any(line.strip() for line in prose):
            out.extend(["```text", *prose, "```", ""])
        prose.clear()

    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|"):  # a Markdown table: keep its rows
            flush_prose()
            while index < len(lines) and lines[index].strip().startswith("|"):
                row = lines[index].strip()
                out.append(row if MARKDOWN_RULE.match(row) else _markdown_row(cells(row)))
                index += 1
            out.append("")
            continue
        width = len(cells(line))
        run = index
        while run < len(lines) and width >= 3 and len(cells(lines[run])) == width:
            run += 1
        if run - index >= 2:  # a header and at least one row of the same width
            flush_prose()
            header, *rows = (cells(row) for row in lines[index:run])
            out += [_markdown_row(header), "|" + " --- |" * width, *(_markdown_row(row) for row in rows), ""]
            index = run
            continue
        prose.append(line)
        index += 1
    flush_prose()
    return "\n".join(out).rstrip() + "\n"


def tables(region: str) -> list[list[list[str]]]:
    """The Markdown tables of a region, each as rows of cells (header first, the rule left out)."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in region.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            if not MARKDOWN_RULE.match(stripped):
                current.append(cells(stripped))
        elif current:
            found.append(current)
            current = []
    return found


def region(text: str, name: str) -> str:
    """The text between ``name``'s markers.

    Raises:
        ValueError: The page has no such region.
    """
    begin, end = BEGIN.format(name=name), END.format(name=name)
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} region")
    return text[text.index(begin) + len(begin) : text.index(end)]


def replace_region(text: str, name: str, body: str) -> str:
    """``text`` with ``name``'s region replaced by ``body``."""
    region(text, name)
    begin, end = BEGIN.format(name=name), END.format(name=name)
    return text[: text.index(begin) + len(begin)] + "\n" + body.strip() + "\n" + text[text.index(end) :]


def write_region(path: Path, name: str, body: str) -> None:
    """Replace the region of the page at ``path`` (temp file + rename: never half-written)."""
    text = path.read_text(encoding="utf-8")
    updated = replace_region(text, name, body)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(updated)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _command(name: str, argv: list[str]) -> str:
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--docs-dir":
            skip = True
            continue
        if arg == "--write-docs" or arg.startswith("--docs-dir="):
            continue
        kept.append("DIR" if os.path.isabs(arg) else arg)  # a path of this machine says nothing
    return " ".join([f"python benchmarks/{name}.py", *kept])


@contextlib.contextmanager
def recording(args: argparse.Namespace, name: str, argv: list[str] | None = None) -> Iterator[None]:
    """Record what the block prints and, with ``--write-docs``, write it into the page's region.

    The page must exist with its markers before the run: a missing page or region is one line on
    stderr and exit code 2, checked before the benchmark's work.
    """
    if not getattr(args, "write_docs", False):
        yield
        return
    target = page(args.docs_dir, name)
    try:
        region(target.read_text(encoding="utf-8"), name)
    except (OSError, ValueError) as exc:
        print(f"{name}: error: --write-docs: {target}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    buffer = io.StringIO()
    original = sys.stdout
    sys.stdout = _Tee(original, buffer)
    try:
        yield
    finally:
        sys.stdout = original
    command = _command(name, sys.argv[1:] if argv is None else argv)
    stamp = datetime.date.today().isoformat()
    body = f"*Written by `{command}` on {stamp}.*\n\n" + to_markdown(buffer.getvalue())
    write_region(target, name, body)
    print(f"{name}: wrote {target}", file=sys.stderr)
