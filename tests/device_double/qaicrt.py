"""Test double of the SDK's ``qaicrt``: runs our programs on onnxruntime with device-resident state.

Two callers use it: the product's ``QaicProgram`` (``setData(buffers, dims)`` of raw bytes, then
``getData``) and the Cloud AI vLLM plugin's ``QAICInferenceSession`` (``setData([(index,
ndarray), ...])`` with output arrays the runtime fills in place). A ``Qpc`` is either a stand-in
compiler's QPC directory (``programqpc.bin`` records the argv) or a program directory of a
``compile --backend onnxruntime`` OUT (``specializations.json`` and ``custom_io.yaml``; the ONNX is
found through OUT's manifest).

Like the device it is strict: dtypes are the custom IO precisions, every buffer the host passes
must have a shape one specialization allows (else ``waitForCompletion`` fails with "No matching
dimension found"), and ``X_RetainedState`` outputs stay resident per program as input ``X`` when
the host skips ``X`` (a continuous-batching program's KV slots live in that one resident buffer;
the graph itself writes the slot ``batch_index`` names).
"""

from __future__ import annotations

import json
import re
import sys
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import QAicApi_pb2 as aicapi
import yaml

TYPES = {
    "float32": aicapi.FLOAT_TYPE,
    "float16": aicapi.FLOAT_16_TYPE,
    "int64": aicapi.INT64_I_TYPE,
    "int32": aicapi.INT32_I_TYPE,
    "int8": aicapi.INT8_TYPE,
}
NUMPY = {code: np.dtype(name) for name, code in TYPES.items()}
ONNX_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    # The SDK's type enum (as the plugin maps it) has no bool: assumed a one-byte int8 binding (the
    # on-device sampler's token_bitmasks; its penalty buffers take their custom IO precision).
    "tensor(bool)": "int8",
}
# The graph's own element type of an input, where it is not float32 or int64.
GRAPH_NUMPY = {"tensor(int32)": np.int32, "tensor(bool)": np.bool_}
SUFFIX = "_RetainedState"
LOG: list[dict] = []  # what the host sent per call: {binding name: shape} (for assertions)
# Fault injection for tests: called with each call's inputs {binding name: array}; a message it
# returns fails that call as the device would (waitForCompletion's error status), None runs it.
FAIL = None
ERRORS: list[str] = []  # every rejected call's message (also printed to stderr, as the runtime logs it)


class QStatus(Enum):
    QS_SUCCESS = 0
    QS_ERROR = 1


class QLogLevel(Enum):
    QL_DEBUG = 0
    QL_INFO = 1


OK, ERROR = QStatus.QS_SUCCESS, QStatus.QS_ERROR


def QIDList(ids):  # noqa: N802 - the SDK's name
    return list(ids)


class Context:
    def __init__(self, devices=None):
        self.devices = devices

    def setLogLevel(self, level):  # noqa: N802
        return OK


class QAicProgramProperties:
    def __init__(self):
        self.devMapping = ""
        self.dataPathTimeoutMs = 0


class QAicQueueProperties:
    def __init__(self):
        self.numThreadsPerQueue = 1


class QBuffer(bytes):
    pass


def BufferDimensionsVecRef(dims):  # noqa: N802
    return list(dims)


DEVICES = 16  # an AI 100 Ultra card set: enough ids for any printed device group


class Util:
    """Device queries: DEVICES devices with 16 cores each."""

    def getResourceInfo(self, device_id):  # noqa: N802
        if not 0 <= int(device_id) < DEVICES:
            return ERROR, None
        return OK, SimpleNamespace(nspTotal=16, nspFree=16)

    def getDeviceIds(self):  # noqa: N802
        return OK, list(range(DEVICES))


def _program_files(directory: Path) -> tuple[Path, list[dict], Path | None]:
    """(ONNX, specializations, custom IO file) of a stand-in QPC or an onnxruntime program directory."""
    record_file = directory / "programqpc.bin"
    record = None
    if record_file.exists():
        try:
            record = json.loads(record_file.read_bytes())
        except ValueError:
            record = None
    if isinstance(record, dict) and "argv" in record:
        # The compiler ran in OUT's staging directory (.OUT.staging.*), renamed to OUT after.
        argv = {
            flag: re.sub(r"/\.([^/]+)\.staging\.[^/]+/", r"/\1/", value)
            for flag, value in (arg.split("=", 1) for arg in record["argv"] if "=" in arg)
        }
        specs = json.loads(Path(argv["-network-specialization-config"]).read_text())["specializations"]
        custom = argv.get("-custom-IO-list-file")
        return Path(argv["-m"]), specs, Path(custom) if custom else None
    if not (directory / "specializations.json").exists():
        raise RuntimeError(f"{directory}: neither a QPC nor a compiled program directory")
    out = directory.parent
    manifest = json.loads((out / "manifest.json").read_text())
    for program in manifest["programs"].values():
        if (out / program["specializations_file"]).parent == directory:
            custom = program.get("custom_io_file")
            specs = json.loads((directory / "specializations.json").read_text())["specializations"]
            return out / program["onnx"], specs, out / custom if custom else None
    raise RuntimeError(f"{directory}: OUT's manifest names no program here")


class Qpc:
    """A program: its ONNX on onnxruntime, its specializations and its custom IO precisions."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        onnx, specs, custom_io = _program_files(self.directory)
        self.specializations = [{k: int(v) for k, v in s.get("symbols", s).items()} for s in specs]
        precisions = {}
        if custom_io is not None and custom_io.exists():
            precisions = {e["IOName"]: e["Precision"] for e in yaml.safe_load(custom_io.read_text()) or []}
        self.session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
        values = [(0, v) for v in self.session.get_inputs()] + [(1, v) for v in self.session.get_outputs()]
        self.bindings = []
        for index, (direction, value) in enumerate(values):
            dtype = precisions.get(value.name, ONNX_TYPES[value.type])
            allowed = [self._dims(value.shape, s) for s in self.specializations]
            retained = value.name.endswith(SUFFIX) or (
                direction == 0 and any(o.name == value.name + SUFFIX for o in self.session.get_outputs())
            )
            self.bindings.append(
                {
                    "name": value.name,
                    "index": index,
                    "dir": direction,
                    "type": TYPES[dtype],
                    "dims": allowed[0],  # the selected set is the first specialization
                    "size": int(np.prod(allowed[0])) * NUMPY[TYPES[dtype]].itemsize,
                    "is_partial_buf_allowed": retained,
                    "allowed": allowed,
                }
            )

    @staticmethod
    def _dims(shape, symbols) -> list[int]:
        return [int(symbols[d]) if isinstance(d, str) else int(d) for d in shape]

    def getIoDescriptor(self):  # noqa: N802
        bindings = [{k: v for k, v in b.items() if k != "allowed"} for b in self.bindings]
        allowed = [
            [(b["type"], b["allowed"][i]) for b in self.bindings] for i in range(len(self.specializations))
        ]
        return OK, json.dumps({"bindings": bindings, "allowed_shapes": allowed}).encode()


class Program:
    def __init__(self, context, device, qpc, properties):
        self.qpc = qpc
        self.resident: dict[str, np.ndarray] = {}
        self.active = False

    def load(self):
        return OK

    def activate(self):
        self.active = True
        return OK

    def deactivate(self):
        self.active = False
        return OK

    def createSlicingSpecHandle(self, spec_json):  # noqa: N802
        return OK, json.loads(spec_json)


class Queue:
    def __init__(self, context, device):
        pass

    def initProperties(self, properties):  # noqa: N802
        return OK

    def enqueue(self, exec_obj):
        exec_obj.status = exec_obj.execute()
        return OK


class ExecObj:
    def __init__(self, context, program):
        self.program = program
        self.bindings = program.qpc.bindings
        self.arrays: dict[int, np.ndarray] = {}
        self.outputs: list[QBuffer] = []
        self.status = OK

    def setData(self, buffers, dims=None):  # noqa: N802
        """``(buffers, dims)`` of raw bytes (the product), or ``[(index, ndarray)]`` (the plugin)."""
        self.arrays = {}
        if dims is None:
            for index, array in buffers:
                self.arrays[int(index)] = array
            return OK
        for index, (buffer, (_, shape)) in enumerate(zip(buffers, dims)):
            if len(buffer):
                dtype = NUMPY[self.bindings[index]["type"]]
                self.arrays[index] = np.frombuffer(buffer, dtype).reshape(shape).copy()
        return OK

    def setDataWithSlices(self, buffers, handle, parameters):  # noqa: N802
        return ERROR, None  # KV hand-off slices: not on the path our programs take

    def _reject(self, message: str) -> QStatus:
        ERRORS.append(message)
        print(f"[qaicrt stand-in] {message}", file=sys.stderr)
        return ERROR

    def execute(self):
        given = {}
        for index, array in self.arrays.items():
            binding = self.bindings[index]
            if array.size == 0:
                continue  # skipped: retained state stays on the device
            if array.dtype != NUMPY[binding["type"]]:
                return self._reject(
                    f"{binding['name']}: buffer dtype {array.dtype}, binding is {NUMPY[binding['type']]}"
                )
            given[index] = array
        if FAIL is not None:
            message = FAIL({self.bindings[i]["name"]: a for i, a in given.items()})
            if message:
                return self._reject(message)
        LOG.append(
            {
                self.bindings[i]["name"]: list(a.shape)
                for i, a in given.items()
                if self.bindings[i]["dir"] == 0
            }
        )
        matches = [
            s
            for s in range(len(self.program.qpc.specializations))
            if all(list(a.shape) == self.bindings[i]["allowed"][s] for i, a in given.items())
        ]
        if not matches:
            shown = ", ".join(f"{self.bindings[i]['name']}={list(a.shape)}" for i, a in sorted(given.items()))
            return self._reject(f"No matching dimension found for {shown}")
        chosen = matches[0]
        session = self.program.qpc.session
        feeds = {}
        for binding in self.bindings:
            if binding["dir"] != 0:
                continue
            value = given.get(binding["index"])
            graph_type = _onnx_type(session, binding["name"])
            onnx_dtype = GRAPH_NUMPY.get(graph_type, np.float32 if "float" in graph_type else np.int64)
            if value is None:
                if not binding["is_partial_buf_allowed"]:
                    return self._reject(f"{binding['name']}: not retained state, must be sent")
                value = _fit(self.program.resident.get(binding["name"]), binding["allowed"][chosen])
            feeds[binding["name"]] = np.asarray(value).astype(onnx_dtype, copy=False)
        names = [o.name for o in session.get_outputs()]
        results = dict(zip(names, session.run(names, feeds)))
        index = {b["name"]: b["index"] for b in self.bindings}
        self.outputs = [QBuffer(b"") for _ in self.bindings]
        for name, value in results.items():
            binding = self.bindings[index[name]]
            cast = value.astype(NUMPY[binding["type"]])
            if name.endswith(SUFFIX):
                self.program.resident[name[: -len(SUFFIX)]] = cast
                continue
            self.outputs[binding["index"]] = QBuffer(cast.tobytes())
            target = self.arrays.get(binding["index"])
            if target is not None and target.size:
                np.copyto(target, cast)  # the plugin reads its own arrays: filled in place
        return OK

    def waitForCompletion(self):  # noqa: N802
        return self.status

    def getData(self):  # noqa: N802
        return OK, self.outputs


def _onnx_type(session, name: str) -> str:
    return next(v.type for v in session.get_inputs() if v.name == name)


def _fit(resident, shape):
    """The resident buffer viewed at ``shape`` (a device allocates retained state at its largest size)."""
    dtype = resident.dtype if resident is not None else np.float32
    fitted = np.zeros(shape, dtype=dtype)
    if resident is not None:
        window = tuple(slice(0, min(a, b)) for a, b in zip(shape, resident.shape))
        fitted[window] = resident[window]
    return fitted
