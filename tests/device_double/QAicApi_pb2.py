"""Test double of the SDK's IoDesc protobuf module: the fields the product and the vLLM plugin read.

``IoDesc.selected_set.bindings`` (name, index, dir, type, dims, size, is_partial_buf_allowed) and
``IoDesc.allowed_shapes[i].shapes[j]`` (type, dims: binding ``j`` in specialization ``i``), as
``vllm_qaic/model_loader/qaic_session_np.py`` reads them.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

# ref: the SDK's QAicApi.proto enum values as the plugin's aic_to_np_dtype_mapping keys them
FLOAT_TYPE = 1
FLOAT_16_TYPE = 2
INT8_Q_TYPE = 3
UINT8_Q_TYPE = 4
INT16_Q_TYPE = 5
INT32_I_TYPE = 6
INT64_I_TYPE = 7
INT32_Q_TYPE = 8
INT8_TYPE = 9
BUFFER_IO_TYPE_INPUT = 0
BUFFER_IO_TYPE_OUTPUT = 1


class IoBinding(SimpleNamespace):
    """One binding of the selected set."""


class IoDesc:
    """``ParseFromString`` takes the JSON the qaicrt double serializes."""

    def __init__(self):
        self.selected_set = SimpleNamespace(bindings=[])
        self.allowed_shapes = []

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802 - the protobuf API's name
        parsed = json.loads(data.decode())
        self.selected_set.bindings = [IoBinding(**binding) for binding in parsed["bindings"]]
        self.allowed_shapes = [
            SimpleNamespace(shapes=[SimpleNamespace(type=t, dims=list(d)) for t, d in shape_set])
            for shape_set in parsed["allowed_shapes"]
        ]
