"""Rotary cos/sin from bf16 position tables (qeff_vision/export/rotary_tables.py, issue 49).

For every family, each rotary module of the text model is replaced; the tables reproduce the
original module's fp32 outputs to bf16 rounding (2**-8 of cos/sin's unit range: one rounding of a
value below 1 moves it by at most 2**-9) at random positions: 1-D positions, and [3, batch, seq]
M-RoPE positions where the module takes them (Qwen2.5-VL's sectioned rows, Qwen3-VL's interleaved
sections), for each ``layer_type`` a module takes (Gemma 3 / 4: sliding and full attention
frequencies). Llama 4's text rotary returns complex frequencies and its family code computes the
angles itself: the stand-in keeps the original's attributes, its forward takes no table, and
``angle_cos_sin`` reads a table of position x inv_freq. Then the exported graphs: a bf16 export of
Qwen2.5-VL (and, slow, Llama 4) reads its rotary from tables (no ``Cos``/``Sin`` in the language
graph, export.json names the module), and an fp16-weight export is unchanged (``Cos``/``Sin``
present, no ``rotary_tables`` entry).
"""

from __future__ import annotations

import inspect
import json

import onnx
import pytest
import torch

from qeff_vision.export.rotary_tables import TableRotary, angle_cos_sin, use_rotary_tables
from qeff_vision.exporter import export_model, load_adapter
from qeff_vision.families import all_families, describe_checkpoint, family_for
from tests import helpers
from tests.test_ai200_families import bf16_checkpoint

FAMILIES = [family.name for family in all_families()]
COMPLEX_ROTARY = {"llama4"}  # returns complex frequencies; the family computes its own angles


def _text_model(checkpoint):
    family = family_for(describe_checkpoint(checkpoint))
    adapter = load_adapter(family)
    return adapter.decoder_parts(adapter.empty_model(checkpoint, torch.float32)).text_model


def _extra_arguments(module) -> list[tuple]:
    if "layer_type" in inspect.signature(module.forward).parameters:
        return [(layer_type,) for layer_type in sorted(set(module.config.layer_types))]
    return [()]


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_tables_reproduce_every_rotary_module(family, tiny_checkpoint):
    replaced = use_rotary_tables(_text_model(tiny_checkpoint(family)))
    assert replaced, "every family's text model has a rotary module"
    generator = torch.Generator().manual_seed(0)
    for name, table in replaced.items():
        assert isinstance(table, TableRotary)
        original = table.original
        assert table.config is original.config  # attribute reads reach the original
        for extra in _extra_arguments(original):
            for shape in ((2, 7), (3, 2, 7)):
                ids = torch.randint(0, table.positions, shape, generator=generator)
                try:
                    expected = original(torch.zeros(1), ids, *extra)
                except (RuntimeError, ValueError, IndexError):
                    continue  # a 1-D rotary given M-RoPE rows: not a layout the model calls
                got = table(torch.zeros(1), ids, *extra)
                if family in COMPLEX_ROTARY:
                    assert not table.used
                    continue
                assert table.used, (name, shape, extra)
                assert len(got) == len(expected) == 2
                for want, have in zip(expected, got):
                    assert want.shape == have.shape
                    assert torch.equal(have, have.to(torch.bfloat16).float())  # a bf16 value
                    assert float((want - have).abs().max()) <= 2**-8, (name, shape, extra)


def test_family_computed_angles_read_the_table(tiny_checkpoint):
    """Llama 4's family code computes position x inv_freq itself: ``angle_cos_sin`` gives the table."""
    text_model = _text_model(tiny_checkpoint("llama4"))
    original = text_model.inner.rotary_emb
    (table,) = use_rotary_tables(text_model).values()
    ids = torch.randint(0, table.positions, (2, 7), generator=torch.Generator().manual_seed(0))
    for want, have in zip(angle_cos_sin(original, ids), angle_cos_sin(table, ids)):
        assert want.shape == have.shape
        assert float((want - have).abs().max()) <= 2**-8
    assert table.used


def _cos_sin_nodes(export) -> int:
    graph = onnx.load(str(export / "lang" / "model.onnx"), load_external_data=False).graph
    return sum(1 for node in graph.node if node.op_type in ("Cos", "Sin"))


@pytest.mark.parametrize(
    ("family", "modules"),
    [("qwen2_5_vl", ["rotary_emb"]), pytest.param("llama4", ["inner.rotary_emb"], marks=pytest.mark.slow)],
)
def test_bf16_export_reads_tables_and_fp32_export_is_unchanged(family, modules, tiny_checkpoint, tmp_path):
    checkpoint = bf16_checkpoint(tiny_checkpoint(family), tmp_path / "checkpoint")
    bf16 = export_model(checkpoint, tmp_path / "bf16", progress=None, weight_dtype="bfloat16").out_dir
    fp16 = export_model(checkpoint, tmp_path / "fp16", progress=None, weight_dtype="float16").out_dir
    assert json.loads((bf16 / "export.json").read_text())["rotary_tables"] == modules
    assert _cos_sin_nodes(bf16) == 0
    assert "rotary_tables" not in json.loads((fp16 / "export.json").read_text())
    assert _cos_sin_nodes(fp16) > 0


def test_a_table_holds_at_most_max_table_rows_and_a_longer_ctx_len_is_refused(tmp_path):
    """Llama 4 Scout declares 10,485,760 positions: a 2.7 GB bf16 table, past protobuf's 2 GiB."""
    from types import SimpleNamespace

    import pytest

    from qeff_vision.compile.inputs import _check_table_positions
    from qeff_vision.errors import UserError
    from qeff_vision.export.rotary_tables import MAX_TABLE_ROWS, table_rows

    scout = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=10_485_760))
    assert table_rows(scout) == MAX_TABLE_ROWS == 131_072
    assert table_rows(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))) == 4096
    manifest = {"rotary_table_positions": MAX_TABLE_ROWS}
    _check_table_positions(SimpleNamespace(ctx_len=MAX_TABLE_ROWS), manifest, tmp_path)
    _check_table_positions(SimpleNamespace(ctx_len=10**7), {}, tmp_path)  # no tables: no bound
    with pytest.raises(UserError, match="tables of 131072 positions .* fewer than ctx_len 131073"):
        _check_table_positions(SimpleNamespace(ctx_len=MAX_TABLE_ROWS + 1), manifest, tmp_path)
