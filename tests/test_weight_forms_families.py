"""Every family's graphs give the same results whichever way their weights are stored.

Per family, the tiny checkpoint in bf16 (values below fp16's normal range set to zero, so fp16
holds every value exactly) is exported four times: float32 and float16 weights; and, as a quantized
release of itself (the weight_bytes benchmark's double: each linear or expert weight int4 group-32,
int4 with zero points, fp8 per channel or fp8 128x128 in turn), dequantized to float32 and kept
quantized (DequantizeLinear, opset 21; the other weights float16). Each pair must agree exactly:
the compile's check of the language program (fp32 run, device precision with the rotary plan,
and device precision with MXFP6 weights and an MXINT8 KV cache), and the bytes each specialization
reads (the stored bytes: half in float16, the same rows of each gathered stack). The calibration
behind the automatic plan (every recorded range) and greedy generation at device precision are
compared on the token-merge families that calibrate, MoE and recurrent ones included; mllama
(cross-attention, no calibration inputs) compares fp32 and device-precision generation.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from qeff_vision import symbols
from qeff_vision.compile.calibration import prompt_ranges
from qeff_vision.compile.graph_io import read_graph_io
from qeff_vision.compile.onnxruntime_backend import verify_program
from qeff_vision.compile.weight_reads import weight_reads
from qeff_vision.exporter import example_values, export_model
from qeff_vision.families import all_families, describe_checkpoint, get_family
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.graph_file import load_graph
from qeff_vision.numerics.device import MxEmulation
from qeff_vision.numerics.plan import angle_chains, auto_plan
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

bench = helpers.load_benchmark("weight_bytes")
FAMILIES = [family.name for family in all_families()]
PAIRS = [("float32", "float16"), ("dequantized", "quantized")]
FP16_SMALLEST_NORMAL = 2.0**-14


def _fp16_exact_bf16(source, target):
    """A copy of checkpoint ``source`` in bf16 whose values fp16 holds exactly."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        tensors = {}
        for key, value in load_file(path).items():
            if value.is_floating_point():
                value = value.to(torch.bfloat16)
                value = torch.where(value.abs() < FP16_SMALLEST_NORMAL, torch.zeros_like(value), value)
            tensors[key] = value
        save_file(tensors, path, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def forms(tiny_checkpoint, tmp_path_factory):
    """``forms(family) -> {form: export dir}`` for the four exports, built once per module."""
    built: dict[str, dict] = {}

    def build(family: str) -> dict:
        if family not in built:
            root = tmp_path_factory.mktemp(f"forms-{family}")
            checkpoint = _fp16_exact_bf16(tiny_checkpoint(family), root / "checkpoint")
            exports = {
                "float32": export_model(checkpoint, root / "float32", progress=None),
                "float16": export_model(checkpoint, root / "float16", progress=None, weight_dtype="float16"),
            }
            with bench.quantized_checkpoint("mixed"):
                exports["dequantized"] = export_model(checkpoint, root / "dequantized", progress=None)
                exports["quantized"] = export_model(
                    checkpoint, root / "quantized", progress=None, weight_dtype="float16", keep_quantized=True
                )
            built[family] = {name: result.out_dir for name, result in exports.items()}
            built[family]["checkpoint"] = checkpoint
            built[family]["manifests"] = {name: result.manifest for name, result in exports.items()}
        return built[family]

    return build


def _language_specializations(family: str, checkpoint, path) -> list[dict[str, int]]:
    """A prefill and a decode specialization at the export's trace sizes (every graph symbol bound)."""
    values = example_values(get_family(family), describe_checkpoint(checkpoint))
    wanted = read_graph_io(path).all_symbols()
    prefill = {name: int(value) for name, value in values.items() if name in wanted}
    return [prefill, {**prefill, symbols.SEQ_LEN: 1}]


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_stored_forms_record_what_they_wrote(family, forms):
    manifests = forms(family)["manifests"]
    for program in ("vision", "lang"):
        plain = manifests["float32"]["programs"][program]["weights"]
        half = manifests["float16"]["programs"][program]["weights"]
        kept = manifests["quantized"]["programs"][program]["weights"]
        assert half["kept_float32"] == [] and half["rounded_below_normal"] == []
        assert half["parameters"] == plain["parameters"] and half["bytes"] * 2 == plain["bytes"]
        assert kept["parameters"] == plain["parameters"]
    assert manifests["float16"]["weights"]["lang"] == {"dtype": "float16", "keep_quantized": False}
    assert manifests["quantized"]["opset"] == 21 and manifests["float32"]["opset"] == 17
    quantized = manifests["quantized"]["programs"]["lang"]["weights"]["quantized"]
    assert set(quantized) == set(bench.SCHEMES), quantized  # every scheme in every language program


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_compile_check_and_weight_reads_match_across_stored_forms(family, pair, forms):
    exports = forms(family)
    runs, reads = [], []
    for form in pair:
        path = exports[form] / "lang" / "model.onnx"
        specializations = _language_specializations(family, exports["checkpoint"], path)
        plan = sorted(angle_chains(load_graph(path)))
        mx = MxEmulation("fp6_e2m3", kv_mxint8=True)
        runs.append(verify_program("lang", path, specializations, device_values=plan, mx=mx))
        reads.append([weight_reads(path, values) for values in specializations])
    for one, other in zip(*runs):
        assert one.output_shapes == other.output_shapes
        assert one.device == other.device and one.device_mx == other.device_mx
        assert one.device.finite and one.device_mx.finite
    stored_reads_match(*reads, halved=pair[1] == "float16")


def stored_reads_match(plain, stored, halved: bool) -> None:
    """Per specialization: the stored form reads the same rows; float16 reads half the bytes."""
    for one, other in zip(plain, stored):
        total = sum(r.read_bytes for r in one)
        stored_total = sum(r.read_bytes for r in other)
        if halved:
            assert stored_total * 2 == total
            rows = {r.name: r.rows_read for r in one}
            assert {r.name.removesuffix("_fp16"): r.rows_read for r in other} == rows
        else:
            assert stored_total < total


CALIBRATED = [name for name in FAMILIES if get_family(name).decoder_kind == TOKEN_MERGE]


def _generation(export, length: int, plans=None):
    bucket = PrefillBucket(length + 3, length + 3)
    generator = generator_for_export(
        export, LanguageShape((bucket,), bucket.vision_size, length + 64), fp32_values=plans
    )
    return generator


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe", "qwen3_5", "kimi_k25", "mllama"])
def test_calibration_and_device_generation_match_across_stored_forms(family, pair, forms, hf_model):
    exports = forms(family)
    _, processor = hf_model(family)
    inputs = helpers.as_numpy(
        helpers.process(
            processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
        )
    )
    length = inputs["input_ids"].shape[1]
    results = []
    for form in pair:
        export = exports[form]
        plans = None
        if family in CALIBRATED:
            bucket = {symbols.BATCH_SIZE: 1, symbols.SEQ_LEN: length + 3, symbols.VISION_SIZE: length + 3}
            bucket[symbols.CTX_LEN] = 512
            ranges = prompt_ranges(export, None, [bucket, {**bucket, symbols.SEQ_LEN: 1}], [(100, 150)])
            plans = {
                program: auto_plan(load_graph(export / program / "model.onnx"), ranges[program])
                for program in ("vision", "lang")
            }
            results.append(("ranges", ranges))
        else:
            plans = {
                program: sorted(angle_chains(load_graph(export / program / "model.onnx")))
                for program in ("vision", "lang")
            }
        results.append(("plans", plans))
        for label, fp32_values in (("fp32", None), ("device", plans)):
            generated = _generation(export, length, fp32_values).generate(
                inputs, max_new_tokens=4, keep_logits=True
            )
            results.append((label, (generated.tokens, generated.logits)))
    half = len(results) // 2
    for (label, one), (_, other) in zip(results[:half], results[half:]):
        if label == "ranges":
            for program in one:
                common = set(one[program]) & set(other[program])
                assert len(common) >= 0.9 * len(one[program])
                assert {n: one[program][n] for n in common} == {n: other[program][n] for n in common}, program
        elif label == "plans":
            assert one == other
        else:
            assert one[0] == other[0], label
            assert all(np.array_equal(a, b) for a, b in zip(one[1], other[1])), label


@pytest.mark.parametrize("form", ["float16", "quantized"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe", "qwen3_5", "llava"])
def test_single_program_composes_stored_weights(family, form, forms):
    """``deployment: single`` composes an export whose weights are stored: checked, loaded, same bytes."""
    import onnx
    import onnxruntime as ort

    from qeff_vision.compile.single_program import write_single_program
    from qeff_vision.graph_file import weight_bytes

    export = forms(family)[form]
    vision, lang = export / "vision" / "model.onnx", export / "lang" / "model.onnx"
    composed = write_single_program(export, vision, lang)
    onnx.checker.check_model(str(composed))
    model = load_graph(composed)
    opset = {entry.domain: entry.version for entry in model.opset_import}[""]
    assert opset == (21 if form == "quantized" else 17)
    assert weight_bytes(model) == weight_bytes(load_graph(vision)) + weight_bytes(load_graph(lang))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    ort.InferenceSession(str(composed), options, providers=["CPUExecutionProvider"])
