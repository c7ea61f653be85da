"""Inputs and outputs of an exported graph, and the check that a specialization binds its symbols.

The compiler needs every symbolic dimension of a graph pinned by each specialization; a
specialization that names a symbol the graph does not have is a spec bug too (usually a renamed
axis). Both directions are checked here, once, for the onnxruntime backend and the compile driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.fsutil import read_json

Dim = int | str | None


@dataclass(frozen=True)
class TensorInfo:
    """One graph input or output: name, numpy dtype name and dimensions (int, symbol, or unknown)."""

    name: str
    dtype: str
    dims: tuple[Dim, ...]

    def symbols(self) -> dict[str, int]:
        """Symbol -> first axis it labels."""
        found: dict[str, int] = {}
        for axis, dim in enumerate(self.dims):
            if isinstance(dim, str):
                found.setdefault(dim, axis)
        return found

    def bind(self, values: Mapping[str, int]) -> tuple[int | None, ...]:
        """Concrete shape under ``values``; unknown (unnamed dynamic) axes stay ``None``."""
        return tuple(values[dim] if isinstance(dim, str) else dim for dim in self.dims)


@dataclass(frozen=True)
class GraphIO:
    """The interface of one exported program."""

    path: Path
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    def input_symbols(self) -> set[str]:
        """Symbols on any input."""
        return {sym for tensor in self.inputs for sym in tensor.symbols()}

    def all_symbols(self) -> set[str]:
        """Symbols on any input or output."""
        return self.input_symbols() | {sym for tensor in self.outputs for sym in tensor.symbols()}

    def where(self, symbol: str) -> str:
        """First place ``symbol`` appears, for messages: ``input vision_embeds axis 1``."""
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            for tensor in tensors:
                if symbol in tensor.symbols():
                    return f"{kind} {tensor.name} axis {tensor.symbols()[symbol]}"
        return "nowhere"


def read_graph_io(path: str | Path) -> GraphIO:
    """Read the IO of an ONNX file without loading its external data (a 7B graph stays small)."""
    import onnx
    from onnx import helper

    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError as exc:
        raise UserError(f"{path}: ONNX file not found") from exc
    except Exception as exc:  # onnx raises DecodeError and friends from protobuf
        raise UserError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc

    def info(value: Any) -> TensorInfo:
        tensor_type = value.type.tensor_type
        dims: list[Dim] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
        return TensorInfo(value.name, dtype, tuple(dims))

    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(info(v) for v in model.graph.input if v.name not in initializers)
    return GraphIO(path, inputs, tuple(info(v) for v in model.graph.output))


def specialization_values(entry: Mapping[str, Any], where: str) -> dict[str, int]:
    """Symbol values of one specialization entry (flat or ``{"name", "symbols"}``) as integers."""
    symbols = entry.get("symbols") if isinstance(entry.get("symbols"), Mapping) else entry
    values = {}
    for symbol, raw in symbols.items():
        try:
            value = int(str(raw))
        except ValueError:
            raise UserError(f"{where}: symbol {symbol!r} has a non-integer value {raw!r}") from None
        if value < 1:
            raise UserError(f"{where}: symbol {symbol!r} must be positive, got {value}")
        values[symbol] = value
    return values


def read_specializations(path: str | Path) -> list[dict[str, int]]:
    """Every specialization of a ``specializations.json`` in either layout, as symbol -> int."""
    path = Path(path)
    data = read_json(path)
    entries = data.get("specializations")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{path}: expected a non-empty 'specializations' list")
    result = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise UserError(f"{path}: specialization {index} is not an object")
        result.append(specialization_values(entry, f"{path}: specialization {index}"))
    return result


def symbol_problems(
    graph: GraphIO,
    specializations: Iterable[Mapping[str, int]],
    program: str,
    *,
    outputs_required: bool,
) -> list[str]:
    """Every mismatch between the specializations and the graph's symbols, one line each.

    Args:
        graph: The program's interface.
        specializations: Symbol values, one mapping per specialization.
        program: Program name for messages.
        outputs_required: Also require symbols that only appear on outputs (onnxruntime checks
            output shapes, so it needs them; the compiler infers them).
    """
    required = graph.all_symbols() if outputs_required else graph.input_symbols()
    known = graph.all_symbols()
    problems = []
    for index, values in enumerate(specializations):
        for symbol in sorted(required - set(values)):
            problems.append(
                f"{program} specialization {index}: symbol {symbol!r} is missing "
                f"(graph {graph.path.name} has it on {graph.where(symbol)})"
            )
        for symbol in sorted(set(values) - known - symbols.SPECIALIZATION_ONLY):
            problems.append(
                f"{program} specialization {index}: symbol {symbol!r} is not a dimension of any "
                f"input or output of {graph.path.name} (graph symbols: {', '.join(sorted(known))})"
            )
    return problems
