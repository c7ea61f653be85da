"""The subpackages and top-level modules of qeff_vision form a one-way graph (docs/design.md "Layers").

Every import counts, at module top level or inside a function alike (an import hidden in a
function is still a dependency); only ``if TYPE_CHECKING:`` blocks, which never run, are skipped.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qeff_vision"

# Top to bottom: a unit imports only units of later layers (never its own layer's other units).
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"demo"},
    {"api"},
    {"verify"},
    {"compile"},  # compiles a loaded spec; runs the runtime for calibration
    {"exporter"},  # the export driver: a family's adapter over the export building blocks
    {"runtime"},
    {"inputs"},  # prompts rendered and processed, request files, sampling parameters: what runtime takes
    {"reference"},  # transformers greedy generate: the tokens --compare-hf and verification compare with
    {"spec"},
    {"real_width"},  # real-width random checkpoints: a family's tiny pieces over a pinned config
    {"checkpoint"},
    {"families"},  # descriptions, hosts, config views; each family's torch-side adapter
    {"export"},  # torch building blocks: adapter base, decoder wrapper, KV functions, weights
    {
        "numerics",
        "tiny",
        "export_record",
        "compile_record",
        "hf_logging",
        "transformers_version",
        "hub",
        "real_width_stored",  # a real-width checkpoint written as a release stores it
    },
    {"contract"},
    # media: image and clip files; serving: the client of the printed vllm serve endpoints
    {"symbols", "fsutil", "graph_file", "qeff_vision", "progress", "media", "serving"},
    {"bad_input", "interrupts"},  # library errors on input -> UserError; Ctrl-C bookkeeping
    {"errors"},
]
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str | None:
    """The subpackage or top-level module a dotted ``qeff_vision`` module belongs to."""
    parts = module.split(".")
    if parts[0] != "qeff_vision":
        return None
    if len(parts) == 1:
        return "qeff_vision"
    name = parts[1]
    if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
        return name
    return "qeff_vision"  # a name of the package itself (``from qeff_vision import __version__``)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> where, for every import between two different units."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        source = _unit(module) if "." in module else "qeff_vision"
        for target, line in imported_names(path):
            unit = _unit(target)
            if unit is not None and unit != source:
                edges[source, unit].append(f"{relative}.py:{line}")
    return edges


def imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """(module or module.name, line) for every absolute import in ``path``, function-level ones
    included, ``if TYPE_CHECKING:`` blocks excluded."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            yield target, node.lineno


def test_every_unit_has_a_layer():
    units = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()}
    units = {u for u in units if not u.startswith("__") or u == "__main__"} - {"py"}
    units = {u for u in units if (PACKAGE / u).is_dir() or (PACKAGE / f"{u}.py").is_file()}
    assert units - set(RANK) == set(), "add the new unit to LAYERS (and to docs/design.md)"


def test_imports_only_point_down():
    upward = {
        f"{a} -> {b}": where[:3]
        for (a, b), where in sorted(import_edges().items())
        if RANK[a] >= RANK[b] and (a, b) != ("qeff_vision", "qeff_vision")
    }
    assert upward == {}


def test_no_cycle_between_any_pair_of_units():
    edges = set(import_edges())
    assert {(a, b) for a, b in edges if (b, a) in edges} == set()


def _runtime_module_edges() -> dict[str, set[str]]:
    """runtime module -> the runtime modules it imports (function-level imports included)."""
    runtime = PACKAGE / "runtime"
    edges: dict[str, set[str]] = {}
    for path in sorted(runtime.glob("*.py")):
        found: set[str] = set()
        for target, _ in imported_names(path):
            parts = target.split(".")
            if parts[:2] == ["qeff_vision", "runtime"] and len(parts) > 2:
                if (runtime / f"{parts[2]}.py").is_file():
                    found.add(parts[2])
        edges[path.stem] = found - {path.stem}
    return edges


def test_no_import_circle_between_runtime_modules():
    # A circle hidden by a function-level import is still a circle (issue 38 item 7): every
    # module of runtime/ must be reachable from the ones it imports without coming back.
    edges = _runtime_module_edges()
    circles = []
    for start in edges:
        stack, seen = [(start, (start,))], set()
        while stack:
            module, path = stack.pop()
            for target in edges.get(module, ()):
                if target == start:
                    circles.append(" -> ".join((*path, start)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, (*path, target)))
    assert circles == []
