"""Compute-context lengths (CCL): spec validation, one specialization per (bucket, CCL), the onnxruntime
backend over every one, and generation that switches CCL as the sequence grows with tokens identical
to the run without CCL (tiny Qwen2.5-VL and Gemma 3, CCL {prefill: [64, 256], decode: [128, 256, 512]}
at ctx 512)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.spec import build_specializations, load_spec
from qeff_vision.spec.loader import spec_from_data
from tests import helpers
from tests.compile_fixtures import write_spec
from tests.test_spec_helpers import problems_of, spec_data
from tests.test_spec_helpers import write_spec as write_spec_data

CTX_LEN = 512
CCL = {"prefill": [64, 256], "decode": [128, 256, 512]}
NEW_TOKENS = 40
PROMPT_TOKENS = 100  # decode starts below 128 and crosses it: the decode CCL switches 128 -> 256


@pytest.mark.parametrize(
    ("ccl", "expected"),
    [
        (
            {"prefill": [256, 64], "decode": [512]},
            "compile.comp_ctx_lengths.prefill: must be strictly increasing",
        ),
        (
            {"prefill": [64, 64], "decode": [512]},
            "compile.comp_ctx_lengths.prefill: must be strictly increasing",
        ),
        (
            {"prefill": [64], "decode": [128, 1024]},
            "compile.comp_ctx_lengths.decode: 1024 exceeds ctx_len 512",
        ),
        (
            {"prefill": [0, 64], "decode": [512]},
            "compile.comp_ctx_lengths.prefill: must be positive integers",
        ),
        ({"prefill": [64]}, "compile.comp_ctx_lengths.decode: missing"),
        ({"prefill": [64], "decode": []}, "compile.comp_ctx_lengths.decode: must be a non-empty list"),
        ({"prefill": [64], "decode": [512], "other": [1]}, "compile.comp_ctx_lengths.other: unknown key"),
        ([64, 128], "compile.comp_ctx_lengths: must be a mapping"),
    ],
)
def test_invalid_lists_are_rejected(tmp_path, ccl, expected):
    path = write_spec_data(tmp_path, spec_data(ctx_len=CTX_LEN, compile={"comp_ctx_lengths": ccl}))
    assert any(problem.startswith(expected) for problem in problems_of(path)), problems_of(path)


def test_one_specialization_per_bucket_and_ccl_lists_completed_to_ctx_len(tmp_path):
    spec = spec_from_data(
        spec_data(ctx_len=CTX_LEN, prefill={"seq_lens": [64, 128]}, compile={"comp_ctx_lengths": CCL}),
        tmp_path / "spec.yaml",
    )
    language = build_specializations(spec).language.specializations
    assert [(s.name, s.symbols["seq_len"], s.symbols[symbols.COMP_CTX_LENGTHS]) for s in language] == [
        ("Prefill-64-ccl64", "64", "64"),
        ("Prefill-64-ccl256", "64", "256"),
        ("Prefill-64-ccl512", "64", "512"),  # the prefill list ends below ctx_len: ctx_len is added
        ("Prefill-128-ccl64", "128", "64"),
        ("Prefill-128-ccl256", "128", "256"),
        ("Prefill-128-ccl512", "128", "512"),
        ("Decode-ccl128", "1", "128"),
        ("Decode-ccl256", "1", "256"),
        ("Decode-ccl512", "1", "512"),
    ]
    assert all(s.symbols[symbols.CTX_LEN] == str(CTX_LEN) for s in language)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_onnxruntime_backend_verifies_every_bucket_and_ccl(family, tiny_checkpoint, tmp_path, capsys):
    path = write_spec(
        tmp_path / "tiny.yaml",
        model=str(tiny_checkpoint(family)),
        config=None,
        ctx_len=CTX_LEN,
        compile_section={"comp_ctx_lengths": CCL},
    )
    out = tmp_path / "out"
    code = main(["compile", str(path), "-o", str(out), "--backend", "onnxruntime"])
    assert code == 0, capsys.readouterr().err
    export = json.loads((out / "export" / "export.json").read_text())
    assert export["comp_ctx_lengths"] is True
    assert export["programs"]["lang"]["inputs"][symbols.COMP_CTX_LENGTHS]["axes"] == {"0": "comp_ctx_lengths"}
    lang = json.loads((out / "manifest.json").read_text())["programs"]["lang"]
    ran = [(s["name"], s["symbols"][symbols.COMP_CTX_LENGTHS]) for s in lang["specializations"]]
    assert len(ran) == len(lang["verification"]["runs"]) == 2 * 3 + 3
    assert {name for name, _ in ran} == {f"Prefill-{s}-ccl{c}" for s in (64, 128) for c in (64, 256, 512)} | {
        f"Decode-ccl{c}" for c in (128, 256, 512)
    }
    # Every cache keeps its declared length whatever the CCL (a window layer its ring, others ctx_len).
    inputs = export["programs"]["lang"]["inputs"]
    for run in lang["verification"]["runs"]:
        for index in range(export["num_layers"]):
            declared = inputs[symbols.past_key(index)]["shape"][2]
            expected = int(run["symbols"][declared])  # ctx_len, or the window ring's bound length
            assert run["output_shapes"][f"{symbols.past_key(index)}_RetainedState"][2] == expected
    assert load_spec(path).compile.comp_ctx_lengths.prefill == (64, 256)


def _prompt(processor, family: str):
    image = helpers.image(100, 150) if family == "qwen2_5_vl" else helpers.image(64, 64)
    for filler in range(400):
        turn = helpers.user_turn("<image>", "y" * filler)
        inputs = helpers.process(processor, turn, [image])
        if inputs["input_ids"].shape[1] >= PROMPT_TOKENS:
            return inputs
    raise AssertionError(family)


def _generator(export_dir, ccl: bool):
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    bucket = PrefillBucket(64, 64)
    if not ccl:
        return generator_for_export(export_dir, LanguageShape((bucket,), 64, CTX_LEN))
    shape = LanguageShape((bucket,), 64, CTX_LEN, prefill_ccls=(64, 256, 512), decode_ccls=(128, 256, 512))
    return generator_for_export(export_dir, shape)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_ccl_generation_matches_the_run_without_ccl(family, tiny_checkpoint, exported, hf_model, tmp_path):
    from qeff_vision.exporter import export_model

    ccl_export = tmp_path / "ccl"
    export_model(tiny_checkpoint(family), ccl_export, comp_ctx_lengths=True, progress=None)
    model, processor = hf_model(family)
    inputs = _prompt(processor, family)
    hf_tokens, _ = helpers.hf_generate(model, inputs, NEW_TOKENS)
    processed = helpers.as_numpy(inputs)
    plain = _generator(exported(family), ccl=False)
    without = plain.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    with_ccl = _generator(ccl_export, ccl=True)
    result = with_ccl.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    assert result.tokens == without.tokens == hf_tokens and len(hf_tokens) == NEW_TOKENS
    assert max(np.abs(a - b).max() for a, b in zip(result.logits, without.logits)) <= 1e-4
    # Prefill: the first chunk fits 64 slots, later ones need 256; decode switches 128 -> 256.
    prefill_calls = len(result.chunks)
    assert with_ccl.ccl_history[:prefill_calls] == [64] + [256] * (prefill_calls - 1)
    decode = with_ccl.ccl_history[prefill_calls:]
    assert decode[0] == 128 and decode[-1] == 256 and decode == sorted(decode)
    assert plain.ccl_history == []
