"""Test double of the SDK's ``qaicrt``: runs stand-in QPCs on onnxruntime with device-resident state."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import numpy as np
import onnxruntime as ort
import QAicApi_pb2 as aicapi

TYPES = {"float32": aicapi.FLOAT_TYPE, "float16": aicapi.FLOAT_16_TYPE, "int64": aicapi.INT64_I_TYPE}
NUMPY = {code: np.dtype(name) for name, code in TYPES.items()}
SUFFIX = "_RetainedState"
LOG: list[dict] = []  # what the host sent per call: {binding name: shape} (for assertions)


def _fit(resident, shape, onnx_type):
    """The resident buffer viewed at ``shape`` (a device allocates retained state at its largest size)."""
    dtype = np.float32 if "float" in onnx_type else np.int64
    fitted = np.zeros(shape, dtype=dtype)
    if resident is not None:
        window = tuple(slice(0, min(a, b)) for a, b in zip(shape, resident.shape))
        fitted[window] = resident[window]
    return fitted


class QStatus(Enum):
    QS_SUCCESS = 0
    QS_ERROR = 1


OK, ERROR = QStatus.QS_SUCCESS, QStatus.QS_ERROR


def QIDList(ids):  # noqa: N802 - the SDK's name
    return list(ids)


class Context:
    def __init__(self, devices=None):
        self.devices = devices


class QAicProgramProperties:
    devMapping = ""


class QBuffer(bytes):
    pass


def BufferDimensionsVecRef(dims):  # noqa: N802
    return list(dims)


class Qpc:
    """Reads the stand-in's programqpc.bin (its recorded argv names the ONNX and specializations)."""

    def __init__(self, directory: str):
        record = json.loads((Path(directory) / "programqpc.bin").read_bytes())
        argv = dict(arg.split("=", 1) for arg in record["argv"] if "=" in arg)
        self.onnx = argv["-m"]
        specs = json.loads(Path(argv["-network-specialization-config"]).read_text())["specializations"]
        self.specializations = [{k: int(v) for k, v in s.get("symbols", s).items()} for s in specs]
        self.session = ort.InferenceSession(self.onnx, providers=["CPUExecutionProvider"])

    def getIoDescriptor(self):  # noqa: N802
        bindings = []
        for direction, values in ((0, self.session.get_inputs()), (1, self.session.get_outputs())):
            for value in values:
                dtype = (
                    value.type[len("tensor(") : -1]
                    .replace("float", "float32")
                    .replace("float3232", "float32")
                )
                bindings.append({"name": value.name, "type": TYPES[dtype], "dir": direction, "dims": []})
        for index, binding in enumerate(bindings):
            binding["index"] = index
        return OK, json.dumps(bindings).encode()


class Program:
    def __init__(self, context, device, qpc, properties):
        self.qpc = qpc
        self.resident: dict[str, np.ndarray] = {}

    def load(self):
        return OK

    def activate(self):
        return None


class Queue:
    def __init__(self, context, device):
        pass

    def enqueue(self, exec_obj):
        return exec_obj.execute()


class ExecObj:
    def __init__(self, context, program):
        self.program = program
        _, raw = program.qpc.getIoDescriptor()
        self.bindings = json.loads(raw)
        self.outputs = []

    def setData(self, buffers, dims):  # noqa: N802
        self.buffers, self.dims = buffers, dims
        return OK

    def execute(self):
        session = self.program.qpc.session
        given, sent = {}, {}
        for binding, buffer, (_, shape) in zip(self.bindings, self.buffers, self.dims):
            if binding["dir"] == 0 and len(buffer):
                given[binding["name"]] = np.frombuffer(buffer, NUMPY[binding["type"]]).reshape(shape)
                sent[binding["name"]] = list(shape)
        LOG.append(sent)
        spec = self._specialization(given)
        if spec is None:
            return ERROR
        feeds = dict(given)
        for value in session.get_inputs():
            if value.name not in feeds:  # skipped: the device uses its resident buffer
                shape = [spec[d] if isinstance(d, str) else d for d in value.shape]
                feeds[value.name] = _fit(self.program.resident.get(value.name), shape, value.type)
        names = [o.name for o in session.get_outputs()]
        results = dict(zip(names, session.run(names, feeds)))
        for name, value in results.items():
            if name.endswith(SUFFIX):
                self.program.resident[name[: -len(SUFFIX)]] = value
        self.outputs = [
            QBuffer(results[b["name"]].tobytes())
            if b["dir"] == 1 and not b["name"].endswith(SUFFIX)
            else QBuffer(b"")
            for b in self.bindings
        ]
        return OK

    def _specialization(self, given):
        bound = {}
        for value in self.program.qpc.session.get_inputs():
            if value.name in given:
                for dim, size in zip(value.shape, given[value.name].shape):
                    if isinstance(dim, str):
                        bound[dim] = int(size)
        matches = [
            s for s in self.program.qpc.specializations if all(s.get(k, v) == v for k, v in bound.items())
        ]
        return matches[0] if matches else None

    def waitForCompletion(self):  # noqa: N802
        return OK

    def getData(self):  # noqa: N802
        return OK, self.outputs
