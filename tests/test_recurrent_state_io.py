"""The recurrent layer kind in the language IO table: conv and recurrent state rows beside the KV rows."""

import numpy as np

from qeff_vision import symbols
from qeff_vision.compile.onnxruntime_backend import untouched_slot_problems
from qeff_vision.contract.language_io import (
    CONV_DIM,
    CONV_KERNEL,
    SLOT_ROLES,
    STATE_KEY_DIM,
    STATE_VALUE_DIM,
    STATE_VALUE_HEADS,
    DType,
    Role,
    language_io,
)
from qeff_vision.contract.slot_names import is_kv_name, is_slot_name, is_state_name
from qeff_vision.spec.compile_options import parse_compile_options

DIMS = {
    CONV_DIM: 12,
    CONV_KERNEL: 4,
    STATE_VALUE_HEADS: 4,
    STATE_KEY_DIM: 2,
    STATE_VALUE_DIM: 3,
    "num_kv_heads": 2,
    "head_dim": 8,
    symbols.CTX_LEN: 16,
}


def _table(continuous_batching=False):
    return language_io(4, 4, recurrent_layers=(0, 1, 2), continuous_batching=continuous_batching)


def test_recurrent_layers_have_state_rows_in_layer_order():
    io = _table()
    slot_rows = io.rows(*SLOT_ROLES)
    assert [row.name for row in slot_rows] == [
        "conv_state.0",
        "recurrent_state.0",
        "conv_state.1",
        "recurrent_state.1",
        "conv_state.2",
        "recurrent_state.2",
        "past_key.3",
        "past_value.3",
    ]
    conv, state = slot_rows[0], slot_rows[1]
    assert conv.role is Role.CONV_STATE and state.role is Role.RECURRENT_STATE
    assert conv.dtype is DType.STATE and state.dtype is DType.STATE
    assert conv.concrete_shape({**DIMS, symbols.BATCH_SIZE: 2}) == (2, 12, 4)
    assert state.concrete_shape({**DIMS, symbols.BATCH_SIZE: 2}) == (2, 4, 2, 3)
    # Retained pairs: every state input comes back as its _RetainedState output, in input order.
    outputs = io.output_names
    assert outputs[outputs.index("conv_state.0_RetainedState") + 1] == "recurrent_state.0_RetainedState"
    assert io.retained_outputs()["recurrent_state.2"] == "recurrent_state.2_RetainedState"


def test_continuous_batching_puts_slots_on_dim_0_of_state_rows():
    io = _table(continuous_batching=True)
    for row in io.rows(*SLOT_ROLES):
        assert row.axes[0] == symbols.FULL_BATCH_SIZE
    assert io.inputs[-1].name == symbols.BATCH_INDEX


def test_state_rows_have_their_own_precision_in_custom_io():
    io = _table()
    precision = dict(io.custom_io({DType.COMPUTE: "float16", DType.KV: "mxint8", DType.STATE: "float32"}))
    assert (
        precision["conv_state.1"] == "float32" and precision["recurrent_state.1_RetainedState"] == "float32"
    )
    assert precision["past_key.3"] == "mxint8"


def test_state_dtype_is_a_language_option():
    options, problems = parse_compile_options({"language": {"state_dtype": "float16"}})
    assert not problems and options.language.state_dtype == "float16"
    assert options.vision.state_dtype == "float32"  # default, unused by the vision program
    _, problems = parse_compile_options({"vision": {"state_dtype": "float16"}})
    assert problems == ["compile.vision.state_dtype: applies to the language program only"]
    _, problems = parse_compile_options({"language": {"state_dtype": "bfloat16"}})
    assert len(problems) == 1 and "state_dtype" in problems[0]


def test_state_names_are_slot_names():
    assert is_state_name("conv_state.3") and is_state_name("recurrent_state.0_RetainedState")
    assert not is_kv_name("conv_state.3") and is_slot_name("conv_state.3") and is_slot_name("past_key.1")
    assert not is_slot_name("vision_embeds_RetainedState")


def test_slot_check_covers_state_rows():
    state = np.zeros((3, 4, 2, 3), np.float32)
    changed = state.copy()
    changed[2] = 1.0  # slot 2, which batch_index does not name
    feeds = {"recurrent_state.0": state, symbols.BATCH_INDEX: np.array([[0]])}
    problems = untouched_slot_problems(feeds, {"recurrent_state.0_RetainedState": changed})
    assert problems and "recurrent_state.0_RetainedState" in problems[0]
    assert not untouched_slot_problems(feeds, {"recurrent_state.0_RetainedState": state})
