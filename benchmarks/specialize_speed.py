"""Time to load and specialize every spec: per spec and in total, against the 1-second target.

Usage: python benchmarks/specialize_speed.py [--specs specs] [--repeats 5]

For each spec under ``--specs`` (recursively, the golden directory skipped): the median over
``--repeats`` runs of loading and checking it (``load_spec``: schema, pinned config, token math)
and of building every generated file (``build_specializations(...).files()``: specializations,
custom IO, compile commands, vLLM forms), in milliseconds. The last line sums the medians and
says whether the whole set stays under the target (specializing every spec in ``specs/`` takes
well under a second; docs/benchmarks/specialize_speed.md). No torch is imported. This replaces a
timed assertion in the test suite (speed targets are measured here, not asserted under a loaded
test run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 1.0


def measure(path: Path, repeats: int) -> tuple[float, float, int]:
    """(median load ms, median build ms, generated files) of one spec."""
    from qeff_vision.spec import build_specializations, load_spec

    loads, builds, files = [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        spec = load_spec(path)
        loaded = time.perf_counter()
        files = len(build_specializations(spec).files())
        loads.append((loaded - start) * 1000)
        builds.append((time.perf_counter() - loaded) * 1000)
    return statistics.median(loads), statistics.median(builds), files


def main(argv: list[str] | None = None) -> int:
    """Print the table; return 0 (the verdict is a line of the table, not an exit code)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", type=Path, default=ROOT / "specs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="One repeat (a quick check).")
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "specialize_speed", argv):
        if args.smoke:
            args.repeats = 1
        from qeff_vision.spec import find_specs

        paths = find_specs(args.specs)
        rows = [(path.relative_to(args.specs).as_posix(), *measure(path, args.repeats)) for path in paths]
        width = max(len(name) for name, *_ in rows)
        print(f"{'spec':<{width}}  {'load ms':>8}  {'build ms':>8}  {'files':>5}")
        for name, load, build, files in rows:
            print(f"{name:<{width}}  {load:>8.1f}  {build:>8.1f}  {files:>5}")
        total = sum(load + build for _, load, build, _ in rows) / 1000
        verdict = "meets" if total < TARGET_SECONDS else "misses"
        summary = f"{len(rows)} specs: {total:.3f} s in total (medians of {args.repeats})"
        print(f"{summary}; {verdict} the {TARGET_SECONDS:g} s target")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
