"""An fp32 program for calibration runs: every float node output's peak recorded, slice by slice.

Apart from :mod:`qeff_vision.compile.calibration` so that both calibrations (generation and
pooling, :mod:`qeff_vision.compile.pooling_calibration`) import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision.runtime.session import CompiledProgram, int_specializations


class RecordingProgram(CompiledProgram):
    """An fp32 program that records the largest magnitude of every float node output it computes.

    It runs the graph slice by slice (:class:`~qeff_vision.numerics.recording.SlicedRecorder`):
    no session holds the whole graph's weights, and each value is reduced to its peak as it is
    produced, so memory does not grow with depth.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        specializations=None,
        slice_bytes: int | None = None,
        deferred: bool = False,
    ):
        from onnx.helper import tensor_dtype_to_np_dtype

        from qeff_vision.numerics.device import float_outputs, value_types
        from qeff_vision.numerics.layer_functions import load_flat_graph
        from qeff_vision.numerics.recording import DEFAULT_SLICE_BYTES, SlicedRecorder

        super().__init__()
        self.path = Path(onnx_path)
        model = load_flat_graph(self.path)  # every call of a layer function recorded on its own
        graph = model.graph
        self.input_dims = {value.name: _dims(value) for value in graph.input}
        self.input_dtypes = {
            value.name: tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type) for value in graph.input
        }
        self.output_names = [value.name for value in graph.output]
        self.output_dims = {value.name: _dims(value) for value in graph.output}
        self.specializations = int_specializations(specializations)
        types = value_types(model)
        self.recorder = SlicedRecorder(
            model,
            self.path.parent,
            float_outputs(model, types),
            types,
            self.output_names,
            slice_bytes=slice_bytes or DEFAULT_SLICE_BYTES,
        )
        self.tape = None
        if deferred:
            from qeff_vision.numerics.deferred import Tape

            self.tape = Tape(self.recorder)
        #: Outputs of calls already run, by the content of their inputs (images encoded in the
        #: collecting round are served from here afterwards).
        self.memo: dict[str, dict[str, Any]] = {}
        self.remember = False  # queued calls' outputs go to the memo (the collecting round)
        #: The input shapes of every call made so far (a specialization, with its bucket sizes).
        self.shapes_run: set[tuple] = set()

    @property
    def ranges(self) -> dict[str, float]:
        """Node output -> largest magnitude recorded so far."""
        return self.recorder.ranges

    def _execute(self, feeds, bound):
        self.shapes_run.add(call_shapes(feeds))
        key = _feeds_key(feeds) if self.memo or self.remember else None
        if key is not None and key in self.memo:
            return dict(self.memo[key])
        if self.tape is not None:  # outputs computed when first read, many calls in one pass
            outputs = self.tape.add(feeds, self.output_names)
            if self.remember:
                self.memo[key] = outputs
            return outputs
        return self.recorder.run(feeds)

    def queue(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Add a call whose outputs nobody reads (a generated input): its peaks only."""
        self.shapes_run.add(call_shapes(feeds))
        if self.tape is not None:
            self.tape.add(feeds, [])
        else:
            self.recorder.run(feeds)

    def settle(self) -> None:
        """Run the queued calls; the memo's outputs become arrays."""
        if self.tape is not None:
            self.tape.run()
        self.memo = {key: {n: np.asarray(v) for n, v in out.items()} for key, out in self.memo.items()}
        self.remember = False


def call_shapes(feeds: Mapping[str, Any]) -> tuple:
    """A call's input names and shapes: which specialization (and bucket) it runs."""
    return tuple(sorted((name, tuple(np.shape(value))) for name, value in feeds.items()))


def _feeds_key(feeds: Mapping[str, Any]) -> str:
    """A digest of a call's inputs (names, types, shapes and bytes)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.data)
    return digest.hexdigest()


def _dims(value) -> list:
    """A graph value's dims as a session reports them: ints, symbol names, None when unknown."""
    dims = []
    for dim in value.type.tensor_type.shape.dim:
        dims.append(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None))
    return dims
