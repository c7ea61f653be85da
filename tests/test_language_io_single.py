"""The language IO names appear in one declaration: no second list of them anywhere in the package.

Reads every module's syntax tree (outside the table and the name constants) for (a) a list,
tuple, set or dict display naming two or more language IO names, as literals or through the
constants and helpers that spell them, and (b) a string literal spelling a per-layer or retained
name by hand (``past_key.``, ``_RetainedState``), outside docstrings and subscripts. Either would
be a second declaration that has to be kept in step with ``qeff_vision/contract/language_io.py``.
A single constant naming one row (``DEEPSTACK_FEATURES``) is the family's declaration of that
row, and a processor output looked up by its key (``processed["input_ids"]``) is the
processor's name, not the graph's: neither is a list.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import qeff_vision
from qeff_vision import symbols
from qeff_vision.families import all_families

PACKAGE = Path(qeff_vision.__file__).parent
# The table, the name constants, the per-slot naming scheme (kv_cache_prefix) beside the table,
# and the state kinds, each of which declares its own per-layer rows.
DECLARATIONS = {
    PACKAGE / "contract" / "language_io.py",
    PACKAGE / "contract" / "slot_names.py",
    PACKAGE / "symbols.py",
    *(PACKAGE / "contract" / "states").glob("*.py"),
}
# Helpers that spell per-layer and retained names.
NAME_HELPERS = {"past_key", "past_value", "retained"}
NAME_FRAGMENTS = ("past_key", "past_value", symbols.RETAINED_SUFFIX)


def _io_names() -> set[str]:
    names = set()
    for family in all_families():
        table = family.language_io(2, comp_ctx_lengths=True)
        names |= {row.name for row in (*table.inputs, *table.outputs)}
    return names


def _name_constants(names: set[str]) -> set[str]:
    """Identifiers of module-level constants anywhere in the package whose value is an IO name."""
    found = set()
    for info in pkgutil.walk_packages(qeff_vision.__path__, "qeff_vision."):
        if info.name.endswith("__main__"):  # runs the CLI on import
            continue
        module = importlib.import_module(info.name)
        found |= {key for key, value in vars(module).items() if isinstance(value, str) and value in names}
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _subscript_keys(tree: ast.AST) -> set[int]:
    return {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}


def _names_io(node: ast.AST, names: set[str], constants: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in constants
    if isinstance(node, ast.Call):
        func = node.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) in NAME_HELPERS
    return False


def second_lists(source: str, label: str, names: set[str], constants: set[str]) -> list[str]:
    """Every literal IO name and every display of two or more IO names in module ``source``."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | _subscript_keys(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{label}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            # A per-layer or retained name spelled by hand repeats the table's naming scheme.
            if any(fragment in node.value for fragment in NAME_FRAGMENTS):
                found.append(f"{where}: literal {node.value!r}")
        elements = []
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = [key for key in node.keys if key is not None]
        named = [element for element in elements if _names_io(element, names, constants)]
        if len(named) >= 2:
            found.append(f"{where}: a list of {len(named)} language IO names")
    return found


def test_no_second_list_of_language_io_names():
    names = _io_names()
    constants = _name_constants(names)
    assert {"INPUT_IDS", "POSITION_IDS", "CROSS_ATTENTION_MASK"} <= constants  # the check sees them
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in DECLARATIONS
        for hit in second_lists(
            path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)), names, constants
        )
    ]
    assert not found, "language IO names outside contract/language_io.py:\n" + "\n".join(found)


def test_the_check_finds_a_second_list():
    """The detector itself: a feed dict and a literal name are found, a processor key is not."""
    names = _io_names()
    source = (
        "feeds = {symbols.INPUT_IDS: ids, symbols.POSITION_IDS: pos}\n"
        "caches = (symbols.past_key(0), symbols.past_value(0))\n"
        "name = f'past_key.{layer}'\n"
        "ids = processed['input_ids']\n"
    )
    hits = second_lists(source, "probe.py", names, _name_constants(names))
    assert sorted(hit.split(": ", 1)[1] for hit in hits) == [
        "a list of 2 language IO names",
        "a list of 2 language IO names",
        "literal 'past_key.'",
    ]
