"""Test double of the SDK's IoDesc protobuf module: just the fields QaicProgram reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

FLOAT_TYPE = 1
FLOAT_16_TYPE = 2
INT64_I_TYPE = 7
INT32_I_TYPE = 6
INT8_TYPE = 9
BUFFER_IO_TYPE_INPUT = 0
BUFFER_IO_TYPE_OUTPUT = 1


class IoDesc:
    """``ParseFromString`` takes the JSON the qaicrt double serializes."""

    def __init__(self):
        self.selected_set = SimpleNamespace(bindings=[])

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802 - the protobuf API's name
        bindings = json.loads(data.decode())
        self.selected_set.bindings = [SimpleNamespace(**binding) for binding in bindings]
