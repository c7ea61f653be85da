"""Program sessions: run one compiled program on onnxruntime, or on the device when the SDK is present.

An :class:`OnnxProgram` accepts only input shapes that bind the graph's symbols to one of its
specializations — exactly what a device QPC enforces — so a host loop that works here sends the
shapes the hardware will accept. Without specializations (a bare export) any shape runs.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qeff_vision.errors import UserError


class ShapeMismatch(UserError):
    """Inputs bind the graph's symbols to values no specialization was compiled for."""


class OnnxProgram:
    """One ONNX program on onnxruntime (CPU), with specialization checking and timing.

    Args:
        onnx_path: The program's model.onnx (external data beside it).
        specializations: Symbol -> value mappings the program was compiled for; None accepts any.
        threads: Intra-op threads (0 lets onnxruntime choose).
    """

    def __init__(
        self,
        onnx_path: str | Path,
        specializations: Sequence[Mapping[str, object]] | None = None,
        threads: int = 0,
    ):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise UserError(
                f"{onnx_path}: onnxruntime cannot load the graph ({str(exc).splitlines()[0]})"
            ) from exc
        self.path = Path(onnx_path)
        self.input_dims = {i.name: list(i.shape) for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.specializations = (
            None
            if specializations is None
            else [{k: int(v) for k, v in spec.items()} for spec in specializations]
        )
        self.calls = 0
        self.seconds = 0.0

    def bind_symbols(self, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Symbol values implied by the feeds' shapes; raises on a missing input or a conflict."""
        bound: dict[str, int] = {}
        for name, dims in self.input_dims.items():
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

    def check_specialization(self, bound: Mapping[str, int]) -> None:
        """Raise unless ``bound`` agrees with one compiled specialization on every shared symbol."""
        if self.specializations is None:
            return
        for spec in self.specializations:
            if all(spec.get(symbol, value) == value for symbol, value in bound.items()):
                return
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
        self.check_specialization(self.bind_symbols(feeds))
        start = time.perf_counter()
        outputs = self.session.run(self.output_names, dict(feeds))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return dict(zip(self.output_names, outputs))


def qaic_runtime_available() -> bool:
    """True when the Cloud AI 100 SDK's Python runtime (``qaicrt``) is importable."""
    return importlib.util.find_spec("qaicrt") is not None


class QaicProgram:
    """Adapter over the SDK's Python runtime for a compiled QPC directory.

    The SDK runtime cannot be installed on machines without the accelerator stack; constructing
    this class there raises a :class:`UserError` saying so, instead of faking a device. Where
    ``qaicrt`` is importable, execution through it is not implemented in this build yet (it
    could not be tested here); that too is one clear error rather than a guess at its API.
    """

    def __init__(self, qpc_dir: str | Path, device_ids: Sequence[int] = (0,)):
        self.path = Path(qpc_dir)
        if not qaic_runtime_available():
            raise UserError(
                f"{self.path}: a qaic artifact needs the Cloud AI 100 runtime (qaicrt, from the SDK's "
                "Platform package), which is not importable here; compile with --backend onnxruntime "
                "to run on this machine"
            )
        raise UserError(  # pragma: no cover - only on machines with the SDK
            f"{self.path}: qaicrt is importable, but running QPCs through it is not implemented in "
            "this version of qeff-vision; serve the QPCs with vLLM (`qeff-vision compile --print-serve`)"
        )
