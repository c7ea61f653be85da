"""Program sessions: run one compiled program on onnxruntime, or on the device when the SDK is present.

An :class:`OnnxProgram` accepts only input shapes that bind the graph's symbols to one of its
specializations — exactly what a device QPC enforces — so a host loop that works here sends the
shapes the hardware will accept. Without specializations (a bare export) any shape runs.
"""

from __future__ import annotations

import importlib
import platform
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.errors import UserError


class ShapeMismatch(UserError):
    """Inputs bind the graph's symbols to values no specialization was compiled for."""


#: onnxruntime's input type names -> numpy dtypes (the ones our graphs take).
ORT_NUMPY_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


class CompiledProgram:
    """Shape bookkeeping shared by every backend: symbols bound by the feeds vs the compiled set.

    Subclasses set ``input_dims`` (name -> dims, a dim being an int or a symbol name),
    ``output_names`` and ``specializations`` (None accepts any shape), and implement ``_execute``.

    Attributes:
        retains_state: The backend keeps ``X_RetainedState`` outputs as the next call's input ``X``
            (a device does; onnxruntime does not, so the host feeds them back).
    """

    retains_state = False
    path: Path
    input_dims: dict[str, list]
    #: Input name -> numpy dtype, where the backend knows it (a placeholder input is built from it).
    input_dtypes: Mapping[str, np.dtype] = {}
    output_names: list[str]
    specializations: list[dict[str, int]] | None

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._shape_memo: dict[tuple, dict[str, int]] = {}  # input shapes -> checked symbol values

    def _expected_inputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, list]:
        return self.input_dims

    def bind_symbols(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Symbol values implied by the feeds' shapes; raises on a missing input or a conflict."""
        bound: dict[str, int] = {}
        for name, dims in self._expected_inputs(feeds).items():
            if name not in feeds:
                raise ShapeMismatch(f"{self.path.parent.name}: input {name!r} not given")
            shape = feeds[name].shape
            if len(shape) != len(dims):
                raise ShapeMismatch(f"{name}: rank {len(shape)} given, graph has {len(dims)}")
            for dim, size in zip(dims, shape):
                if isinstance(dim, str):
                    if bound.setdefault(dim, int(size)) != size:
                        raise ShapeMismatch(f"{name}: {dim} is {size} here but {bound[dim]} elsewhere")
                elif dim is not None and dim != size:
                    raise ShapeMismatch(f"{name}: static dim {dim} given {size}")
        return bound

    def check_specialization(self, bound: Mapping[str, int]) -> dict[str, int]:
        """The first compiled specialization ``bound`` agrees with (``{}`` when any shape is accepted).

        Raises:
            ShapeMismatch: No specialization agrees on every symbol the inputs bind.
        """
        if self.specializations is None:
            return {}
        for spec in self.specializations:
            if all(spec.get(symbol, value) == value for symbol, value in bound.items()):
                return spec
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bound.items()))
        raise ShapeMismatch(f"{self.path.parent.name}: shapes ({shown}) match no compiled specialization")

    def accepts(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """Whether ``feeds`` bind the graph's symbols to a compiled specialization (no run)."""
        try:
            self.check_specialization(self.bind_symbols(feeds))
        except ShapeMismatch:
            return False
        return True

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; outputs by name. Raises :class:`ShapeMismatch` for uncompiled shapes."""
        bound = self._checked(feeds)
        start = time.perf_counter()
        outputs = self._execute(feeds, bound)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return outputs

    def run_retained(
        self, feeds: Mapping[str, np.ndarray], state: dict[str, np.ndarray], retained: Mapping[str, str]
    ) -> dict[str, np.ndarray]:
        """Run once; ``state`` (input -> array) then holds each input's ``retained[input]`` output.

        Here every state entry is replaced by its output array; a backend may update the arrays in
        place instead (:class:`OnnxProgram`), so a caller must not keep a state array expecting it
        to stay unchanged.
        """
        outputs = self.run({**feeds, **state})
        for name in state:
            state[name] = outputs[retained[name]]
        return outputs

    def restricted(self, specializations: Sequence[Mapping[str, object]]) -> CompiledProgram:
        """This program (the same loaded graph) accepting only ``specializations``, with its own counters.

        A disaggregated compile builds two programs from one graph; on the host one loaded graph
        serves both (:mod:`qeff_vision.runtime.disaggregated`).
        """
        import copy

        view = copy.copy(self)
        view.specializations = int_specializations(specializations)
        view.calls, view.seconds, view._shape_memo = 0, 0.0, {}
        return view

    def _checked(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Symbol values of ``feeds`` merged with their specialization, memoized per input shapes."""
        key = tuple((name, value.shape) for name, value in feeds.items())
        memo = self._shape_memo
        if key not in memo:
            bound = self.bind_symbols(feeds)
            # Symbols only outputs carry (the vision program's vision_size) come from the specialization.
            if len(memo) > 512:  # shapes without specializations are unbounded
                memo.clear()
            memo[key] = {**self.check_specialization(bound), **bound}
        return memo[key]

    def _execute(self, feeds: Mapping[str, np.ndarray], bound: Mapping[str, int]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def int_specializations(specializations) -> list[dict[str, int]] | None:
    """Specializations with every symbol value an int (``None`` stays ``None``: any shape)."""
    if specializations is None:
        return None
    return [{k: int(v) for k, v in spec.items()} for spec in specializations]


class OnnxProgram(CompiledProgram):
    """One ONNX program on onnxruntime (CPU), with specialization checking and timing.

    Args:
        onnx_path: The program's model.onnx (external data beside it).
        specializations: Symbol -> value mappings the program was compiled for; None accepts any.
        threads: Intra-op threads (0 lets onnxruntime choose).
        fp32_values: Run at device precision (fp16, as ``-convert-to-fp16`` compiles it) keeping
            these node outputs in fp32 (the precision plan); None runs the fp32 graph as exported.
        mx: At device precision, the microscaling formats to emulate as well
            (:class:`~qeff_vision.numerics.device.MxEmulation`); None for plain fp16.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        specializations: Sequence[Mapping[str, object]] | None = None,
        threads: int = 0,
        fp32_values: Collection[str] | None = None,
        mx=None,
    ):
        from qeff_vision.numerics.device import device_session, session_for
        from qeff_vision.numerics.ort_graph import prepared_for_onnxruntime

        super().__init__()
        try:
            if fp32_values is None:
                # Functions inlined and constants shared: each call's KV index arithmetic runs once.
                model = prepared_for_onnxruntime(Path(onnx_path))
                self.session = session_for(model, Path(onnx_path).parent, threads)
            else:
                self.session = device_session(Path(onnx_path), fp32_values, mx, threads)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise UserError(
                f"{onnx_path}: onnxruntime cannot load the graph ({str(exc).splitlines()[0]})"
            ) from exc
        self.path = Path(onnx_path)
        self.fp32_values = None if fp32_values is None else list(fp32_values)
        self.input_dims = {i.name: list(i.shape) for i in self.session.get_inputs()}
        self.input_dtypes = {
            i.name: np.dtype(ORT_NUMPY_TYPES[i.type])
            for i in self.session.get_inputs()
            if i.type in ORT_NUMPY_TYPES
        }
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_dims = {o.name: list(o.shape) for o in self.session.get_outputs()}
        self.specializations = int_specializations(specializations)
        self._aliasable: dict[tuple, set[str]] = {}  # retained pairs -> inputs written in place
        self._runner = None  # the IO binding of run_retained, made on first use

    def run_retained(
        self, feeds: Mapping[str, np.ndarray], state: dict[str, np.ndarray], retained: Mapping[str, str]
    ) -> dict[str, np.ndarray]:
        """As :meth:`CompiledProgram.run_retained`, writing in place where the graph allows it.

        Outputs whose graph finishes reading the input before scattering into it
        (:func:`~qeff_vision.runtime.in_place.aliasable`) are bound to the input's own buffer
        through IO binding: no copy of the cache per call. Device-precision sessions copy.
        """
        if self.fp32_values is not None:
            return super().run_retained(feeds, state, retained)
        from qeff_vision.runtime import in_place

        key = tuple(sorted(retained.items()))
        if key not in self._aliasable:
            self._aliasable[key] = in_place.aliasable(self.path, retained)
        self._checked({**feeds, **state})
        if self._runner is None or self._runner.session is not self.session:
            self._runner = in_place.BoundRunner(self.session, self.output_names)
        start = time.perf_counter()
        outputs = self._runner.run(feeds, state, retained, self._aliasable[key] & set(state))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        for name in state:
            state[name] = outputs[retained[name]]
        return outputs

    def _execute(self, feeds, bound):
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, dict(feeds))))
        if self.fp32_values is not None and not _finite(outputs.values()):
            from qeff_vision.numerics.plan import overflow_message

            where = f"{self.path.parent.name} at device precision"
            raise DeviceOverflow(
                overflow_message(self.path.parent.name, self.path, feeds, self.fp32_values, where)
            )
        return outputs


class DeviceOverflow(UserError):
    """A device-precision run produced inf/NaN (the message names the first node beyond fp16)."""


def _finite(values) -> bool:
    return all(np.isfinite(v).all() for v in values if np.issubdtype(v.dtype, np.floating))


def qaic_runtime_available() -> bool:
    """True when the Cloud AI 100 SDK's Python runtime (``qaicrt``) is importable."""
    return _import_qaic_runtime() is not None


def require_qaic_runtime(where: str | Path):
    """(qaicrt, QAicApi_pb2), or a :class:`UserError` saying the SDK runtime is missing."""
    runtime = _import_qaic_runtime()
    if runtime is None:
        raise UserError(
            f"{where}: a qaic artifact needs the Cloud AI 100 runtime (qaicrt, from the SDK's "
            "Platform package), which is not importable here; compile with --backend onnxruntime "
            "to run on this machine"
        )
    return runtime


def _import_qaic_runtime():
    """(qaicrt, QAicApi_pb2) from the Python path or the SDK's default install dirs, else None."""
    for extra in (None, *SDK_PYTHON_DIRS):
        if extra and extra not in sys.path and Path(extra).is_dir():
            sys.path.append(extra)
        try:
            return importlib.import_module("qaicrt"), importlib.import_module("QAicApi_pb2")
        except ImportError:
            continue
    return None


# Where the SDK's Platform/Apps packages put qaicrt and the IoDesc protobuf module.
SDK_PYTHON_DIRS = (f"/opt/qti-aic/dev/lib/{platform.machine()}", "/opt/qti-aic/dev/python")
# numpy dtype of each IoDesc element type name (ref: the SDK's QAicApi.proto DataType enum).
AIC_NUMPY_TYPES = {
    "FLOAT_TYPE": np.float32,
    "FLOAT_16_TYPE": np.float16,
    "INT8_Q_TYPE": np.int8,
    "UINT8_Q_TYPE": np.uint8,
    "INT16_Q_TYPE": np.int16,
    "INT32_Q_TYPE": np.int32,
    "INT32_I_TYPE": np.int32,
    "INT64_I_TYPE": np.int64,
    "INT8_TYPE": np.int8,
}


class QaicProgram(CompiledProgram):
    """A compiled QPC on Cloud AI 100 through the SDK's Python runtime (``qaicrt``).

    The device keeps every ``X_RetainedState`` output resident as input ``X`` of the next call, so
    the host never sends or receives the KV cache: those buffers are passed empty (skipped).
    Output shapes are not in the QPC's bindings for dynamic dims, so they come from the export's
    IO description with the symbols the feeds bind.

    Args:
        qpc_dir: The program's QPC directory (``programqpc.bin`` inside).
        io: The program's ``inputs`` / ``outputs`` description from export.json.
        specializations: The compiled specializations (checked before anything reaches the device).
        device_ids: Devices to run on (several for a multi-device program).

    Raises:
        UserError: The SDK runtime is not importable here, or the QPC cannot be loaded.
    """

    retains_state = True

    def __init__(
        self,
        qpc_dir: str | Path,
        io: Mapping[str, Mapping[str, Any]],
        specializations: Sequence[Mapping[str, object]] | None = None,
        device_ids: Sequence[int] = (0,),
    ):
        super().__init__()
        self.path = Path(qpc_dir) / "programqpc.bin"
        self.qaicrt, aicapi = require_qaic_runtime(qpc_dir)
        self.input_dims = {name: list(info["shape"]) for name, info in io["inputs"].items()}
        self.input_dtypes = {
            name: np.dtype(info["dtype"])
            for name, info in io["inputs"].items()
            if info.get("dtype") in ("float32", "float16", "int64", "int32")
        }
        self.output_dims = {name: list(info["shape"]) for name, info in io["outputs"].items()}
        self.output_names = list(self.output_dims)
        self.retained_inputs = {
            n for n in self.input_dims if f"{n}{symbols.RETAINED_SUFFIX}" in self.output_dims
        }
        self.specializations = int_specializations(specializations)
        numpy_types = {
            getattr(aicapi, name): dtype for name, dtype in AIC_NUMPY_TYPES.items() if hasattr(aicapi, name)
        }
        self._open(aicapi, numpy_types, [int(d) for d in device_ids])

    def _open(self, aicapi, numpy_types, device_ids: list[int]) -> None:
        rt = self.qaicrt
        ok = rt.QStatus.QS_SUCCESS
        self.context = rt.Context(rt.QIDList(device_ids))
        self.queue = rt.Queue(self.context, device_ids[0])
        qpc = rt.Qpc(str(self.path.parent))
        status, descriptor = qpc.getIoDescriptor()
        if status != ok:
            raise UserError(f"{self.path.parent}: cannot read the QPC's IO descriptor")
        io_desc = aicapi.IoDesc()
        io_desc.ParseFromString(bytes(descriptor))
        self.bindings = list(io_desc.selected_set.bindings)
        self.numpy_type = {b.name: np.dtype(numpy_types[b.type]) for b in self.bindings}
        properties = rt.QAicProgramProperties()
        if len(device_ids) > 1:
            properties.devMapping = ":".join(map(str, device_ids))
        single = device_ids[0] if len(device_ids) == 1 else None
        self.program = rt.Program(self.context, single, qpc, properties)
        if self.program.load() != ok:
            raise UserError(f"{self.path.parent}: the device could not load the program")
        self.program.activate()
        self.exec_obj = rt.ExecObj(self.context, self.program)

    def _expected_inputs(self, feeds):
        # Retained-state inputs may be skipped: the device feeds them from its own outputs.
        return {n: d for n, d in self.input_dims.items() if n in feeds or n not in self.retained_inputs}

    def _execute(self, feeds, bound):
        rt = self.qaicrt
        ok = rt.QStatus.QS_SUCCESS
        buffers, dims, shapes = [], [], {}
        for binding in self.bindings:
            name, dtype = binding.name, self.numpy_type[binding.name]
            if name in feeds:
                array = np.ascontiguousarray(feeds[name], dtype=dtype)
            elif name in self.output_dims and not name.endswith(symbols.RETAINED_SUFFIX):
                shapes[name] = [bound[d] if isinstance(d, str) else int(d) for d in self.output_dims[name]]
                array = np.zeros(shapes[name], dtype=dtype)
            else:
                array = np.zeros(0, dtype=dtype)  # skipped: retained state stays on the device
            buffers.append(rt.QBuffer(array.tobytes()))
            dims.append((array.itemsize, list(array.shape) or [1]))
        if self.exec_obj.setData(buffers, rt.BufferDimensionsVecRef(dims)) != ok:
            raise RuntimeError(f"{self.path.parent}: setData failed")
        if self.queue.enqueue(self.exec_obj) != ok or self.exec_obj.waitForCompletion() != ok:
            shown = ", ".join(f"{k}={v}" for k, v in sorted(bound.items()))
            raise RuntimeError(f"{self.path.parent}: the device rejected or failed the call ({shown})")
        status, results = self.exec_obj.getData()
        if status != ok:
            raise RuntimeError(f"{self.path.parent}: getData failed")
        index = {b.name: i for i, b in enumerate(self.bindings)}
        return {
            name: np.frombuffer(bytes(results[index[name]]), self.numpy_type[name]).reshape(shape)
            for name, shape in shapes.items()
        }
