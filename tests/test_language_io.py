"""The language IO table: one declaration, torch-free, from which the family axes derive."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.contract.language_io import DType, Role, language_io
from qeff_vision.contract.states import FullAttention
from qeff_vision.families import get_family
from qeff_vision.families.qwen2_5_vl import Qwen2_5_VL
from qeff_vision.spec import load_spec, specializations
from qeff_vision.spec.specializations import build_specializations


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


class RowsDeclaringFamily(Qwen2_5_VL):
    """Qwen2.5-VL plus two declared rows: a stacked vision input and a per-layer cache length.

    Nothing in export/, spec/, compile/ or runtime/ knows these names; they must flow from the
    rows alone.
    """

    name = "rows_declaring_test"
    stacked_vision_rows = {"region_rows": "region_depth"}

    def language_symbols(self, model):
        return {"region_depth": 2}

    def layer_caches(self, model):
        return [FullAttention("short_ctx"), *super().layer_caches(model)[1:]]

    def kv_cache_lengths(self, model, ctx_len):
        return {**super().kv_cache_lengths(model, ctx_len), "short_ctx": ctx_len // 2}


SPEC_3B = Path(__file__).resolve().parents[1] / "specs" / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct.yaml"


def test_declared_rows_flow_through_export_specializations_custom_io_and_feeds(monkeypatch):
    from qeff_vision import exporter
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    family = RowsDeclaringFamily()
    spec = load_spec(SPEC_3B)
    model = spec.model_description
    hidden = family.text_dims(model).hidden_size
    io = family.language_table(model)

    # Export: dynamic axes and traced example inputs.
    axes = io.input_axes()
    assert axes["region_rows"] == {0: "region_depth", 1: symbols.VISION_BATCH_SIZE, 2: symbols.VISION_SIZE}
    assert axes[symbols.past_key(0)] == {0: symbols.BATCH_SIZE, 2: "short_ctx"}
    assert io.output_axes()[symbols.retained("region_rows")] == axes["region_rows"]
    example = dict(
        zip(io.input_names, exporter.language_example(io, exporter.example_values(family, model), 5))
    )
    assert tuple(example["region_rows"].shape) == (2, 1, exporter.EXAMPLE_VISION_ROWS, hidden)
    assert example[symbols.past_key(0)].shape[2] == exporter.EXAMPLE_CTX_LEN // 2
    assert example[symbols.past_key(1)].shape[2] == exporter.EXAMPLE_CTX_LEN
    assert family.vision_outputs(model)["region_rows"] == {
        0: "region_depth",
        1: symbols.BATCH_SIZE,
        2: symbols.VISION_SIZE,
    }

    # Specializations and custom IO.
    monkeypatch.setattr(specializations, "get_family", lambda name: family)
    built = build_specializations(spec)
    for specialization in built.language.specializations:
        assert specialization.symbols["region_depth"] == "2"
        assert specialization.symbols["short_ctx"] == str(spec.ctx_len // 2)
    custom = dict(built.language.custom_io)
    assert custom["region_rows"] == custom[symbols.retained("region_rows")] == custom[symbols.VISION_EMBEDS]
    assert ("region_rows", custom["region_rows"]) in built.vision.custom_io

    # Runtime: caches shaped per layer, vision rows split into the declared input, feeds in graph order.
    shape = LanguageShape((PrefillBucket(8, 4),), 4, 64)
    checkpoint = Checkpoint(model, family)
    generator = Generator(
        checkpoint, None, SimpleNamespace(retains_state=False, input_dims={}), shape, eos_token_ids=()
    )
    past = generator.empty_cache()
    assert past[symbols.past_key(0)].shape[2] == 32 and past[symbols.past_value(1)].shape[2] == 64
    rows = generator._vision_feeds_of_rows(np.ones((1, 4, generator.row_width), np.float32))
    assert rows["region_rows"].shape == (2, 1, 4, hidden)
    feeds = generator.io.feeds(
        {
            Role.TOKEN_IDS: np.zeros((1, 8), np.int64),
            Role.POSITIONS: np.zeros((3, 1, 8), np.int64),
            Role.VISION_ROWS: rows,
            Role.VISION_CURSOR: np.zeros((1, 1), np.int64),
            Role.KV_KEY: past,
            Role.KV_VALUE: past,
        }
    )
    assert list(feeds) == io.input_names
