"""How a weight is stored in the ONNX file: fp32, fp16 with a Cast, or quantized with DequantizeLinear.

The exported graph computes in float32 (onnxruntime runs it as it is; the AI 100 compiler converts
it to fp16 under ``-convert-to-fp16``). What it stores need not be float32:

* ``float32``: one float32 initializer per weight, 4 bytes a parameter (the graph dtype's own form).
* ``float16``: a float16 initializer ``<name>_fp16`` and a ``Cast(to=FLOAT)`` writing ``<name>``,
  2 bytes a parameter. A bf16 checkpoint's weights are exact in fp16 except magnitudes beyond its
  range (kept float32) and below its normal range (rounded, each by less than 2**-25); see
  :class:`Fp16Changes`. A float32 value with more bits than fp16 keeps its tensor float32 too. So
  later stages read the values they read from float32 initializers, those tiny ones aside. The
  compiler folds the Cast under ``-convert-to-fp16``.
* ``bfloat16``: a bfloat16 initializer ``<name>_bf16`` and a ``Cast(to=FLOAT)``, 2 bytes a parameter,
  for programs the device computes in bfloat16 (``aic_hw_version: ai200``). bf16 has fp32's range,
  so nothing is kept float32: a bf16 checkpoint's values are exact, a float32 one's are rounded to
  nearest even, as the device holds them. onnxruntime's CPU kernels compute in float32 behind the
  Cast, as for the float16 form.
* kept quantized: a parameter the checkpoint stores quantized (:class:`QuantizedWeight`) becomes
  ``<name>_quantized`` (int4 packed two per byte, int8/uint8 or float8e4m3fn), ``<name>_scale``
  (float32) and ``<name>_zero_point`` feeding ``DequantizeLinear`` (opset 21: blocked along one
  axis), the form of QEfficient's FP8 retention change (quic/efficient-transformers PR #1261,
  ``fp8_retain_weights``, which exports at opset 21 too).

A storage node writes the name the graph's nodes read, so nothing else in the graph changes; it is
placed right before the first node reading it (slicing a graph by weight bytes keeps each weight
beside its reader).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from qeff_vision.errors import UserError
from qeff_vision.export.quantized_weight import QuantizedWeight

FLOAT32, FLOAT16, BFLOAT16 = "float32", "float16", "bfloat16"
WEIGHT_DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
FP16_MAX = 65504.0
FP16_SMALLEST_NORMAL = 2.0**-14
# ONNX opset whose DequantizeLinear takes int4/uint4 and float8 inputs and ``block_size``.
QUANTIZED_OPSET = 21


@dataclass(frozen=True)
class WeightForm:
    """How the weights of one program are stored.

    Attributes:
        dtype: ``float32``, ``float16`` or ``bfloat16`` (stored dtype of float weights in a float32
            graph).
        keep_quantized: Write quantized checkpoint weights as ``DequantizeLinear`` inputs.
    """

    dtype: str = FLOAT32
    keep_quantized: bool = False

    def to_dict(self) -> dict:
        """The export.json record."""
        return {"dtype": self.dtype, "keep_quantized": self.keep_quantized}


@dataclass(frozen=True)
class Fp16Changes:
    """What storing one float32 weight in fp16 would change (counts of values), and the choice made.

    A weight is kept float32 when a value would become infinite or a value in fp16's normal range
    would lose bits (a float32 checkpoint). Values below fp16's normal range (2**-14) are rounded to
    its subnormals, and those below its smallest subnormal (2**-24) to zero: each moves by less than
    2**-25, and ``-convert-to-fp16`` rounds them the same way on the device. A trained bf16 matrix
    of tens of millions of values holds some of them almost surely, so keeping such tensors float32
    would keep nearly every large matrix float32; they are counted and reported instead.

    Attributes:
        name: The weight (the name its readers use).
        values: Elements of the weight.
        beyond_range: Finite values beyond fp16's largest (65,504): they would become infinite.
        below_normal: Non-zero values below fp16's smallest normal that fp16 rounds.
        extra_bits: Values in fp16's normal range with more significant bits than fp16 keeps.
    """

    name: str
    values: int
    beyond_range: int
    below_normal: int
    extra_bits: int

    @property
    def kept_float32(self) -> bool:
        """Whether the weight stays float32."""
        return bool(self.beyond_range or self.extra_bits)

    def to_dict(self) -> dict:
        """The export.json record."""
        return {
            "name": self.name,
            "values": self.values,
            "beyond_range": self.beyond_range,
            "below_normal": self.below_normal,
            "extra_bits": self.extra_bits,
        }


@dataclass
class StoredTensors:
    """What one weight becomes: initializers (with their payloads) and the node that reads them.

    Attributes:
        tensors: (initializer without data, its bytes), in the order written.
        node: The Cast / DequantizeLinear writing the weight's name, or None (stored as it is).
        fp16: What a float16 form changes or would change in this weight, or None (nothing).
        quantized: The scheme of a weight kept quantized, or None.
    """

    tensors: list[tuple[onnx.TensorProto, bytes | memoryview]]
    node: onnx.NodeProto | None = None
    fp16: Fp16Changes | None = None
    quantized: str | None = None


@dataclass
class WrittenWeights:
    """What :func:`write_weights` stored for one program.

    Attributes:
        parameters: Elements of every weight written.
        bytes: Bytes of every initializer written (scales and zero points included).
        fp16: Weights whose values a float16 form changes or would change (those kept float32 and
            those written with values rounded below fp16's normal range).
        quantized: Scheme -> number of weights kept quantized.
    """

    parameters: int = 0
    bytes: int = 0
    fp16: list[Fp16Changes] = field(default_factory=list)
    quantized: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The export.json record."""
        return {
            "parameters": self.parameters,
            "bytes": self.bytes,
            "kept_float32": [c.to_dict() for c in self.fp16 if c.kept_float32],
            "rounded_below_normal": [c.to_dict() for c in self.fp16 if not c.kept_float32],
            "quantized": dict(sorted(self.quantized.items())),
        }

    def summary(self) -> str:
        """One line: bytes per parameter, weights kept quantized, those a float16 form kept float32."""
        per = self.bytes / self.parameters if self.parameters else 0.0
        line = f"{self.bytes / 2**20:,.1f} MiB for {self.parameters:,} parameters ({per:.2f} B/parameter)"
        if self.quantized:
            line += "; kept quantized: " + ", ".join(f"{n} {s}" for s, n in sorted(self.quantized.items()))
        kept = [c for c in self.fp16 if c.kept_float32]
        if kept:
            beyond = sum(k.beyond_range for k in kept)
            extra = sum(k.extra_bits for k in kept)
            names = ", ".join(k.name for k in kept[:3]) + (" ..." if len(kept) > 3 else "")
            line += (
                f"; {len(kept)} weight(s) kept float32 ({beyond:,} values beyond fp16's range, "
                f"{extra:,} with more bits than fp16: {names})"
            )
        rounded = [c for c in self.fp16 if not c.kept_float32]
        if rounded:
            count = sum(c.below_normal for c in rounded)
            line += f"; {count:,} values below fp16's normal range rounded in {len(rounded)} fp16 weight(s)"
        return line


def _tensor(name: str, data_type: int, shape) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=data_type)
    tensor.dims.extend(int(d) for d in shape)
    return tensor


def _payload(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


def fp16_changes(name: str, values: torch.Tensor) -> Fp16Changes | None:
    """None when every value of float32 ``values`` is exact in fp16; otherwise what fp16 changes."""
    # Infinities stay infinite and NaN stays NaN in fp16: only finite values can change.
    changed = (values.to(torch.float16).to(torch.float32) != values) & ~values.isnan()
    if not bool(changed.any()):
        return None
    magnitude = values.abs()
    beyond = changed & (magnitude > FP16_MAX)
    below = changed & (magnitude < FP16_SMALLEST_NORMAL)
    extra = changed & ~beyond & ~below
    return Fp16Changes(name, values.numel(), int(beyond.sum()), int(below.sum()), int(extra.sum()))


def float_tensors(name: str, values: torch.Tensor, form: WeightForm) -> StoredTensors:
    """A float weight (in the graph's dtype) stored as ``form`` says: as it is, or float16 + Cast."""
    array = values.contiguous()
    changes = None
    if form.dtype == BFLOAT16 and array.dtype in (torch.float32, torch.bfloat16):
        # torch rounds float32 to bfloat16 to nearest even; numpy has no bfloat16, so the payload
        # is the 16-bit patterns (ONNX stores BFLOAT16 raw data as those).
        bits = array.to(torch.bfloat16).view(torch.int16).numpy()
        stored = f"{name}_bf16"
        cast = helper.make_node("Cast", [stored], [name], to=TensorProto.FLOAT, name=f"{name}_cast")
        return StoredTensors([(_tensor(stored, TensorProto.BFLOAT16, bits.shape), _payload(bits))], cast)
    if form.dtype == FLOAT16 and array.dtype == torch.float32:
        changes = fp16_changes(name, array)
        if changes is None or not changes.kept_float32:
            half = array.to(torch.float16).numpy()
            stored = f"{name}_fp16"
            cast = helper.make_node("Cast", [stored], [name], to=TensorProto.FLOAT, name=f"{name}_cast")
            tensor = _tensor(stored, TensorProto.FLOAT16, half.shape)
            return StoredTensors([(tensor, _payload(half))], cast, fp16=changes)
    plain = array.numpy()
    data_type = helper.np_dtype_to_tensor_dtype(plain.dtype)
    return StoredTensors([(_tensor(name, data_type, plain.shape), _payload(plain))], fp16=changes)


def transposed(weight: QuantizedWeight) -> QuantizedWeight:
    """A 2-D quantized weight's transpose: data, scales and zero points transposed, the axis swapped."""
    if weight.data.dim() != 2:
        raise ValueError(f"only a 2-D weight is transposed, not {weight.data.dim()}-D")

    def swap(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.t() if tensor is not None and tensor.dim() == 2 else tensor

    return QuantizedWeight(
        data=weight.data.t(),
        bits=weight.bits,
        scale=swap(weight.scale),
        zero_point=swap(weight.zero_point),
        axis=1 - weight.axis % 2,
        block_size=weight.block_size,
        scheme=weight.scheme,
    )


def pack_int4(values: np.ndarray) -> np.ndarray:
    """4-bit integers (int8 or uint8, one per element) packed two per byte, as ONNX stores INT4/UINT4.

    ONNX: the first element of each pair is in the low nibble; an odd count pads the last byte.
    """
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def _quantized_data(name: str, data: torch.Tensor, bits: int) -> tuple[int, np.ndarray]:
    """(ONNX data type, payload array) of quantized values."""
    if data.dtype == torch.float8_e4m3fn:
        return TensorProto.FLOAT8E4M3FN, data.contiguous().view(torch.uint8).numpy()
    if data.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{name}: quantized values of dtype {data.dtype} have no ONNX form here")
    signed = data.dtype == torch.int8
    array = data.contiguous().numpy()
    if bits == 4:
        low, high = (-8, 7) if signed else (0, 15)
        if array.size and (array.min() < low or array.max() > high):
            raise ValueError(f"{name}: values outside the 4-bit range {low}..{high}")
        return (TensorProto.INT4 if signed else TensorProto.UINT4), pack_int4(array)
    if bits == 8:
        return (TensorProto.INT8 if signed else TensorProto.UINT8), array
    raise ValueError(f"{name}: {bits}-bit values have no ONNX form here")


def quantized_tensors(name: str, weight: QuantizedWeight, scale_dtype: torch.dtype) -> StoredTensors:
    """Initializers and the ``DequantizeLinear`` (opset 21) writing ``name`` from ``weight``.

    The scale is stored in ``scale_dtype`` (the graph's float dtype, which is DequantizeLinear's
    output type); bf16 and fp16 scales are exact in float32.
    """
    data_type, payload = _quantized_data(name, weight.data, weight.bits)
    data = _tensor(f"{name}_quantized", data_type, weight.data.shape)
    scale = weight.scale.to(scale_dtype).contiguous().numpy()
    scale_tensor = _tensor(f"{name}_scale", helper.np_dtype_to_tensor_dtype(scale.dtype), scale.shape)
    tensors = [(data, _payload(payload)), (scale_tensor, _payload(scale))]
    inputs = [data.name, scale_tensor.name]
    if weight.zero_point is not None:
        zero_type, zero = _quantized_data(name, weight.zero_point.to(weight.data.dtype), weight.bits)
        zero_tensor = _tensor(f"{name}_zero_point", zero_type, weight.zero_point.shape)
        tensors.append((zero_tensor, _payload(zero)))
        inputs.append(zero_tensor.name)
    attributes = {}
    if weight.scale.dim() > 0:
        attributes["axis"] = weight.axis % weight.data.dim()
        if weight.block_size:
            attributes["block_size"] = weight.block_size
    node = helper.make_node("DequantizeLinear", inputs, [name], name=f"{name}_dequantize", **attributes)
    return StoredTensors(tensors, node, quantized=weight.scheme)


def insert_storage_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Put each storage node right before the first node of ``graph`` that reads its output."""
    if not nodes:
        return
    pending = {node.output[0]: node for node in nodes}
    ordered: list[onnx.NodeProto] = []
    for node in graph.node:
        for name in _read_names(node):
            if name in pending:
                ordered.append(pending.pop(name))
        ordered.append(node)
    # A weight no node reads in the main graph (read by name inside a subgraph) goes first.
    ordered[:0] = list(pending.values())
    del graph.node[:]
    graph.node.extend(ordered)


def _read_names(node: onnx.NodeProto) -> list[str]:
    """Names ``node`` reads: its inputs and the outer values its subgraphs read."""
    names = list(node.input)
    for attribute in node.attribute:
        subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for subgraph in subgraphs:
            for inner in subgraph.node:
                names.extend(_read_names(inner))
    return names


def program_forms(weight_dtype: str | Mapping[str, str], keep_quantized: bool) -> dict[str, WeightForm]:
    """Each program's :class:`WeightForm` from the export's arguments (checked before any work)."""
    dtypes = {"vision": weight_dtype, "lang": weight_dtype} if isinstance(weight_dtype, str) else weight_dtype
    forms = {}
    for program in ("vision", "lang"):
        chosen = dtypes.get(program, "float32")
        if chosen not in WEIGHT_DTYPES:
            raise UserError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {chosen!r}")
        forms[program] = WeightForm(chosen, keep_quantized)
    return forms
