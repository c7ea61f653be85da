"""Precision plans: which node outputs stay fp32 on the device, found from calibration runs.

The compiler reads a plan from ``-node-precision-info=FILE``, a YAML file whose key
``FP32NodeInstanceNames`` lists node output names of the ONNX graph (QEfficient ships such files by
hand for two Gemma 3 sizes, ref: quic/efficient-transformers
QEfficient/transformers/models/gemma3/configs/fp32_nodes_gemma3_27b.yaml: residual ``Add`` outputs,
``CustomRMSNorm`` outputs, attention scalings). Here the plan is computed: run the fp32 graph on
calibration inputs recording every float node output's largest magnitude
(:mod:`qeff_vision.numerics.recording`), and keep in fp32

* every output whose magnitude times :data:`SAFETY_MARGIN` exceeds fp16's largest finite value, and
* every float output of a node that reads such a value (the norm after an overflowing residual
  add must take it in fp32, or the conversion to fp16 at its input is already infinite), and
* the angle chains: every float value from which a ``Cos`` or ``Sin`` computes its angle
  (position x inv_freq, the rotary embedding), with the float constants it reads and the
  ``Cos``/``Sin`` outputs (:func:`angle_chains`). Not for overflow: an angle in fp16 is off by up
  to half its spacing (0.125 rad at positions 256-511, 2 rad from 4,096), which rotates every key
  and query; QEfficient avoids it with cos/sin tables computed in fp32 and gathered by position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qeff_vision.errors import UserError
from qeff_vision.fsutil import atomic_write_text
from qeff_vision.graph_file import model_nodes
from qeff_vision.numerics.device import FLOAT_TYPES, FP16_MAX, float_outputs, value_types
from qeff_vision.numerics.layer_functions import expanded_plan, load_flat_graph
from qeff_vision.numerics.recording import SlicedRecorder, record_ranges

PLAN_KEY = "FP32NodeInstanceNames"
PLAN_FILE = "node_precision.yaml"
# A value seen at half of fp16's range on calibration inputs may exceed it on another prompt.
SAFETY_MARGIN = 2.0
# Ops whose outputs the compiler never needs in the plan to avoid overflow: they only move data.
_MATMULS = ("MatMul", "Gemm", "Conv")
# Ops reading an angle: its fp16 rounding error is absolute, so it grows with the angle.
_ANGLE_OPS = ("Cos", "Sin")


def write_plan(path: Path, names: Sequence[str]) -> None:
    """Write ``names`` in the compiler's ``-node-precision-info`` format (atomically)."""
    lines = [f"{PLAN_KEY}:", ""] + [f"  - {name}" for name in names]
    atomic_write_text(path, "\n".join(lines) + "\n")


def read_plan(path: Path) -> list[str]:
    """Node output names of a ``-node-precision-info`` file.

    Raises:
        UserError: The file is missing or is not a mapping with a ``FP32NodeInstanceNames`` list.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the node precision file ({exc})") from exc
    names = data.get(PLAN_KEY) if isinstance(data, Mapping) else None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UserError(f"{path}: a node precision file needs a list {PLAN_KEY}: [node output names]")
    return list(names)


def plan_hash(path: Path) -> str:
    """Content hash of a plan file (recorded in the manifest so a changed plan recompiles)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_plan_names(model: onnx.ModelProto, names: Iterable[str], source: str) -> None:
    """Every plan name is a node output of the graph or of a layer function's body; else a UserError."""
    outputs = {o for node in model_nodes(model) for o in node.output}
    unknown = [name for name in names if name not in outputs]
    if unknown:
        raise UserError(
            f"{source}: {len(unknown)} name(s) are not node outputs of the graph, e.g. {unknown[0]!r}"
        )


def value_ranges(
    model: onnx.ModelProto,
    model_dir: Path,
    feeds: Iterable[Mapping[str, np.ndarray]],
    on_slice: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Largest magnitude of every float node output over ``feeds`` (fp32 graph, run slice by slice).

    Magnitudes from :data:`~qeff_vision.numerics.recording.MASK_SENTINEL` on (float32's minimum,
    which attention masks add, and infinities) are left out: they saturate to fp16's largest
    magnitude on the device, where they still zero a softmax weight, so they say nothing about
    overflow; NaN is left out too. See
    :mod:`qeff_vision.numerics.recording` for how memory stays independent of depth.
    """
    types = value_types(model)
    recorder = SlicedRecorder(model, model_dir, float_outputs(model, types), types)
    return record_ranges(recorder, feeds, on_slice)


def angle_chains(model: onnx.ModelProto, types: Mapping[str, int] | None = None) -> set[str]:
    """Float node outputs that compute the input of a ``Cos`` or ``Sin``, and their outputs.

    Walks back from each ``Cos``/``Sin`` through float values only: the walk stops at integer
    values (position ids before their Cast), graph inputs and initializers, so it takes the
    rotary angle's arithmetic (Cast, Mul or MatMul by inv_freq, Concat, M-RoPE's section picks)
    and the ``Constant`` holding inv_freq (a constant read by an fp32 node stays exact).
    """
    types = value_types(model) if types is None else types
    producer = {name: node for node in model.graph.node for name in node.output if name}
    chain: set[str] = set()
    pending = []
    for node in model.graph.node:
        if node.op_type in _ANGLE_OPS and node.domain in ("", "ai.onnx"):
            chain.update(o for o in node.output if types.get(o) in FLOAT_TYPES)
            pending.extend(node.input)
    while pending:
        name = pending.pop()
        node = producer.get(name)
        if node is None or name in chain or types.get(name) not in FLOAT_TYPES:
            continue
        chain.add(name)
        pending.extend(node.input)
    return chain


def auto_plan(model: onnx.ModelProto, ranges: Mapping[str, float]) -> list[str]:
    """Node outputs to keep in fp32, in graph order (see the module docstring for the rule)."""
    overflowing = {name for name, peak in ranges.items() if peak * SAFETY_MARGIN > FP16_MAX}
    types = value_types(model)
    keep = set(overflowing) | angle_chains(model, types)
    for node in model.graph.node:
        if any(name in overflowing for name in node.input):
            keep.update(o for o in node.output if types.get(o) in FLOAT_TYPES)
    return [o for node in model.graph.node for o in node.output if o in keep]


def non_matmul_outputs(model: onnx.ModelProto) -> int:
    """How many float outputs a plan keeping "every non-matmul output" in fp32 would list."""
    types = value_types(model)
    return sum(
        1
        for node in model.graph.node
        if node.op_type not in _MATMULS
        for o in node.output
        if types.get(o) in FLOAT_TYPES
    )


@dataclass(frozen=True)
class Overflow:
    """The first node (graph order) whose output leaves fp16's range outside the plan."""

    node: str
    output: str
    peak: float

    def describe(self, program: str, inputs: str = "") -> str:
        """One line for the user; ``inputs`` says on what (``"on the calibration prompts"``)."""
        return (
            f"{program}: node {self.node} output {self.output} reaches {self.peak:.4g} in fp32"
            f"{' ' + inputs if inputs else ''}, beyond fp16's {FP16_MAX:.0f}: it overflows on the device "
            "under -convert-to-fp16 (set compile.node_precision: auto, or list it in the node precision file)"
        )


def first_overflow(
    model: onnx.ModelProto, ranges: Mapping[str, float], plan: Iterable[str] = ()
) -> Overflow | None:
    """The first node output outside the plan whose fp32 magnitude exceeds fp16's range."""
    kept = set(plan)
    for node in model.graph.node:
        for output in node.output:
            if output not in kept and ranges.get(output, 0.0) > FP16_MAX:
                return Overflow(node.name or node.op_type, output, ranges[output])
    return None


def overflow_message(
    program: str, onnx_path: Path, feeds: Mapping[str, np.ndarray], plan: Iterable[str], where: str
) -> str:
    """The failure line of a device-precision inf/NaN on ``feeds``: the first node beyond fp16.

    Runs the fp32 graph once more on the same inputs with every node output exposed.
    """
    model = load_flat_graph(onnx_path)
    ranges = value_ranges(model, onnx_path.parent, [feeds])
    found = first_overflow(model, ranges, expanded_plan(model, plan))
    if found is None:
        return (
            f"{where}: device precision (fp16) produced inf/NaN, though no node output "
            "exceeds fp16's range in fp32"
        )
    return f"{where}: " + found.describe(program)
