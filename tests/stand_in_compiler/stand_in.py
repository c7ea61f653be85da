"""Stand-in for the Cloud AI 100 compiler (qaic-exec / qaic-compile), for tests only.

It checks its arguments against the files it is given the way the real compiler would refuse them,
then writes a fake ``programqpc.bin``. It is deliberately independent of qeff_vision: it reads the
ONNX, specialization, custom IO and partition files itself.

Checks: only known flags; every file argument exists and parses (the ONNX with its external data);
every specialization binds exactly the graph's symbols (all input symbols, plus optionally symbols
that only appear on outputs, nothing else); custom IO names exist in the graph with a known
precision; ``-retained-state`` pairs every ``X_RetainedState`` output with an input ``X``;
the partition file lists ``numCores`` equal to ``-aic-num-cores``. For ``-aic-hw-version=ai200``
(bfloat16 compute): no ``-convert-to-fp16``, no float16 custom IO, and every float retained state
and ``pixel_values`` declared ``bfloat16``; for ai100 no ``bfloat16`` custom IO (ai100 has none).
``-sub-functions`` is given exactly when the main graph calls layer functions (local functions
outside the kernel domains),
no function body names a value ``*_RetainedState`` (a body is shared by every call: its retained
outputs are ``*_InternalRetainedState``, QEfficient's convention) and no body's ``Range`` reads a
function parameter directly (QEfficient moves ``torch.arange`` out of its decoder-layer functions:
the compiler refuses a ``Range`` whose limit is a function parameter rather than a constant).

Environment (set by the test wrapper script):
    STAND_IN_MODE: ok (default), fail, fail-vision (vision fails, language hangs), hang, flood, slow,
        signal (killed by SIGKILL after a partial output), no-program (exits 0, writes no program),
        stubborn (hangs as ``hang`` does but ignores SIGTERM, as a compiler busy in a system call
        may: only SIGKILL ends it).
        ``hang`` hangs right after parsing its flags, before any check (see :func:`hang`).
    STAND_IN_RECORD: file to append one JSON line per invocation (argv, mode), one
        ``{"event": "hanging", "pid": N}`` line when a hanging stand-in has its partial output in
        place, and a ``{"event": "ignored", "signal": 15, "pid": N}`` line per SIGTERM a stubborn
        one ignored.
    STAND_IN_LAYOUT: accept ``any`` layout (default) or only ``flat`` (an old SDK).
    STAND_IN_SLEEP: seconds the ``slow`` mode sleeps before compiling (default 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

VALUE_FLAGS = {
    "-m",
    "-aic-hw-version",
    "-network-specialization-config",
    "-custom-IO-list-file",
    "-aic-num-cores",
    "-mos",
    "-ols",
    "-mdp-load-partition-config",
    "-aic-binary-dir",
    "-node-precision-info",
}
SWITCHES = {
    "-aic-hw",
    "-retained-state",
    "-convert-to-fp16",
    "-mxfp6-matmul",
    "-aic-enable-depth-first",
    "-compile-only",
    "-allow-mxint8-mdp-io",
    "-split-retained-state-io",
    "-split-model-io",
    "-sub-functions",
}
# Domains of the kernels every graph may call as functions (KV ops, RMSNorm, gated delta rule):
# they are not layer functions.
KERNEL_DOMAINS = {"com.qualcomm.cloud", "com.qti.aisw.onnx", "com.qeff_vision"}
PRECISIONS = {"float16", "float32", "mxint8", "int8", "int32", "int64", "bfloat16", "uint8", "bool"}
HW_VERSIONS = {"ai100", "2.0", "ai200"}
AI200 = "ai200"
RETAINED = "_RetainedState"
PIXEL_VALUES = "pixel_values"


class Refused(Exception):
    """An argument the real compiler would refuse."""


def parse(argv: list[str]) -> tuple[dict[str, str], set[str]]:
    values: dict[str, str] = {}
    switches: set[str] = set()
    for arg in argv:
        flag, has_value, value = arg.partition("=")
        if has_value and flag in VALUE_FLAGS:
            if flag in values:
                raise Refused(f"option {flag} given twice")
            values[flag] = value
        elif not has_value and arg in SWITCHES:
            switches.add(arg)
        else:
            raise Refused(f"unknown option {arg!r}")
    for required in ("-m", "-aic-binary-dir", "-network-specialization-config"):
        if required not in values:
            raise Refused(f"missing required option {required}")
    if "-aic-hw" not in switches:
        raise Refused("missing -aic-hw")
    return values, switches


def graph_interface(path: Path):
    import onnx

    if not path.is_file():
        raise Refused(f"-m: {path} does not exist")
    try:
        model = onnx.load(str(path))  # loads external data too: a missing .data file is refused
        onnx.checker.check_model(model)
    except Exception as exc:
        raise Refused(f"-m: {path} is not a valid ONNX model: {exc}") from exc

    def dims(value):
        return [
            d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim
        ]

    initializers = {i.name for i in model.graph.initializer}
    inputs = {v.name: dims(v) for v in model.graph.input if v.name not in initializers}
    outputs = {v.name: dims(v) for v in model.graph.output}
    float_inputs = {
        v.name
        for v in model.graph.input
        if v.name not in initializers and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    return inputs, outputs, float_inputs, model


def check_functions(model, switches: set[str]) -> None:
    """``-sub-functions`` given exactly for a graph calling layer functions, and their bodies' rules."""
    layers = {(f.domain, f.name): f for f in model.functions if f.domain not in KERNEL_DOMAINS}
    called = {(node.domain, node.op_type) for node in model.graph.node} & set(layers)
    if "-sub-functions" not in switches:
        if called:
            names = sorted(name for _, name in called)
            raise Refused(f"the graph calls layer functions {names}; pass -sub-functions")
        return
    if not called:
        raise Refused("-sub-functions: the graph calls no layer function")
    for key in sorted(called):
        body = layers[key]
        names = {*body.input, *body.output, *(o for node in body.node for o in node.output)}
        public = sorted(n for n in names if n.endswith("_RetainedState"))
        if public:
            raise Refused(f"-sub-functions: function {key[1]} names {public[0]} (use _InternalRetainedState)")
        params = set(body.input)
        if any(node.op_type == "Range" and params & set(node.input) for node in body.node):
            raise Refused(f"-sub-functions: function {key[1]} has a Range reading a function parameter")


def symbols_of(tensors: dict[str, list]) -> set[str]:
    return {d for shape in tensors.values() for d in shape if isinstance(d, str) and d}


# Specialization keys the compiler reads that name no graph dimension: QEfficient's continuous-
# batching prefill entries carry ``full_batch_exec_size`` (qeff_vision.symbols.SPECIALIZATION_ONLY).
COMPILER_KEYS = {"full_batch_exec_size"}


def check_specializations(path: Path, inputs: dict, outputs: dict, layout: str) -> int:
    if not path.is_file():
        raise Refused(f"-network-specialization-config: {path} does not exist")
    try:
        entries = json.loads(path.read_text())["specializations"]
    except (ValueError, KeyError, TypeError) as exc:
        raise Refused(f"{path}: not a specialization file ({exc})") from exc
    if not isinstance(entries, list) or not entries:
        raise Refused(f"{path}: empty specialization list")
    required = symbols_of(inputs)
    allowed = required | symbols_of(outputs)
    for index, entry in enumerate(entries):
        if isinstance(entry.get("symbols"), dict):
            if layout == "flat":
                raise Refused(f"{path}: specialization {index}: named layout not supported by this SDK")
            entry = entry["symbols"]
        for key, value in entry.items():
            if not str(value).isdigit() or int(value) < 1:
                raise Refused(f"{path}: specialization {index}: {key}={value!r} is not a positive integer")
        missing = sorted(required - set(entry))
        unknown = sorted(set(entry) - allowed - COMPILER_KEYS)
        if missing:
            raise Refused(f"{path}: specialization {index}: no value for symbol(s) {', '.join(missing)}")
        if unknown:
            raise Refused(f"{path}: specialization {index}: unknown symbol(s) {', '.join(unknown)}")
    return len(entries)


def check_custom_io(path: Path, inputs: dict, outputs: dict) -> dict[str, str]:
    import yaml

    if not path.is_file():
        raise Refused(f"-custom-IO-list-file: {path} does not exist")
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise Refused(f"{path}: not YAML ({exc})") from exc
    if not isinstance(entries, list):
        raise Refused(f"{path}: expected a list of IOName/Precision entries")
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"IOName", "Precision"}:
            raise Refused(f"{path}: bad entry {entry!r}")
        if entry["IOName"] not in inputs and entry["IOName"] not in outputs:
            raise Refused(f"{path}: {entry['IOName']} is not an input or output of the graph")
        if entry["Precision"] not in PRECISIONS:
            raise Refused(f"{path}: unknown precision {entry['Precision']!r}")
    return {entry["IOName"]: entry["Precision"] for entry in entries}


def check_hardware(
    hw: str, switches: set[str], custom_io: dict[str, str], outputs: dict, floats: set[str]
) -> None:
    """ai200 computes in bfloat16: float16 is refused, retained float state and pixels must be bf16."""
    if hw != AI200:
        wrong = sorted(name for name, precision in custom_io.items() if precision == "bfloat16")
        if wrong:
            raise Refused(f"-aic-hw-version={hw} has no bfloat16: custom IO {wrong[0]} is bfloat16")
        return
    if "-convert-to-fp16" in switches:
        raise Refused("-convert-to-fp16 with -aic-hw-version=ai200 (ai200 computes in bfloat16)")
    half = sorted(name for name, precision in custom_io.items() if precision == "float16")
    if half:
        raise Refused(f"-aic-hw-version=ai200: custom IO {half[0]} is float16")
    retained = {name[: -len(RETAINED)] for name in outputs if name.endswith(RETAINED)}
    needed = sorted((retained & floats) | ({PIXEL_VALUES} & floats))
    missing = [name for name in needed if custom_io.get(name) != "bfloat16"]
    if missing:
        found = custom_io.get(missing[0], "not in the custom IO list")
        raise Refused(f"-aic-hw-version=ai200: {missing[0]} is {found}, not bfloat16")


def check_node_precision(path: Path, model_path: Path, switches: set[str]) -> None:
    """A plan file lists node output names of the graph under FP32NodeInstanceNames."""
    import onnx
    import yaml

    if "-convert-to-fp16" not in switches:
        raise Refused("-node-precision-info without -convert-to-fp16")
    if not path.is_file():
        raise Refused(f"-node-precision-info: {path} does not exist")
    data = yaml.safe_load(path.read_text())
    names = data.get("FP32NodeInstanceNames") if isinstance(data, dict) else None
    if not isinstance(names, list) or not names:
        raise Refused(f"{path}: expected a non-empty FP32NodeInstanceNames list")
    model = onnx.load(str(model_path), load_external_data=False)
    outputs = {o for node in model.graph.node for o in node.output}
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise Refused(f"{path}: {unknown[0]} is not a node output of the graph")


def check_partition(path: Path, num_cores: int) -> int:
    if not path.is_file():
        raise Refused(f"-mdp-load-partition-config: {path} does not exist")
    try:
        config = json.loads(path.read_text())
        devices = [d for partition in config["partitions"] for d in partition["devices"]]
        connected = set(config["connections"][0]["devices"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise Refused(f"{path}: not a partition file ({exc})") from exc
    if len(devices) < 2 or {d["deviceId"] for d in devices} != connected:
        raise Refused(f"{path}: partition devices and connections disagree")
    if any(d["numCores"] != num_cores for d in devices):
        raise Refused(f"{path}: numCores differs from -aic-num-cores={num_cores}")
    return len(devices)


def hang(binary_dir: Path, stubborn: bool = False) -> NoReturn:
    """Leave a partial output, then say so and sleep until killed.

    The line comes after the partial file, so a log that shows it proves the driver had a
    half-written directory to remove. ``stubborn`` ignores SIGTERM (recording each one).
    """
    if stubborn:

        def ignore(signum, frame):
            _record({"event": "ignored", "signal": signum, "pid": os.getpid()})

        signal.signal(signal.SIGTERM, ignore)
    binary_dir.mkdir(parents=True, exist_ok=True)
    (binary_dir / "partial.bin").write_bytes(b"partial")
    print("stand-in: hanging", flush=True)
    # the marker tests wait for
    _record({"event": "hanging", "binary_dir": str(binary_dir), "pid": os.getpid()})
    while True:
        time.sleep(60)


def compile_program(argv: list[str]) -> int:
    mode = os.environ.get("STAND_IN_MODE", "ok")
    values, switches = parse(argv)
    if mode in ("hang", "stubborn"):
        # Before the checks: they import onnx and read the graphs, which takes seconds on a loaded
        # machine, and the timeout tests give the compiler 1-1.5 s. Hanging first puts the output
        # and the partial file in place within that whatever the load.
        hang(Path(values["-aic-binary-dir"]), stubborn=mode == "stubborn")
    inputs, outputs, floats, model = graph_interface(Path(values["-m"]))
    check_functions(model, switches)
    del model
    count = check_specializations(
        Path(values["-network-specialization-config"]),
        inputs,
        outputs,
        os.environ.get("STAND_IN_LAYOUT", "any"),
    )
    custom_io = {}
    if "-custom-IO-list-file" in values:
        custom_io = check_custom_io(Path(values["-custom-IO-list-file"]), inputs, outputs)
    if values.get("-aic-hw-version", "ai100") not in HW_VERSIONS:
        raise Refused(f"unknown -aic-hw-version {values['-aic-hw-version']}")
    check_hardware(values.get("-aic-hw-version", "ai100"), switches, custom_io, outputs, floats)
    cores = int(values.get("-aic-num-cores", "16"))
    if not 1 <= cores <= 16:
        raise Refused(f"-aic-num-cores={cores} out of range")
    if "-node-precision-info" in values:
        check_node_precision(Path(values["-node-precision-info"]), Path(values["-m"]), switches)
    if "-mdp-load-partition-config" in values:
        check_partition(Path(values["-mdp-load-partition-config"]), cores)
    retained = [name for name in outputs if name.endswith("_RetainedState")]
    if "-retained-state" in switches:
        unpaired = [n for n in retained if n[: -len("_RetainedState")] not in inputs]
        if unpaired or not retained:
            raise Refused(f"-retained-state: outputs without a matching input: {unpaired or 'none retained'}")
    binary_dir = Path(values["-aic-binary-dir"])
    binary_dir.mkdir(parents=True, exist_ok=True)
    print(f"Compiling {values['-m']} with {count} specialization(s) on {cores} core(s)", flush=True)
    print("stand-in: graph checks passed", file=sys.stderr, flush=True)
    if mode == "slow":
        time.sleep(float(os.environ.get("STAND_IN_SLEEP", "1")))
    if mode == "flood":
        for line in range(200_000):
            print(f"[flood] optimization pass {line}: " + "x" * 60)
        sys.stdout.flush()
    if mode == "fail-vision":  # the vision program fails; the language program hangs until stopped
        mode = "hang" if "-retained-state" in switches else "fail"
    if mode == "hang":
        hang(binary_dir)
    if mode == "signal":  # the compiler crashes: killed by a signal after a partial output
        (binary_dir / "partial.bin").write_bytes(b"partial")
        print("stand-in: crashing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "no-program":  # exits 0 and says it finished, but writes no programqpc.bin
        print("Compilation complete", flush=True)
        return 0
    if mode == "fail":
        (binary_dir / "partial.bin").write_bytes(b"partial")
        for line in range(40):
            print(f"stand-in: failure detail {line}", file=sys.stderr)
        print("Error: stand-in failure requested (STAND_IN_MODE=fail)", file=sys.stderr, flush=True)
        return 1
    (binary_dir / "programqpc.bin").write_bytes(json.dumps({"argv": argv, "stand_in": True}).encode())
    (binary_dir / "stand_in_argv.json").write_text(json.dumps(argv, indent=1))
    print("Compilation complete", flush=True)
    return 0


def _record(entry: dict) -> None:
    record = os.environ.get("STAND_IN_RECORD")
    if record:
        with open(record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def main() -> int:
    argv = sys.argv[1:]
    _record({"argv": [sys.argv[0], *argv], "mode": os.environ.get("STAND_IN_MODE", "ok")})
    try:
        return compile_program(argv)
    except Refused as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
