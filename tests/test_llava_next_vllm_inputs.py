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
COMPILED = (100, 150)  # the OUT's one image size (pinpoint 112x112 of the tiny checkpoint)


def test_the_vision_program_takes_exactly_the_processors_tensors(hf_model, exported):
    """Inputs named and typed as the processor returns them; each image as it comes, vs transformers."""
    import onnx

    model, processor = hf_model(FAMILY)
    graph = onnx.load(exported(FAMILY) / "vision" / "model.onnx", load_external_data=False).graph
    inputs = {value.name: value.type.tensor_type.elem_type for value in graph.input}
    assert inputs == {symbols.PIXEL_VALUES: onnx.TensorProto.FLOAT, IMAGE_SIZES: onnx.TensorProto.INT64}
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    for height, width in (*adapter.test_image_sizes, *model.config.image_grid_pinpoints, (1, 500)):
        processed = processor.image_processor(images=[helpers.image(height, width, 3)], return_tensors="np")
        assert set(processed) == {symbols.PIXEL_VALUES, IMAGE_SIZES}
        (expected,) = adapter.hf_image_features(model, processed)
        embeds = program.run({name: processed[name] for name in inputs})[symbols.VISION_EMBEDS]
        assert embeds.shape == (1, *expected.shape)
        assert np.abs(embeds[0] - expected.numpy()).max() <= 1e-4, (height, width)


def test_a_tile_axis_padded_across_images_is_cut_to_each_images_tiles(hf_model, exported, tiny_checkpoint):
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
    for index, expected in enumerate(adapter.hf_image_features(model, processed)):
        feeds = {name: processed[name][index : index + 1] for name in (symbols.PIXEL_VALUES, IMAGE_SIZES)}
        embeds = program.run(feeds)[symbols.VISION_EMBEDS]
        assert embeds.shape == (1, *expected.shape)
        assert np.abs(embeds[0] - expected.numpy()).max() <= 1e-4, index


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
        "vision": {"images": [{"height": COMPILED[0], "width": COMPILED[1]}], "vision_size": "chunk"},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(
        root / "spec.yaml", root / "out", backend="onnxruntime", export_dir=exported(FAMILY), progress=None
    )
    return root / "out"


def test_the_plugins_vision_call_runs_and_matches_transformers(rt, out, hf_model):
    """Bindings, dtypes and the output buffer as the plugin builds them, then transformers' features."""
    qaicrt, aicapi = rt
    model, processor = hf_model(FAMILY)
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
    execution, queue = qaicrt.ExecObj(context, program), qaicrt.Queue(context, 0)
    processed = processor.image_processor(images=[helpers.image(*COMPILED, 5)], return_tensors="pt")
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
    tokens = get_family(FAMILY).image_tokens(describe_checkpoint(out / "model"), ImageSize(*COMPILED))
    assert output.shape == (1, tokens, expected.shape[-1]) == (1, *expected.shape)
    np.testing.assert_allclose(
        output[0].astype(np.float32), expected.numpy(), rtol=1e-2, atol=1e-2
    )  # fp16 IO
