"""Small synthetic graphs with the IO contract of the real exports (names, dtypes, symbolic axes).

They stand in for the exported Qwen2.5-VL programs in compile tests that do not need real weights:
the vision graph maps pixel_values [grid_height, grid_width] and image_grid_thw
[batch_size, time, grid_h, grid_w] to vision_embeds [batch_size, vision_size, hidden] with
vision_size = grid_height / 4; the language graph has every input and output of
Family.language_input_axes / language_output_axes for a given number of layers.
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_vision.families import get_family
from qeff_vision.families.base import describe_checkpoint

# The pinned Qwen2.5-VL-3B config (the vision outputs are read from its language IO table).
CONFIG_3B_DIR = Path(__file__).resolve().parents[1] / "specs" / "configs" / "Qwen2.5-VL-3B-Instruct"

HIDDEN = 16
VOCAB = 32
KV_HEADS = 2
HEAD_DIM = 4
MERGE = 4  # 2x2 patches per vision token


def _value(name, elem_type, dims):
    return helper.make_tensor_value_info(name, elem_type, list(dims))


def _dims(rank, axes, static):
    return [axes.get(axis, static.get(axis)) for axis in range(rank)]


def _save(model, path, external_data):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = helper.make_model(model, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    if external_data:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=64,
        )
    else:
        onnx.save(model, str(path))
    return path


def vision_graph(path, *, rename=None, external_data=True):
    """Qwen2.5-VL vision program. ``rename`` maps contract symbols to other names (a broken export)."""
    family = get_family("qwen2_5_vl")
    rename = rename or {}
    in_axes = {
        name: {a: rename.get(s, s) for a, s in axes.items()}
        for name, axes in family.vision_input_axes.items()
    }
    out_axes = {
        name: {a: rename.get(s, s) for a, s in axes.items()}
        for name, axes in family.vision_outputs(describe_checkpoint(CONFIG_3B_DIR)).items()
    }
    pixel = _value("pixel_values", TensorProto.FLOAT, _dims(2, in_axes["pixel_values"], {}))
    grid = _value("image_grid_thw", TensorProto.INT64, _dims(4, in_axes["image_grid_thw"], {1: 1}))
    embeds = _value("vision_embeds", TensorProto.FLOAT, _dims(3, out_axes["vision_embeds"], {2: HIDDEN}))
    weight = numpy_helper.from_array(
        np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32).reshape(1, 1, HIDDEN), "weight"
    )
    consts = [
        numpy_helper.from_array(np.array([-1, MERGE], dtype=np.int64), "rows_shape"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
        numpy_helper.from_array(np.array([HIDDEN], dtype=np.int64), "hidden"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["pixel_values"], ["row_mean"], axes=[1], keepdims=0),
        helper.make_node("Reshape", ["row_mean", "rows_shape"], ["groups"]),
        helper.make_node("ReduceMean", ["groups"], ["token"], axes=[1], keepdims=0),
        helper.make_node("Shape", ["image_grid_thw"], ["grid_shape"]),
        helper.make_node("Slice", ["grid_shape", "zero", "one"], ["batch"]),
        helper.make_node("Shape", ["token"], ["tokens"]),
        helper.make_node("Concat", ["batch", "tokens", "hidden"], ["out_shape"], axis=0),
        helper.make_node("Reshape", ["token", "tokens_3d"], ["token_3d"]),
        helper.make_node("Mul", ["token_3d", "weight"], ["scaled"]),
        helper.make_node("Expand", ["scaled", "out_shape"], ["vision_embeds"]),
    ]
    consts.append(numpy_helper.from_array(np.array([1, -1, 1], dtype=np.int64), "tokens_3d"))
    graph = helper.make_graph(nodes, "vision", [pixel, grid], [embeds], initializer=[weight, *consts])
    return _save(graph, path, external_data)


def language_graph(path, *, num_layers=2, rename=None, external_data=True):
    """Language program with the full QEfficient-compatible IO of ``num_layers`` layers."""
    family = get_family("qwen2_5_vl")
    rename = rename or {}

    def renamed(axes):
        return {name: {a: rename.get(s, s) for a, s in ax.items()} for name, ax in axes.items()}

    in_axes = renamed(family.language_input_axes(num_layers))
    out_axes = renamed(family.language_output_axes(num_layers))
    kv_static = {1: KV_HEADS, 3: HEAD_DIM}
    inputs = [
        _value("input_ids", TensorProto.INT64, _dims(2, in_axes["input_ids"], {})),
        _value("position_ids", TensorProto.INT64, _dims(3, in_axes["position_ids"], {0: 4})),
        _value("vision_embeds", TensorProto.FLOAT, _dims(3, in_axes["vision_embeds"], {2: HIDDEN})),
        _value("image_idx", TensorProto.INT64, [1, 1]),
    ]
    outputs = [
        _value("logits", TensorProto.FLOAT, _dims(3, out_axes["logits"], {1: 1, 2: VOCAB})),
        _value(
            "vision_embeds_RetainedState",
            TensorProto.FLOAT,
            _dims(3, out_axes["vision_embeds_RetainedState"], {2: HIDDEN}),
        ),
        _value("image_idx_output", TensorProto.INT64, [1, 1]),
    ]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["ids_float", "axis1"], ["ids_sum"], keepdims=1),
        helper.make_node("Unsqueeze", ["ids_sum", "axis2"], ["ids_3d"]),
        helper.make_node("Mul", ["ids_3d", "vocab_row"], ["logits"]),
        helper.make_node("Identity", ["vision_embeds"], ["vision_embeds_RetainedState"]),
        helper.make_node("Add", ["image_idx", "zero_idx"], ["image_idx_output"]),
    ]
    for layer in range(num_layers):
        for kind in ("past_key", "past_value"):
            name = f"{kind}.{layer}"
            inputs.append(_value(name, TensorProto.FLOAT, _dims(4, in_axes[name], kv_static)))
            outputs.append(
                _value(
                    f"{name}_RetainedState",
                    TensorProto.FLOAT,
                    _dims(4, out_axes[f"{name}_RetainedState"], kv_static),
                )
            )
            nodes.append(helper.make_node("Identity", [name], [f"{name}_RetainedState"]))
    initializers = [
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
        numpy_helper.from_array(np.ones((1, 1, VOCAB), dtype=np.float32), "vocab_row"),
        numpy_helper.from_array(np.zeros((1, 1), dtype=np.int64), "zero_idx"),
    ]
    graph = helper.make_graph(nodes, "lang", inputs, outputs, initializer=initializers)
    return _save(graph, path, external_data)


def vision_specialization(grid_h, grid_w, batch_size=1, grid_width=1176):
    return {
        "batch_size": batch_size,
        "time": 1,
        "grid_h": grid_h,
        "grid_w": grid_w,
        "grid_height": grid_h * grid_w,
        "grid_width": grid_width,
        "vision_size": grid_h * grid_w // MERGE,
    }


def language_specialization(seq_len, vision_size, ctx_len=256, batch_size=1, vision_batch_size=1):
    return {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "ctx_len": ctx_len,
        "vision_batch_size": vision_batch_size,
        "vision_size": vision_size,
    }
