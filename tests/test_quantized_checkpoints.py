"""Reading published quantized formats: exact dequantization, stored forms, the config's rules, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from qeff_vision.errors import UserError
from qeff_vision.export.quantization.rules import not_converted, targeted
from qeff_vision.export.quantization.stored import stored_form
from qeff_vision.export.quantized_weight import QuantizedWeight
from qeff_vision.export.weight_sources import MergedSource, SlicedSource, Source
from qeff_vision.export.weights import build_without_weights
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from tests.quantized_fixtures import FORMATS, write_quantized

FAMILIES = [family.name for family in all_families()]
# Each format on the families whose releases use it, plus families whose loading converts the
# quantized tensors (stacked, swapped, cut, rotary-permuted): every conversion meets every format.
MATRIX = sorted(
    {(family, "fp8-block") for family in FAMILIES}
    | {(family, fmt) for fmt in FORMATS for family in ("qwen2_5_vl", "kimi_k25", "molmo2")}
    | {("llama4", "fp8-channel"), ("qwen3_vl_moe", "fp8-channel"), ("qwen3_5_moe", "ct-int4")}
)


def _plans(tiny_checkpoint, tmp_path, family, fmt):
    """Weight plans of the quantized checkpoint and of its reference dequantization."""
    quantized, reference = tmp_path / "q", tmp_path / "r"
    write_quantized(tiny_checkpoint(family), quantized, fmt, reference)
    adapter = load_adapter(get_family(family))
    plans = []
    for directory in (quantized, reference):
        model = adapter.empty_model(directory, torch.float32)
        plans.append((build_without_weights(directory, model, torch.float32), model))
    return plans


def _expressible(form: QuantizedWeight) -> None:
    """``form`` is a valid DequantizeLinear-21 input (per tensor, per channel, or blocked on one axis)."""
    data, scale = form.data, form.scale
    assert form.bits in (4, 8) and data.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)
    if form.zero_point is not None:
        assert form.zero_point.shape == scale.shape and form.zero_point.dtype == data.dtype
    if scale.dim() == 0:
        return
    axis = form.axis % data.dim()
    if not form.block_size:
        assert scale.shape == (data.shape[axis],)
        return
    expected = list(data.shape)
    expected[axis] = -(-data.shape[axis] // form.block_size)
    assert list(scale.shape) == expected


@pytest.mark.parametrize(("family", "fmt"), MATRIX, ids=[f"{f}-{m}" for f, m in MATRIX])
def test_stored_form_dequantizes_to_what_read_returns(family, fmt, tiny_checkpoint, tmp_path):
    """Each parameter: read() equals the format's reference exactly; stored().dequantize() equals read()."""
    (plan, model), (reference, ref_model) = _plans(tiny_checkpoint, tmp_path, family, fmt)
    ref_params = dict(ref_model.named_parameters())
    stored = 0
    quantized_keys = set(plan.checkpoint.quantized)
    for name, param in model.named_parameters():
        values = plan.read(param)
        assert torch.equal(values, reference.read(ref_params[name])), name
        form = plan.stored(param)
        source = plan.sources[id(param)]
        keys = getattr(source, "keys", None) or [
            k for part in getattr(source, "parts", [[source.key]]) for k in part
        ]
        if not quantized_keys & set(keys):
            assert form is None, name
            continue
        if fmt == "gptq-act-order":
            assert form is None, name  # groups by a permuted index: no one-axis block form
            continue
        if form is not None:
            _expressible(form)
            assert torch.equal(form.dequantize(), values), name
            assert form.data.shape == param.shape
            stored += 1
    if fmt != "gptq-act-order":
        assert stored >= 4


def test_stacked_experts_keep_their_per_expert_blocks(tiny_checkpoint, tmp_path):
    """Qwen3-VL-MoE's stacked FP8 experts: the stored form is the swapped stack, blocks along one axis."""
    (plan, model), _ = _plans(tiny_checkpoint, tmp_path, "qwen3_vl_moe", "fp8-block")
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    form = plan.stored(experts[0])
    assert form.data.dtype == torch.float8_e4m3fn and form.data.dim() == 3
    assert form.block_size in (16, 32) and form.scale.dim() == 3


def _form(rows: int, cols: int, block: int, seed: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(-8, 8, (rows, cols), generator=generator).to(torch.int8)
    scale = torch.rand(rows, -(-cols // block), generator=generator)
    return QuantizedWeight(data, 4, scale, None, 1, block, "test")


def test_conversions_that_cut_a_block_have_no_stored_form():
    """A slice or concatenation through a block of the blocked axis: None; along block edges: exact."""
    forms = {"a": _form(8, 64, 32, 0), "b": _form(8, 64, 32, 1), "c": _form(8, 48, 32, 2)}

    def stored_of(key):
        return forms[key], True

    def dense(key):
        return forms[key].dequantize()

    aligned = SlicedSource("a", 1, 32, 32)
    assert torch.equal(stored_form(aligned, stored_of, None).dequantize(), aligned.values(dense, None))
    assert stored_form(SlicedSource("a", 1, 16, 32), stored_of, None) is None
    stacked = MergedSource((("a", "b"),), 0, None)
    assert torch.equal(stored_form(stacked, stored_of, None).dequantize(), stacked.values(dense, None))
    joined = MergedSource((("a",), ("c",)), 0, 2)
    assert torch.equal(stored_form(joined, stored_of, None).dequantize(), joined.values(dense, None))
    ragged = MergedSource((("c",), ("a",)), 0, 2)  # c's 48 columns end inside a block
    assert stored_form(ragged, stored_of, None) is None
    swapped = Source("a", (0, 1), always=True)
    form = stored_form(swapped, stored_of, None)
    assert form.axis == 0 and torch.equal(form.dequantize(), swapped.values(dense, None))


def test_module_rules_follow_transformers_and_compressed_tensors():
    """modules_to_not_convert matches at module boundaries, as a regex, or as a suffix; ``re:`` targets."""
    assert not_converted("model.visual.blocks.0.attn.qkv", ["model.visual"])
    assert not_converted("model.layers.3.mlp.gate", ["mlp.gate"])
    assert not not_converted("model.layers.3.mlp.gate_proj", ["mlp.gate"])
    assert not_converted("model.layers.11.self_attn", [r"model.layers.\d+.self_attn"])
    assert not not_converted("model.layers.1.mlp", None)
    assert targeted("model.layers.0.mlp.experts.3.up_proj", [r"re:.*mlp\.experts\.\d+\..*"])
    assert not targeted("model.layers.0.mlp.shared_experts.up_proj", [r"re:.*mlp\.experts\.\d+\..*"])
    assert targeted("model.layers.0.self_attn.q_proj", ["Linear"])
    assert targeted("lm_head", ["lm_head"]) and not targeted("model.lm_head_x", ["lm_head"])


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    section = config["quantization_config"]
    for key, value in changes.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    path.write_text(json.dumps(config))


def _w8a8(section):
    group = section["config_groups"]["group_0"]
    group["weights"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True}
    return section["config_groups"]


def _groups_with(section, **weights):
    group = section["config_groups"]["group_0"]
    group["weights"] = {**group["weights"], **weights}
    return section["config_groups"]


REFUSALS = [
    # (format written, config edit, words the line must hold)
    (
        "ct-fp8-channel",
        lambda s: {"config_groups": _w8a8(s)},
        "W8A8 (int8 weights per channel, int8 activations",
    ),
    ("ct-int4", lambda s: {"config_groups": _groups_with(s, symmetric=False)}, "asymmetric"),
    ("ct-int4", lambda s: {"config_groups": _groups_with(s, num_bits=2)}, "W2A16"),
    (
        "ct-int4",
        lambda s: {"config_groups": _groups_with(s, type="float", num_bits=4)},
        "W4A16 (float4 weights",
    ),
    ("ct-int4", lambda s: {"format": "marlin-24"}, "marlin-24"),
    ("gptq", lambda s: {"bits": 2}, "gptq 2-bit"),
    ("gptq", lambda s: {"bits": 3}, "gptq 3-bit"),
    ("awq", lambda s: {"version": "gemv"}, "awq gemv"),
    ("fp8-block", lambda s: {"quant_method": "hqq"}, "quant_method 'hqq'"),
    ("fp8-block", lambda s: {"fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
]


@pytest.mark.parametrize(("fmt", "edit", "words"), REFUSALS, ids=[r[2] for r in REFUSALS])
def test_unsupported_scheme_is_one_line_exit_2_nothing_left(
    fmt, edit, words, tiny_checkpoint, tmp_path, capsys
):
    """``export`` via the CLI: one stderr line naming the scheme and the first tensor, exit 2, no output."""
    from qeff_vision.cli import main

    quantized = write_quantized(tiny_checkpoint("qwen2_5_vl"), tmp_path / "q", fmt)
    config = json.loads((quantized / "config.json").read_text())
    _edit_config(quantized, **edit(config["quantization_config"]))
    out = tmp_path / "out"
    code = main(["export", str(quantized), "-o", str(out)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[qeff-vision]")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "unsupported quantization scheme" in lines[0] and words in lines[0], lines[0]
    assert "model.layers.0." in lines[0] or "visual." in lines[0], lines[0]  # the first tensor
    assert not out.exists()


def test_quantized_tensors_without_a_config_are_refused(tiny_checkpoint, tmp_path, capsys):
    """FP8 tensors in a checkpoint whose config declares no quantization: one line, exit 2."""
    from qeff_vision.cli import main

    quantized = write_quantized(tiny_checkpoint("qwen2_5_vl"), tmp_path / "q", "fp8-block")
    _edit_config(quantized)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    code = main(["export", str(quantized), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[qeff-vision]")]
    assert code == 2 and len(lines) == 1 and "no quantization_config" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_a_quantized_module_the_config_leaves_dense_is_refused(tiny_checkpoint, tmp_path):
    """modules_to_not_convert naming a module stored in FP8 contradicts the checkpoint: refused."""
    from qeff_vision.export.weights import Checkpoint

    quantized = write_quantized(tiny_checkpoint("qwen2_5_vl"), tmp_path / "q", "fp8-block")
    _edit_config(quantized, modules_to_not_convert=["lm_head", "model.layers.0.mlp"])
    with pytest.raises(UserError, match="modules_to_not_convert"):
        Checkpoint(quantized)
    shutil.rmtree(quantized)


def test_real_width_stored_form_writes_the_published_quantized_layout(tiny_checkpoint, tmp_path):
    """real_width_stored.save_stored: Kimi-K2.5's published names, int4 experts, a dequantized copy beside."""
    from safetensors import safe_open

    from qeff_vision.export.weights import Checkpoint
    from qeff_vision.real_width_stored import copy_side_files, save_stored
    from tests import helpers
    from tests.quantized_fixtures import real_width_form

    tiny = tiny_checkpoint("kimi_k25")
    model, _ = helpers.load_hf(tiny)
    out, reference = tmp_path / "q", tmp_path / "r"
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    form = real_width_form("ct-int4", reference, r"\.experts\.\d+\.", group=8)
    save_stored(get_family("kimi_k25"), model, out, form)
    copy_side_files(out, reference)
    with safe_open(tiny / "model.safetensors", "pt") as handle:
        published = set(handle.keys())
    stored = Checkpoint(out)
    assert set(stored.location) == published  # the release's names, each expert under its dense name
    experts = [key for key in stored.quantized if ".experts." in key]
    assert len(experts) == len(stored.quantized) > 0
    dense = Checkpoint(reference)
    for key in published:
        assert torch.equal(stored.read(key), dense.read(key)), key
    assert "quantization_config" not in json.loads((reference / "config.json").read_text())


def test_stored_tensors_that_do_not_fit_their_format_are_one_line(tiny_checkpoint, tmp_path, capsys):
    """A scale grid of the wrong shape (found only once weight_shape is read): one line, exit 2."""
    from safetensors.torch import load_file, save_file

    from qeff_vision.cli import main

    quantized = write_quantized(tiny_checkpoint("qwen2_5_vl"), tmp_path / "q", "ct-int4")
    state = load_file(quantized / "model.safetensors")
    key = next(k for k in sorted(state) if k.endswith("mlp.down_proj.weight_scale"))
    state[key] = state[key][:, :-1].contiguous()  # one group short
    save_file(state, quantized / "model.safetensors", metadata={"format": "pt"})
    code = main(["export", str(quantized), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[qeff-vision]")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "do not fit their format" in lines[0] and key in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
