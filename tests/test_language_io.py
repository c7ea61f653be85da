"""The language IO table: one declaration, torch-free, from which the family axes derive."""

import subprocess
import sys

import pytest

from qeff_vision import symbols
from qeff_vision.contract.language_io import DType, Role, language_io
from qeff_vision.families import get_family


def test_table_is_torch_free():
    code = (
        "import qeff_vision.contract.language_io, qeff_vision.runtime.planner, sys;"
        " assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_retained_input_has_its_output_with_the_same_axes():
    io = language_io(2, position_id_rows=3, cache_symbols=[symbols.SLIDING_WINDOW, symbols.CTX_LEN])
    outputs = {row.name: row for row in io.outputs}
    for row in io.inputs:
        if row.retained and row.role is not Role.VISION_CURSOR:
            assert outputs[row.retained].axes == row.axes
    kv = [row for row in io.inputs if row.dtype is DType.KV]
    assert [row.layer for row in kv] == [0, 0, 1, 1]
    assert kv[0].axes[2] == symbols.SLIDING_WINDOW and kv[2].axes[2] == symbols.CTX_LEN
    assert io.input_axes()[symbols.POSITION_IDS] == {1: symbols.BATCH_SIZE, 2: symbols.SEQ_LEN}


def test_comp_ctx_lengths_row_is_last_input():
    io = language_io(1, comp_ctx_lengths=True)
    assert io.inputs[-1].name == symbols.COMP_CTX_LENGTHS
    assert symbols.COMP_CTX_LENGTHS in io.symbols()


def test_cache_symbols_must_cover_every_layer():
    with pytest.raises(ValueError, match="2 cache symbols for 3 layers"):
        language_io(3, cache_symbols=[symbols.CTX_LEN] * 2)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3"])
def test_family_axes_come_from_the_table(name):
    family = get_family(name)
    table = language_io(2, family.position_id_rows)
    assert family.language_input_axes(2) == table.input_axes()
    assert family.language_output_axes(2) == table.output_axes()
