"""Precision plans: which node outputs stay fp32 on the device, found from calibration runs.

The compiler reads a plan from ``-node-precision-info=FILE``, a YAML file whose key
``FP32NodeInstanceNames`` lists node output names of the ONNX graph (QEfficient ships such files by
hand for two Gemma 3 sizes, ref: quic/efficient-transformers
QEfficient/transformers/models/gemma3/configs/fp32_nodes_gemma3_27b.yaml: residual ``Add`` outputs,
``CustomRMSNorm`` outputs, attention scalings). Here the plan is computed: run the fp32 graph on
calibration inputs with every float node output exposed, take each output's largest magnitude,
and keep in fp32

* every output whose magnitude times :data:`SAFETY_MARGIN` exceeds fp16's largest finite value, and
* every float output of a node that reads such a value (the norm after an overflowing residual
  add must take it in fp32, or the conversion to fp16 at its input is already infinite).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_vision.errors import UserError
from qeff_vision.fsutil import atomic_write_text
from qeff_vision.graph_file import load_graph
from qeff_vision.numerics.device import FLOAT_TYPES, FP16_MAX, float_outputs, session_for, value_types

PLAN_KEY = "FP32NodeInstanceNames"
PLAN_FILE = "node_precision.yaml"
# A value seen at half of fp16's range on calibration inputs may exceed it on another prompt.
SAFETY_MARGIN = 2.0
# Magnitudes from here on are attention-mask sentinels (float32's minimum is -3.4e38), not activations.
MASK_SENTINEL = 1e30
# Ops whose outputs the compiler never needs in the plan to avoid overflow: they only move data.
_MATMULS = ("MatMul", "Gemm", "Conv")


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
    """Every plan name is a node output of the graph; a UserError naming the first unknown one."""
    outputs = {o for node in model.graph.node for o in node.output}
    unknown = [name for name in names if name not in outputs]
    if unknown:
        raise UserError(
            f"{source}: {len(unknown)} name(s) are not node outputs of the graph, e.g. {unknown[0]!r}"
        )


PEAK_SUFFIX = "__peak"


def probe_model(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` with one scalar output ``<name>__peak`` per node output in ``names``.

    Each peak is the largest magnitude of the value, computed in the graph so that a run keeps no
    intermediate tensor alive (a 7B language program has thousands of them). Mask sentinels are
    left out: magnitudes from :data:`MASK_SENTINEL` on (float32's minimum, which attention masks
    add, and infinities) saturate to fp16's largest magnitude on the device, where they still zero
    a softmax weight, so they say nothing about overflow; NaN is left out too.
    """
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    graph = probed.graph
    # The exporter's value_info may name one symbol for two sizes (a CCL-long gather and ctx_len);
    # onnxruntime's buffer reuse trusts it, and the probes' extra readers expose that: drop it.
    del graph.value_info[:]
    constants = {
        "sentinel": np.array(MASK_SENTINEL, dtype=np.float32),
        "zero": np.array(0.0, dtype=np.float32),
        "zero_1d": np.zeros(1, dtype=np.float32),
        "flat": np.array([-1], dtype=np.int64),
    }
    prefix = "__probe_"
    for key, value in constants.items():
        graph.node.append(
            helper.make_node(
                "Constant", [], [prefix + key], value=numpy_helper.from_array(value, prefix + key)
            )
        )
    for index, name in enumerate(names):
        p = f"{prefix}{index}_"
        graph.node.extend(
            [
                helper.make_node("Cast", [name], [p + "float"], to=TensorProto.FLOAT),
                helper.make_node("Abs", [p + "float"], [p + "abs"]),
                helper.make_node("Less", [p + "abs", prefix + "sentinel"], [p + "kept"]),
                helper.make_node("Where", [p + "kept", p + "abs", prefix + "zero"], [p + "masked"]),
                helper.make_node("Reshape", [p + "masked", prefix + "flat"], [p + "row"]),
                # A zero on the end: an empty tensor has peak 0 instead of no maximum.
                helper.make_node("Concat", [p + "row", prefix + "zero_1d"], [p + "padded"], axis=0),
                helper.make_node("ReduceMax", [p + "padded"], [name + PEAK_SUFFIX], keepdims=0),
            ]
        )
        graph.output.append(helper.make_tensor_value_info(name + PEAK_SUFFIX, TensorProto.FLOAT, []))
    return probed


def update_ranges(ranges: dict[str, float], peaks: Mapping[str, np.ndarray]) -> None:
    """Raise ``ranges[name]`` to each ``<name>__peak`` output of a :func:`probe_model` run."""
    for output, peak in peaks.items():
        name = output[: -len(PEAK_SUFFIX)]
        if output.endswith(PEAK_SUFFIX) and name in ranges:
            ranges[name] = max(ranges[name], float(peak))


def value_ranges(
    model: onnx.ModelProto, model_dir: Path, feeds: Iterable[Mapping[str, np.ndarray]]
) -> dict[str, float]:
    """Largest magnitude of every float node output over ``feeds`` (fp32 graph; see probe_model)."""
    names = float_outputs(model)
    session = session_for(probe_model(model, names), model_dir)
    outputs = [name + PEAK_SUFFIX for name in names]
    ranges = dict.fromkeys(names, 0.0)
    for feed in feeds:
        update_ranges(ranges, dict(zip(outputs, session.run(outputs, dict(feed)))))
    return ranges


def auto_plan(model: onnx.ModelProto, ranges: Mapping[str, float]) -> list[str]:
    """Node outputs to keep in fp32, in graph order (see the module docstring for the rule)."""
    overflowing = {name for name, peak in ranges.items() if peak * SAFETY_MARGIN > FP16_MAX}
    types = value_types(model)
    keep = set(overflowing)
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
    model = load_graph(onnx_path)
    found = first_overflow(model, value_ranges(model, onnx_path.parent, [feeds]), plan)
    if found is None:
        return (
            f"{where}: device precision (fp16) produced inf/NaN, though no node output "
            "exceeds fp16's range in fp32"
        )
    return f"{where}: " + found.describe(program)
