"""LLaVA-NeXT's vision program takes what the Cloud AI vLLM plugin sends (issue 36 item 4).

The plugin (vllm-qaic ``qaic_multimodal.py``, ``_pixels_to_features``) feeds a vision program the
processor's own tensors, split per image and kept only where a binding has the name: for
LLaVA-NeXT ``pixel_values`` [1, tiles, 3, S, S] and ``image_sizes`` [1, 2] int64, the names of
QEfficient's inputs. The output buffer is the selected binding's ``vision_embeds``. Here those
exact buffers go through the device-runtime stand-in over a ``compile --backend onnxruntime`` OUT,
and the graph's in-graph pinpoint choice and unpadding are checked against transformers over a
grid of image sizes.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from qeff_vision import symbols
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, describe_checkpoint
from qeff_vision.families.llava_next import IMAGE_SIZES, NUM_PATCHES, unpadded_grid
from qeff_vision.families.llava_next.export import image_geometry
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

FAMILY = "llava_next"
DOUBLE = Path(__file__).with_name("device_double")
SPECS = Path(__file__).resolve().parent.parent / "specs"
# The OUT's image sizes: three aspect ratios on the tiny checkpoint's 112x112 pinpoint (2x2 tiles),
# so one vision specialization (num_patches 5) serves them all.
COMPILED = ((100, 150), (150, 100), (112, 112))


def _own_rows_and_zeros(embeds: np.ndarray, expected: np.ndarray, where) -> None:
    """The image's rows first (transformers' features), zeros after them."""
    rows = len(expected)
    assert np.abs(embeds[:rows] - expected).max() <= 1e-4, where
    assert not embeds[rows:].any(), where


def test_the_vision_program_takes_exactly_the_processors_tensors(hf_model, exported, tiny_checkpoint):
    """Inputs named and typed as the processor returns them; each image as it comes, vs transformers."""
    import onnx

    model, processor = hf_model(FAMILY)
    graph = onnx.load(exported(FAMILY) / "vision" / "model.onnx", load_external_data=False).graph
    inputs = {value.name: value.type.tensor_type.elem_type for value in graph.input}
    assert inputs == {symbols.PIXEL_VALUES: onnx.TensorProto.FLOAT, IMAGE_SIZES: onnx.TensorProto.INT64}
    adapter = load_adapter(get_family(FAMILY))
    family, description = get_family(FAMILY), describe_checkpoint(tiny_checkpoint(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    for height, width in (*adapter.test_image_sizes, *model.config.image_grid_pinpoints, (1, 500)):
        processed = processor.image_processor(images=[helpers.image(height, width, 3)], return_tensors="np")
        assert set(processed) == {symbols.PIXEL_VALUES, IMAGE_SIZES}
        (expected,) = adapter.hf_image_features(model, processed)
        embeds = program.run({name: processed[name] for name in inputs})[symbols.VISION_EMBEDS]
        wanted = family.vision_symbols(description, ImageSize(height, width))
        assert embeds.shape == (1, wanted[symbols.VISION_SIZE], expected.shape[-1])
        assert len(expected) == family.image_tokens(description, ImageSize(height, width))
        _own_rows_and_zeros(embeds[0], expected.numpy(), (height, width))


def test_no_shape_of_the_vision_graph_follows_input_values(exported):
    """Every shape is fixed by the specialization's symbols: what the SDK compiler needs (issue 39)."""
    import onnx

    from tests.graph_shapes import value_dependent_shapes

    model = onnx.load(exported(FAMILY) / "vision" / "model.onnx", load_external_data=False)
    assert value_dependent_shapes(model, [symbols.PIXEL_VALUES, IMAGE_SIZES]) == []


def test_the_shape_check_catches_a_length_read_from_values():
    """The check flags what the previous graph did: an index range sized by image_sizes' values."""
    from onnx import TensorProto, helper

    from tests.graph_shapes import value_dependent_shapes

    nodes = [
        helper.make_node("ReduceMax", [IMAGE_SIZES], ["largest"], keepdims=0),
        helper.make_node("Shape", [symbols.PIXEL_VALUES], ["shape"]),
        helper.make_node("Range", ["zero", "largest", "one"], ["rows"]),
        helper.make_node("Expand", [symbols.PIXEL_VALUES, "shape"], ["same"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info(symbols.PIXEL_VALUES, TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info(IMAGE_SIZES, TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("rows", TensorProto.INT64, None)],
        initializer=[
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ],
    )
    found = value_dependent_shapes(helper.make_model(graph), [symbols.PIXEL_VALUES, IMAGE_SIZES])
    assert len(found) == 1 and found[0].startswith("Range")


def test_one_specialization_serves_every_aspect_ratio_of_its_tile_count(hf_model, exported, tiny_checkpoint):
    """Sizes on 1x2 and 2x1, 1x3 and 3x1, and 2x2 pinpoints: one output shape per tile count, own rows first.

    Images of the same tile count but different sizes go through one batched call too: each
    image's grids come from its own image_sizes row.
    """
    model, processor = hf_model(FAMILY)
    adapter, family = load_adapter(get_family(FAMILY)), get_family(FAMILY)
    description = describe_checkpoint(tiny_checkpoint(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    by_tiles: dict[int, list] = {}
    for height, width in (
        (100, 150),
        (150, 100),
        (112, 112),
        (90, 200),
        (300, 120),
        (60, 200),
        (120, 60),
        (60, 120),
    ):
        by_tiles.setdefault(
            family.vision_symbols(description, ImageSize(height, width))[NUM_PATCHES], []
        ).append((height, width))
    assert sorted(len(sizes) for sizes in by_tiles.values()) == [2, 3, 3]  # several aspect ratios per count
    for tiles, sizes in by_tiles.items():
        images = [helpers.image(height, width, seed) for seed, (height, width) in enumerate(sizes)]
        processed = processor.image_processor(images=images, return_tensors="np")
        assert processed[symbols.PIXEL_VALUES].shape[1] == tiles
        embeds = program.run({name: processed[name] for name in (symbols.PIXEL_VALUES, IMAGE_SIZES)})
        embeds = embeds[symbols.VISION_EMBEDS]
        assert embeds.shape[:2] == (len(sizes), family.vision_rows(description, tiles))
        expected = adapter.hf_image_features(model, processed)
        assert len({len(rows) for rows in expected}) > 1  # the sizes differ in own rows
        for index, rows in enumerate(expected):
            _own_rows_and_zeros(embeds[index], rows.numpy(), sizes[index])


def test_a_tile_axis_padded_across_images_keeps_each_images_own_tiles(hf_model, exported, tiny_checkpoint):
    """Images of different tile counts processed together: the processor pads the tile axis."""
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    images = [helpers.image(40, 40, 0), helpers.image(100, 150, 1), helpers.image(300, 120, 2)]
    processed = processor.image_processor(images=images, return_tensors="np")
    description = describe_checkpoint(tiny_checkpoint(FAMILY))
    own = [get_family(FAMILY).vision_symbols(description, ImageSize(*image.size[::-1])) for image in images]
    padded = processed[symbols.PIXEL_VALUES].shape[1]
    assert [values[NUM_PATCHES] < padded for values in own] == [True, False, True]
    embeds = program.run({name: processed[name] for name in (symbols.PIXEL_VALUES, IMAGE_SIZES)})
    for index, expected in enumerate(adapter.hf_image_features(model, processed)):
        _own_rows_and_zeros(embeds[symbols.VISION_EMBEDS][index], expected.numpy(), index)


def _geometry_for(sizes: np.ndarray, pinpoints, tile: int, side: int, tiles_given):
    height, width = (torch.as_tensor(sizes[:, i]) for i in (0, 1))
    return image_geometry(height, width, torch.tensor(pinpoints), tile, side, tiles_given)


@pytest.mark.parametrize("checkpoint", ["granite-vision-3.2-2b", "tiny"])
def test_the_graphs_integer_geometry_equals_transformers_over_a_grid_of_sizes(checkpoint, tiny_checkpoint):
    from transformers.image_processing_utils import select_best_resolution

    directory = tiny_checkpoint(FAMILY) if checkpoint == "tiny" else SPECS / "configs" / checkpoint
    model = describe_checkpoint(directory)
    family = get_family(FAMILY)
    pinpoints, tile, side = family.pinpoints(model), family.tile_size(model), family.patches_per_side(model)
    span = 5000 if checkpoint != "tiny" else 600
    axis = np.unique(np.r_[np.linspace(1, span, 90).astype(np.int64), [2500, 3753]])
    sizes = np.stack(np.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    chosen = np.array([select_best_resolution(tuple(size), pinpoints) for size in sizes.tolist()])
    tiles = (chosen[:, 0] // tile) * (chosen[:, 1] // tile)
    geometry = _geometry_for(sizes, pinpoints, tile, side, torch.as_tensor(tiles))
    assert np.array_equal(geometry.tile_rows.numpy() * tile, chosen[:, 0])
    assert np.array_equal(geometry.tile_cols.numpy() * tile, chosen[:, 1])
    grids = chosen // tile * side
    expected = np.array([unpadded_grid(*size, *grid) for size, grid in zip(sizes, grids, strict=True)])
    kept = np.stack([geometry.feature_height.numpy(), geometry.feature_width.numpy()], -1)
    assert np.array_equal(kept, expected)
    crop = np.stack([geometry.top.numpy(), geometry.left.numpy()], -1)
    assert np.array_equal(grids - kept, 2 * crop)


def test_the_tile_count_settles_where_float_rounding_and_integers_disagree():
    """2500x3753 on Granite: float scaling keeps 767 rows of 768x1536, so transformers picks 768x1152."""
    model = describe_checkpoint(SPECS / "configs" / "granite-vision-3.2-2b")
    family = get_family(FAMILY)
    pinpoints, tile, side = family.pinpoints(model), family.tile_size(model), family.patches_per_side(model)
    size = np.array([[2500, 3753]])
    assert family.image_grid(model, ImageSize(2500, 3753)).tile_cols == 3  # 768x1152: 2 x 3 tiles
    unbounded = _geometry_for(size, pinpoints, tile, side, 10**6)
    assert int(unbounded.tile_cols[0]) == 4  # exact arithmetic alone would pick 768x1536
    bounded = _geometry_for(size, pinpoints, tile, side, 6)
    assert (int(bounded.tile_rows[0]), int(bounded.tile_cols[0])) == (2, 3)


# ---- the plugin's calls, through the device-runtime stand-in ----


@pytest.fixture
def rt(monkeypatch):
    """The stand-in's qaicrt and QAicApi_pb2 for one test."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    for name in ("qaicrt", "QAicApi_pb2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("qaicrt"), importlib.import_module("QAicApi_pb2")
    for name in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_checkpoint, exported):
    """The tiny LLaVA-NeXT compiled for onnxruntime with one image size (what the tier serves)."""
    from qeff_vision import api

    root = tmp_path_factory.mktemp("llava-next-plugin")
    spec = {
        "name": "plugin-inputs",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 1024,
        "prefill": {"seq_lens": [8]},
        "vision": {"images": [{"height": h, "width": w} for h, w in COMPILED], "vision_size": "chunk"},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(
        root / "spec.yaml", root / "out", backend="onnxruntime", export_dir=exported(FAMILY), progress=None
    )
    return root / "out"


def test_the_plugins_vision_call_runs_and_matches_transformers(rt, out, hf_model):
    """Bindings, dtypes and the output buffer as the plugin builds them, then transformers' features.

    The plugin sizes the output from the binding (``_init_vision_outputs``) and vLLM reads each
    image's first placeholder-count rows (``_gather_mm_embeddings``: ``encoder_output[start:end]``),
    so one fixed-shape specialization serves all three sizes.
    """
    qaicrt, aicapi = rt
    model, processor = hf_model(FAMILY)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["programs"]["vision"]["specializations"]) == 1
    qpc = qaicrt.Qpc(str(out / "vision"))
    status, raw = qpc.getIoDescriptor()
    assert status == qaicrt.QStatus.QS_SUCCESS
    desc = aicapi.IoDesc()
    desc.ParseFromString(bytes(raw))
    bindings = {b.name: b for b in desc.selected_set.bindings}
    assert {name for name, b in bindings.items() if b.dir == 0} == {symbols.PIXEL_VALUES, IMAGE_SIZES}
    numpy = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16, aicapi.INT64_I_TYPE: np.int64}
    context = qaicrt.Context()
    program = qaicrt.Program(context, None, qpc, qaicrt.QAicProgramProperties())
    assert program.load() == qaicrt.QStatus.QS_SUCCESS
    description = describe_checkpoint(out / "model")
    for seed, size in enumerate(COMPILED):
        execution, queue = qaicrt.ExecObj(context, program), qaicrt.Queue(context, 0)
        processed = processor.image_processor(images=[helpers.image(*size, seed)], return_tensors="pt")
        # _to_np: pixel_values cast to its binding's dtype; image_sizes kept as the processor's int64.
        pixels = processed[symbols.PIXEL_VALUES].numpy().astype(numpy[bindings[symbols.PIXEL_VALUES].type])
        sizes = processed[IMAGE_SIZES].numpy()
        embeds = bindings[symbols.VISION_EMBEDS]
        output = np.empty(list(embeds.dims), numpy[embeds.type])  # _init_vision_outputs: the binding's dims
        pairs = [
            (bindings[symbols.PIXEL_VALUES].index, pixels),
            (bindings[IMAGE_SIZES].index, sizes),
            (embeds.index, output),
        ]
        assert execution.setData(pairs) == qaicrt.QStatus.QS_SUCCESS
        assert queue.enqueue(execution) == qaicrt.QStatus.QS_SUCCESS
        assert execution.waitForCompletion() == qaicrt.QStatus.QS_SUCCESS, qaicrt.ERRORS[-1:]
        (expected,) = load_adapter(get_family(FAMILY)).hf_image_features(model, processed)
        tokens = get_family(FAMILY).image_tokens(description, ImageSize(*size))
        assert tokens == len(expected) < output.shape[1] or size == (112, 112)
        np.testing.assert_allclose(
            output[0, :tokens].astype(np.float32), expected.numpy(), rtol=1e-2, atol=1e-2
        )  # fp16 IO
        assert not output[0, tokens:].any()


# ---- an export or compile of the first vision program (tile_grid / feature_grid carriers) ----


def test_exports_and_compiles_with_the_grid_carriers_are_refused_or_stale(
    exported, tiny_checkpoint, tmp_path, capsys
):
    """``compile --export`` of such an export and ``run`` of such a compile stop in one line (exit 2);
    an old OUT/export is stale, so a compile exports again."""
    import shutil

    from qeff_vision.cli import main
    from qeff_vision.export_record import EXPORT_FILE

    spec = {
        "name": "tiny-llava-next",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 512,
        "prefill": {"seq_lens": [64]},
        "vision": {"images": [{"height": 100, "width": 150}]},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    old = tmp_path / "out" / "export"
    old.mkdir(parents=True)
    record = json.loads((exported(FAMILY) / EXPORT_FILE).read_text())
    vision = record["programs"]["vision"]["inputs"]
    del vision[IMAGE_SIZES]  # the first program's inputs: pixel_values and two int64 carriers
    vision["tile_grid"] = {"axes": {"0": symbols.BATCH_SIZE, "1": "tile_rows", "2": "tile_cols"}}
    vision["feature_grid"] = {"axes": {"0": symbols.BATCH_SIZE, "1": "feature_height", "2": "feature_width"}}
    (old / EXPORT_FILE).write_text(json.dumps(record))
    for name in ("vision", "lang"):
        shutil.copytree(exported(FAMILY) / name, old / name)

    def one_line(command):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    err = one_line(["compile", str(path), "-o", str(tmp_path / "o2"), "--dry-run", "--export", str(old)])
    assert "former symbol 'feature_height' (now read from image_sizes values)" in err
    assert "export it again" in err
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert f"{old} is stale" in captured.out + captured.err
    compiled = helpers.write_vision_manifest(
        tmp_path / "compiled",
        FAMILY,
        {"batch_size": "1", "num_patches": "5", "tile_rows": "2", "tile_cols": "2"},
    )
    err = one_line(["run", str(compiled), "--prompt", "Hi"])
    assert "former symbol 'tile_cols' (now read from image_sizes values)" in err and "compile it again" in err
