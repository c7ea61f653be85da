"""Symbol names of every family's programs against QEfficient's (vllm-qaic loads QEfficient QPCs).

The reference tables are QEfficient's ``get_onnx_dynamic_axes`` (quic/efficient-transformers,
``QEfficient/transformers/models/<family>/modeling_<family>.py``, kv_offload=True). Where QEfficient
makes an axis dynamic that ours keeps fixed (a tower's tile side), ours is a subset; the
differences that are deliberate are listed in DELIBERATE with the reason (docs/design.md says more).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qeff_vision.families import all_families, get_family
from qeff_vision.spec import load_spec

SPECS = Path(__file__).resolve().parents[1] / "specs"
B, S = "batch_size", "seq_len"
QWEN_VISION = {
    "pixel_values": {0: "grid_height", 1: "grid_width"},
    "image_grid_thw": {0: B, 1: "time", 2: "grid_h", 3: "grid_w"},
}
QEFFICIENT_VISION = {
    "llava": {"pixel_values": {0: B, 2: "img_size", 3: "img_size"}},
    "llava_next": {
        "pixel_values": {0: B, 1: "num_patches", 3: "img_size", 4: "img_size"},
        "image_sizes": {0: "image_size_height", 1: "image_size_width"},
    },
    "gemma3": {"pixel_values": {0: B, 2: "img_size", 3: "img_size"}},
    "gemma4": {"pixel_values": {0: B, 1: "max_patches"}, "image_position_ids": {0: B, 1: "max_patches"}},
    "internvl": {"pixel_values": {0: "batched_num_patches", 2: "img_size", 3: "img_size"}},
    "mllama": {
        "pixel_values": {0: B, 1: "max_num_images", 4: "img_size", 5: "img_size"},
        "aspect_ratio_ids": {0: B, 1: "max_num_images"},
        "aspect_ratio_mask": {0: B, 1: "max_num_images"},
    },
    "llama4": {"pixel_values": {0: "max_num_tiles", 2: "img_size", 3: "img_size"}},
    # QEffKimiK25ForConditionalGeneration.get_onnx_dynamic_axes (its language input is image_embeds
    # [num_image_tokens, hidden]; ours keeps vision_embeds [vision_batch_size, vision_size, hidden]).
    "kimi_k25": {"pixel_values": {0: "num_patches"}, "h_shape": {0: "h"}, "w_shape": {0: "w"}},
    "mistral3": {"pixel_values": {0: B, 2: "image_size", 3: "image_size"}},
    **{name: QWEN_VISION for name in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")},
    # QEfficient has no GLM-4.1V; its GLM-OCR (QEfficient/transformers/models/glm_ocr, the same
    # patch tower and 4-row M-RoPE positions) is the nearest table.
    "glm4v": {"pixel_values": {0: "grid_height", 1: "grid_width"}, "image_grid_thw": {0: B}},
}
#: Families whose position_ids are [rows, batch_size, seq_len] in QEfficient's tables (M-RoPE).
M_ROPE = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v")
#: Family -> {our vision input: why it differs from QEfficient's on purpose}.
DELIBERATE = {
    "mistral3": {"pixel_values": "image_height / image_width: any aspect ratio (QEfficient: image_size)"},
    "llava_next": {
        "image_sizes": "[batch_size, 2] as the processor returns it and the plugin sends it; QEfficient "
        "names its axes image_size_height / image_size_width, and its trace reads the values as "
        "constants of the 1109x1610 example, where ours reads them in the graph",
    },
    "glm4v": {
        "image_grid_thw": "[batch_size, time, grid_h, grid_w]: the grid rides on the shape, "
        "QEfficient's Qwen-VL layout, so one graph serves every resolution; QEfficient's GLM-OCR "
        "reads the grid with .item() at trace time and compiles the example's resolution only",
    },
}
LANGUAGE_ROWS = ("input_ids", "position_ids", "vision_embeds", "batch_index")
#: QEfficient's vision_embeds is [vision_size, hidden] for these; ours stays [vision_batch_size,
#: vision_size, hidden] for every family (one merge rule, one host); the symbols are the same.
RANK_2_VISION_ROWS = ("mistral3", "llama4")


def _qefficient_language(name: str) -> dict[str, dict[int, str]]:
    """QEfficient's language axes of the rows every token-merge family shares (continuous batching)."""
    positions = {1: B, 2: S} if name in M_ROPE else {0: B, 1: S}
    vision = {0: "vision_batch_size", 1: "vision_size"}
    if name == "internvl":
        vision = {1: "vision_size"}  # axis 0 fixed at 1; ours binds vision_batch_size 1
    if name in RANK_2_VISION_ROWS:
        vision = {0: "vision_size"}
    return {
        "input_ids": {0: B, 1: S},
        "position_ids": positions,
        "vision_embeds": vision,
        "batch_index": {0: B},
    }


def _model(name: str):
    for path in sorted((SPECS / name).glob("*.yaml")):
        return load_spec(path).model_description
    raise AssertionError(f"no spec for {name}")


@pytest.mark.parametrize("name", sorted(QEFFICIENT_VISION))
def test_vision_inputs_use_qefficients_symbols(name):
    deliberate = DELIBERATE.get(name, {})
    for io, axes in get_family(name).vision_input_axes.items():
        if io not in deliberate:
            assert dict(axes).items() <= QEFFICIENT_VISION[name][io].items(), (io, axes)


@pytest.mark.parametrize("name", sorted(f.name for f in all_families() if f.name != "mllama"))
def test_language_rows_use_qefficients_symbols(name):
    family = get_family(name)
    table = family.language_table(_model(name), continuous_batching=True)
    ours = {row.name: row.axes for row in table.inputs if row.name in LANGUAGE_ROWS}
    for io, axes in _qefficient_language(name).items():
        if io == "vision_embeds" and name in RANK_2_VISION_ROWS:
            assert set(axes.values()) <= set(ours[io].values()), ours[io]
            continue
        assert axes.items() <= ours[io].items(), (io, ours[io])
        assert set(ours[io].values()) - set(axes.values()) <= {"vision_batch_size"}, (io, ours[io])


def test_former_symbols_name_a_current_vision_symbol_and_no_longer_appear():
    renamed = {f.name: dict(f.former_symbols) for f in all_families() if f.former_symbols}
    assert set(renamed) == {"gemma3", "gemma4", "internvl", "llava_next"}
    for name, former in renamed.items():
        current = {s for axes in get_family(name).vision_input_axes.values() for s in axes.values()}
        assert set(former.values()) <= current and not set(former) & current, name
        assert get_family(name).former_symbol_note(["batch_size", *former]) is not None
