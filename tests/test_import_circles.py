"""No two files of qeff_vision import each other, directly or around a longer circle (issue 51).

The graph is of files: an edge for every import in a module, at top level or inside a function
alike (a function's import is still a dependency that runs), ``if TYPE_CHECKING:`` blocks
excluded (they never run). ``from package import name`` is an edge to the submodule ``name`` when
there is one, else to the package's ``__init__``. A package's ``__init__`` importing its own
submodules is not counted: Python runs the package's ``__init__`` before any of its submodules
anyway, so a package naming its parts is the package's structure, not a circle between files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qeff_vision"

#: Circles through modules the ``calib2`` branch edits (compile/inputs.py, compile/precision.py,
#: compile/calibration.py): left to it. While one is present the test names it and skips.
OWNED_ELSEWHERE = (
    frozenset({"qeff_vision.compile.inputs", "qeff_vision.compile.precision"}),
    frozenset({"qeff_vision.compile.calibration", "qeff_vision.compile.pooling_calibration"}),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def _skipped(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module -> the qeff_vision modules it imports (see the module docstring for what counts)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _skipped(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package upwards
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
                    elif base in modules:
                        targets.add(base)
        if path.name == "__init__.py":  # its own parts: the package's structure
            targets = {t for t in targets if not t.startswith(f"{name}.")}
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_walk_finds_a_circle_it_is_shown():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_function_level_and_relative_imports():
    graph = import_graph()
    # spec.compile_options imports hardware_rules inside a function.
    assert "qeff_vision.spec.hardware_rules" in graph["qeff_vision.spec.compile_options"]
    assert "qeff_vision.export.quantization.awq" in graph["qeff_vision.export.quantization.readers"]


def test_no_import_circle_in_qeff_vision():
    found = circles(import_graph())
    elsewhere = [circle for circle in found if circle in OWNED_ELSEWHERE]
    assert [sorted(circle) for circle in found if circle not in OWNED_ELSEWHERE] == []
    if elsewhere:
        named = "; ".join(" <-> ".join(sorted(circle)) for circle in elsewhere)
        pytest.skip(f"remaining circle(s) in modules the calib2 branch edits: {named}")
