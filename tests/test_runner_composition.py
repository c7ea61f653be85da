"""The runner is composed, not a grid (issue 51): one ``step``, backend objects, one mode table.

Read from the source (AST), so a new subclass, branch or table anywhere in qeff_vision fails here:

- no class in qeff_vision/runtime overrides the language call ``step`` (one class defines it);
- no code outside the backend objects branches on which backend it has: no comparison of a
  ``backend`` value or a backend name, and a program's ``retains_state`` is read only by
  :func:`qeff_vision.runtime.backends.backend_of`; nor does it tell them apart by duck typing
  on the retained state ``past`` (a device empties it): no ``past.get``, no ``len(past)``, no
  truthiness test of ``past``;
- what a deployment mode is lives in one table (:data:`qeff_vision.contract.deployment_programs.MODES`):
  nothing else compares a mode or program name or keys a mapping by one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from qeff_vision.compile.backends import COMPILE_BACKENDS
from qeff_vision.compile_record import BACKENDS
from qeff_vision.contract.deployment_programs import DEPLOYMENTS, LANG_DECODE, LANG_PREFILL, MODES
from qeff_vision.runtime.backends import BACKENDS as RUNTIME_BACKENDS

PACKAGE = Path(__file__).resolve().parents[1] / "qeff_vision"
MODE_TABLE = PACKAGE / "contract" / "deployment_programs.py"
BACKEND_OBJECTS = {PACKAGE / "runtime" / "backends.py", PACKAGE / "compile" / "backends.py"}

MODE_NAMES = {*DEPLOYMENTS, LANG_PREFILL, LANG_DECODE}
MODE_CONSTANTS = {"DUAL", "SINGLE", "DISAGGREGATED", "LANG_PREFILL", "LANG_DECODE"}
BACKEND_CONSTANTS = {"QAIC", "ONNXRUNTIME"}


def _sources() -> list[tuple[Path, ast.AST]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def _names(node: ast.AST) -> set[str]:
    """Names, attribute names and string constants an expression mentions."""
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
    return found


def test_no_runtime_class_overrides_step():
    defining = [
        f"{path.name}:{node.name}"
        for path, tree in _sources()
        if path.parent.name == "runtime"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(isinstance(item, ast.FunctionDef) and item.name == "step" for item in node.body)
    ]
    assert defining == ["generator.py:Generator"]


def test_no_backend_branch_outside_the_backend_objects():
    branches = []
    for path, tree in _sources():
        if path in BACKEND_OBJECTS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                mentioned = set().union(*(_names(operand) for operand in operands))
                backend = any(
                    (isinstance(o, ast.Name) and o.id == "backend")
                    or (isinstance(o, ast.Attribute) and o.attr == "backend")
                    for o in operands
                )
                if backend or mentioned & (BACKEND_CONSTANTS | set(BACKENDS)):
                    branches.append(_where(path, node))
            elif isinstance(node, ast.Attribute) and node.attr == "retains_state":
                if isinstance(node.ctx, ast.Load):
                    branches.append(_where(path, node))
            elif isinstance(node, ast.Constant) and node.value == "retains_state":
                branches.append(_where(path, node))  # getattr(program, "retains_state")
    assert branches == []


#: Names of the retained-state mapping a call sends (``past``; the slots' ``self.past``).
STATE_NAMES = {"past"}


def _is_state(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in STATE_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in STATE_NAMES
    )


def _duck_typed_backend_checks(tree: ast.AST) -> list[ast.AST]:
    """Nodes that ask the retained state whether the host holds it (what only the backend knows)."""
    found = []
    for node in ast.walk(tree):
        tests: list[ast.AST] = []
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests.append(node.operand)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_state(func.value):
                found.append(node)  # past.get(name): absent only when the device holds it
            elif isinstance(func, ast.Name) and func.id == "len" and any(map(_is_state, node.args)):
                found.append(node)
        found.extend(test for test in tests if _is_state(test))
    return found


def test_no_duck_typed_backend_check_outside_the_backend_objects():
    checks = [
        _where(path, node)
        for path, tree in _sources()
        if path not in BACKEND_OBJECTS
        for node in _duck_typed_backend_checks(tree)
    ]
    assert checks == []


def test_the_duck_typed_check_is_caught():
    """The patterns the grep looks for are found (the cross-attention runner's former check among them)."""
    former = """
held = past.get(name)
if held is None:
    pass
if in_place and may_alias and past:
    pass
n = len(self.past)
ok = not past
"""
    assert len(_duck_typed_backend_checks(ast.parse(former))) == 4
    assert _duck_typed_backend_checks(ast.parse("past[name] = value\nfor key in past: pass")) == []


def test_every_backend_has_its_objects():
    assert set(COMPILE_BACKENDS) == set(RUNTIME_BACKENDS) == set(BACKENDS)


def test_one_deployment_mode_table():
    elsewhere = []
    for path, tree in _sources():
        if path == MODE_TABLE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                mentioned = set().union(*(_names(operand) for operand in operands))
                mode = any(  # ``deployment.mode``, ``spec.deployment.mode``
                    isinstance(o, ast.Attribute) and o.attr == "mode" and "deployment" in _names(o.value)
                    for o in operands
                )
                if mode or mentioned & (MODE_CONSTANTS | MODE_NAMES):
                    elsewhere.append(f"{_where(path, node)} compares a mode")
            elif isinstance(node, ast.Dict):
                keys = set().union(*(_names(key) for key in node.keys if key is not None))
                if keys & (MODE_CONSTANTS | MODE_NAMES):
                    elsewhere.append(f"{_where(path, node)} tables a mode")
    assert elsewhere == []
    assert set(MODES) == set(DEPLOYMENTS)


def test_every_stage_reads_the_table():
    """spec, compile and runtime read their mode facts from the table (their objects name its rows)."""
    from qeff_vision.runtime.deployment import DEPLOYMENTS as RUNTIME_MODES
    from qeff_vision.spec.deployment import Deployment

    assert {name: mode.table for name, mode in RUNTIME_MODES.items()} == dict(MODES)
    for name, row in MODES.items():
        spec_mode = Deployment(name)
        assert spec_mode.table is row and spec_mode.programs == dict(row.programs)
        runtime = RUNTIME_MODES[name]
        assert runtime.language_program in row.programs and runtime.vision_program in row.programs
        assert runtime.batching is not row.one_sequence
