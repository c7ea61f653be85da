"""Compute-context lengths (CCL): spec validation, the lists QEfficient hands the compiler, one
specialization per (bucket, CCL), the onnxruntime backend over every one, and generation that switches
CCL as the sequence grows with tokens identical to the run without CCL (tiny Qwen2.5-VL and Gemma 3).

The spec's lists become QEfficient's (``QEfficient/utils/check_ccl_specializations.py``
``validate_ccl_lists``): values raised to 1024, ctx_len added, prefill values moved off decode ones
in steps of 32 (issue 36 item 5: prefill [256, 1024], decode [512, 2048, 4096] at ctx 4096 compile
as prefill [992, 4064], decode [1024, 2048, 4096]).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.contract.language_io import Role
from qeff_vision.contract.slot_names import is_slot_name
from qeff_vision.errors import UserError
from qeff_vision.spec import build_specializations, load_spec
from qeff_vision.spec.ccl_lists import compiler_ccl_lists
from qeff_vision.spec.compile_options import CompCtxLengths
from qeff_vision.spec.loader import spec_from_data
from tests import helpers
from tests.compile_fixtures import write_spec
from tests.test_spec_helpers import problems_of, spec_data
from tests.test_spec_helpers import write_spec as write_spec_data

CTX_LEN = 512
# The issue's example: what QEfficient's compile path hands the compiler for these lists.
ISSUE_CTX_LEN = 4096
ISSUE_CCL = {"prefill": [256, 1024], "decode": [512, 2048, 4096]}
QEFFICIENT_LISTS = ((992, 4064), (1024, 2048, 4096))
PREFILL_CCLS = (64, 224, 480)
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


@pytest.mark.parametrize(
    ("prefill", "decode", "ctx_len", "expected"),
    [
        ([256, 1024], [512, 2048, 4096], 4096, QEFFICIENT_LISTS),
        # Shared values move down to the next multiple of 32, again while taken.
        ([1024, 4096], [1024, 2048, 4096, 8192], 8192, ((992, 4064, 8160), (1024, 2048, 4096, 8192))),
        ([2048, 4096], [2048, 4096, 8192], 8192, ((2016, 4064, 8160), (2048, 4096, 8192))),
        # Below 1024 everything is ctx_len; prefill keeps apart from it.
        ([64, 256], [128, 256, 512], 512, ((480,), (512,))),
        # Not a fixed point: ctx_len joins QEfficient's own prefill list again and moves to 4064,
        # which pushes 4064 to 4032 (QEfficient's process_ccl_specializations gives the same).
        ([992, 4064], [1024, 2048, 4096], 4096, ((992, 4032, 4064), (1024, 2048, 4096))),
        ([1500, 3000], [1024, 3000, 6000], 6000, ((1500, 2976, 5984), (1024, 3000, 6000))),
    ],
)
def test_lists_are_what_qefficient_hands_the_compiler(prefill, decode, ctx_len, expected):
    assert compiler_ccl_lists(prefill, decode, ctx_len) == expected
    compiled = CompCtxLengths(tuple(prefill), tuple(decode)).compiled(ctx_len)
    assert (compiled.prefill, compiled.decode) == expected
    assert not set(compiled.prefill) & set(compiled.decode), "the compiler takes distinct lists"


def _issue_spec(tmp_path):
    data = spec_data(
        ctx_len=ISSUE_CTX_LEN, prefill={"seq_lens": [64, 128]}, compile={"comp_ctx_lengths": ISSUE_CCL}
    )
    return spec_from_data(data, tmp_path / "spec.yaml"), write_spec_data(tmp_path, data)


def test_one_specialization_per_bucket_and_qefficient_ccl(tmp_path):
    spec, _ = _issue_spec(tmp_path)
    language = build_specializations(spec).language.specializations
    assert [(s.name, s.symbols["seq_len"], s.symbols[symbols.COMP_CTX_LENGTHS]) for s in language] == [
        ("Prefill-64-ccl992", "64", "992"),
        ("Prefill-64-ccl4064", "64", "4064"),
        ("Prefill-128-ccl992", "128", "992"),
        ("Prefill-128-ccl4064", "128", "4064"),
        ("Decode-ccl1024", "1", "1024"),
        ("Decode-ccl2048", "1", "2048"),
        ("Decode-ccl4096", "1", "4096"),
    ]
    assert all(s.symbols[symbols.CTX_LEN] == str(ISSUE_CTX_LEN) for s in language)


def test_validate_notes_the_lists_it_changed(tmp_path, capsys):
    _, path = _issue_spec(tmp_path)
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert (
        "compile.comp_ctx_lengths compiled as QEfficient hands them to the compiler: "
        "prefill [256, 1024] -> [992, 4064]; decode [512, 2048, 4096] -> [1024, 2048, 4096]"
    ) in err
    assert "prefills up to 4064 tokens, and `run` feeds its later tokens one per decode-shaped" in err
    # The decode list alone already QEfficient's: only prefill is named.
    same_decode = {"prefill": [2048], "decode": [1024, 2048, 4096]}
    data = spec_data(ctx_len=ISSUE_CTX_LEN, compile={"comp_ctx_lengths": same_decode})
    assert main(["validate", str(write_spec_data(tmp_path, data, "decode.yaml"))]) == 0
    note = capsys.readouterr().err
    assert "prefill [2048] -> [2016, 4064] (raised" in note and "decode [" not in note


def test_runtime_picks_each_calls_ccl_from_the_compiled_lists_and_refuses_what_none_covers(tmp_path):
    """Smallest CCL above the call's furthest position; a prompt past the last prefill CCL is fed
    (its tail one token per decode-shaped call) by the runners that can, refused by the others."""
    from types import SimpleNamespace

    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape

    spec, _ = _issue_spec(tmp_path)
    specializations = [
        {k: int(v) for k, v in s.symbols.items()}
        for s in build_specializations(spec).language.specializations
    ]
    shape = LanguageShape.from_specializations(specializations)
    assert (shape.prefill_ccls, shape.decode_ccls) == QEFFICIENT_LISTS
    prefill = {position: shape.comp_ctx_length(False, position) for position in (0, 991, 992, 4063)}
    assert prefill == {0: 992, 991: 992, 992: 4064, 4063: 4064}
    decode = {position: shape.comp_ctx_length(True, position) for position in (0, 1023, 1024, 2048, 4095)}
    assert decode == {0: 1024, 1023: 1024, 1024: 2048, 2048: 4096, 4095: 4096}
    with pytest.raises(UserError, match="past every prefill comp_ctx_length"):
        shape.comp_ctx_length(False, 4064)
    # Positions past the last prefill CCL (4064..4095) have decode CCLs: the generator feeds them
    # one token per decode-shaped call; a runner without such calls (single program, cross-attention,
    # disaggregated) refuses the prompt before any call.
    feeds_tail = SimpleNamespace(shape=shape, feeds_decode_tail=True)
    Generator.check_fits(feeds_tail, 4064, 32)
    Generator.check_fits(feeds_tail, 4080, 16)
    no_tail = SimpleNamespace(shape=shape, feeds_decode_tail=False)
    Generator.check_fits(no_tail, 4064, 32)
    with pytest.raises(UserError, match="prompt of 4065 tokens reaches position 4064, past the last prefill"):
        Generator.check_fits(no_tail, 4065, 16)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "kimi_k25"])
def test_onnxruntime_backend_verifies_every_bucket_and_ccl(family, tiny_checkpoint, tmp_path, capsys):
    # QEfficient's lists for these at ctx 2048: prefill [992, 2016], decode [1024, 2048].
    ctx_len, prefill, decode = 2048, (992, 2016), (1024, 2048)
    path = write_spec(
        tmp_path / "tiny.yaml",
        model=str(tiny_checkpoint(family)),
        config=None,
        ctx_len=ctx_len,
        compile_section={"comp_ctx_lengths": {"prefill": [1024], "decode": [1024, 2048]}},
    )
    out = tmp_path / "out"
    code = main(["compile", str(path), "-o", str(out), "--backend", "onnxruntime"])
    assert code == 0, capsys.readouterr().err
    export = json.loads((out / "export" / "export.json").read_text())
    assert export["comp_ctx_lengths"] is True
    assert export["programs"]["lang"]["inputs"][symbols.COMP_CTX_LENGTHS]["axes"] == {"0": "comp_ctx_lengths"}
    lang = json.loads((out / "manifest.json").read_text())["programs"]["lang"]
    ran = [(s["name"], s["symbols"][symbols.COMP_CTX_LENGTHS]) for s in lang["specializations"]]
    assert len(ran) == len(lang["verification"]["runs"]) == 2 * 2 + 2
    assert {name for name, _ in ran} == {f"Prefill-{s}-ccl{c}" for s in (64, 128) for c in prefill} | {
        f"Decode-ccl{c}" for c in decode
    }
    # Every cache keeps its declared length whatever the CCL (a window layer its ring, others ctx_len).
    inputs = export["programs"]["lang"]["inputs"]
    caches = [name for name in inputs if is_slot_name(name)]  # per-slot rows of every state kind
    assert len(caches) == 2 * export["num_layers"]
    for run in lang["verification"]["runs"]:
        for name in caches:
            declared = inputs[name]["shape"][2]
            expected = int(run["symbols"][declared])  # ctx_len, or the window ring's bound length
            assert run["output_shapes"][symbols.retained(name)][2] == expected
    assert load_spec(path).compile.comp_ctx_lengths.prefill == (1024,)  # the spec as written


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
    # Shaped like QEfficient's lists (distinct values, prefill ending below ctx_len), scaled down.
    shape = LanguageShape((bucket,), 64, CTX_LEN, prefill_ccls=PREFILL_CCLS, decode_ccls=(128, 256, 512))
    return generator_for_export(export_dir, shape)


@pytest.fixture(scope="module")
def ccl_exported(tiny_checkpoint, tmp_path_factory):
    """``ccl_exported(family) -> Path``: the tiny checkpoint exported with ``comp_ctx_lengths``."""
    built = {}

    def build(family: str):
        if family not in built:
            from qeff_vision.exporter import export_model

            built[family] = tmp_path_factory.mktemp(f"ccl-{family}") / "export"
            export_model(tiny_checkpoint(family), built[family], comp_ctx_lengths=True, progress=None)
        return built[family]

    return build


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "kimi_k25"])
def test_ccl_generation_matches_the_run_without_ccl(family, ccl_exported, exported, hf_model):
    ccl_export = ccl_exported(family)
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
    # Prefill: the first chunk fits 64 slots, later ones need 224; decode switches 128 -> 256.
    prefill_calls = len(result.chunks)
    assert result.ccl_history[:prefill_calls] == [64] + [224] * (prefill_calls - 1)
    decode = result.ccl_history[prefill_calls:]
    assert decode[0] == 128 and decode[-1] == 256 and decode == sorted(decode)
    assert without.ccl_history == []


def test_ccl_history_is_each_request_own(ccl_exported, hf_model):
    """Issue 51: the CCL of each call is the request's, not the runner's (no per-call data on it).

    Two lone requests through one generator, then two requests sharing one engine run: each
    result lists exactly its own calls (prefill chunks, then one per decode step), an earlier
    result is not touched by a later request, and the generator keeps no history at all.
    """
    from qeff_vision.runtime.engine import BatchedEngine
    from qeff_vision.runtime.request_state import EngineRequest

    generator = _generator(ccl_exported("qwen2_5_vl"), ccl=True)
    _, processor = hf_model("qwen2_5_vl")
    processed = helpers.as_numpy(_prompt(processor, "qwen2_5_vl"))
    first = generator.generate(processed, max_new_tokens=NEW_TOKENS)
    kept = list(first.ccl_history)
    second = generator.generate(processed, max_new_tokens=3)
    assert first.ccl_history == kept and first.ccl_history is not second.ccl_history
    for result in (first, second):
        assert len(result.ccl_history) == len(result.chunks) + len(result.tokens) - 1
    assert second.ccl_history == kept[: len(second.ccl_history)]  # the same prompt, its own calls
    assert not hasattr(generator, "ccl_history")
    engine = BatchedEngine(generator, full_batch_size=2)
    report = engine.run([EngineRequest(processed, NEW_TOKENS, 0), EngineRequest(processed, 3, 1)])
    long, short = (request.result for request in report.requests)
    assert long.ccl_history == kept and short.ccl_history == second.ccl_history


TAIL_NEW_TOKENS = 8


def _tail_prompt(processor, family: str, generator):
    """An image prompt whose last text position lies past the last prefill CCL (480), with room to decode."""
    image = helpers.image(100, 150) if family == "qwen2_5_vl" else helpers.image(64, 64)

    def last_position(filler: int):
        inputs = helpers.process(processor, helpers.user_turn("<image>", "y" * filler), [image])
        positions = generator.host.prompt_positions(helpers.as_numpy(inputs))
        text = positions if generator.position_rows is None else positions[0]
        return inputs, int(np.asarray(text).max())

    filler = 0
    while last_position(filler + 64)[1] < PREFILL_CCLS[-1]:
        filler += 64
    while True:  # the first filler whose last position passes the CCL, plus a few tokens more
        inputs, last = last_position(filler)
        if last >= PREFILL_CCLS[-1] + 5:
            assert last + TAIL_NEW_TOKENS < CTX_LEN, last
            return inputs, last
        filler += 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_a_prompt_past_the_last_prefill_ccl_is_served_through_decode_shaped_calls(
    family, ccl_exported, hf_model
):
    """Issue 36 item 5: positions past the last prefill CCL (QEfficient keeps its lists below
    ctx_len) go one token per decode-shaped call at the decode CCL covering them; tokens identical
    to transformers (this prompt was refused before)."""
    generator = _generator(ccl_exported(family), ccl=True)
    model, processor = hf_model(family)
    inputs, last = _tail_prompt(processor, family, generator)
    hf_tokens, _ = helpers.hf_generate(model, inputs, TAIL_NEW_TOKENS)
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=TAIL_NEW_TOKENS)
    assert result.tokens == hf_tokens and len(hf_tokens) == TAIL_NEW_TOKENS
    tail = [record for record in result.chunks if record.seq_len == 1]
    assert len(tail) == last - PREFILL_CCLS[-1] + 1 and all(record.rows == 0 for record in tail)
    prefill_calls = len(result.chunks) - len(tail)
    history = result.ccl_history
    assert max(history[:prefill_calls]) == PREFILL_CCLS[-1]
    assert history[prefill_calls : len(result.chunks)] == [512] * len(tail)  # the decode CCL above 480


def test_the_plan_past_the_last_prefill_ccl_and_an_image_there_refused():
    """Prefill chunks end at the first token past the last prefill CCL; each later token is a
    decode-shaped chunk (seq_len 1, the decode vision_size, no rows); an image placeholder there
    has no call that merges it: refused in one line."""
    from qeff_vision.runtime.planner import ChunkEnd, PlanError, plan_chunks

    buckets = [(64, 64)]
    plan = plan_chunks(140, [(10, 20)], buckets, prefill_stop=130, decode_vision_size=64)
    assert [(c.start, c.stop, c.seq_len, c.end) for c in plan.chunks[:3]] == [
        (0, 64, 64, ChunkEnd.SEQ_LEN),
        (64, 128, 64, ChunkEnd.SEQ_LEN),
        (128, 130, 64, ChunkEnd.PREFILL_CCL),
    ]
    tail = plan.chunks[3:]
    assert [(c.start, c.seq_len, c.vision_size, c.rows, c.end) for c in tail] == [
        (start, 1, 64, 0, ChunkEnd.DECODE_SHAPED) for start in range(130, 140)
    ]
    assert plan.last_chunk_of_image == (0,) and all(c.image_idx_output == 0 for c in tail)
    full = plan_chunks(140, [(10, 20)], buckets, protocol="full", prefill_stop=130, decode_vision_size=64)
    assert all(c.image_idx == c.image_idx_output == 20 for c in full.chunks[3:])
    assert plan_chunks(140, [(10, 20)], buckets, prefill_stop=140).chunks[-1].end is ChunkEnd.PROMPT_END
    only_tail = plan_chunks(3, [], buckets, prefill_stop=0, decode_vision_size=64)
    assert [c.seq_len for c in only_tail.chunks] == [1, 1, 1]
    with pytest.raises(
        PlanError, match=r"image 0 has placeholders at tokens \[130, 140\), past the last prefill"
    ):
        plan_chunks(150, [(120, 20)], buckets, prefill_stop=130, decode_vision_size=64)


def test_on_a_continuous_batching_program_the_tail_rides_decode_calls_at_full_batch_size(
    cb_exported, hf_model
):
    """The batched engine feeds a tail token as its slot's row of a decode call (batch
    ``full_batch_size``, other rows idle or decoding): both requests token-identical to transformers."""
    from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket

    family, slots = "qwen2_5_vl", 2
    model, processor = hf_model(family)
    plain = _generator(cb_exported(family, ccl=True), ccl=True)
    shape = LanguageShape((PrefillBucket(64, 64),), 64, CTX_LEN, PREFILL_CCLS, (128, 256, 512))
    generator = Generator(plain.checkpoint, plain.vision, plain.language, shape)
    long, last = _tail_prompt(processor, family, generator)
    short = helpers.process(processor, helpers.user_turn("Write a poem."), None)
    batches = []
    run = generator.language.run_retained

    def recording(feeds, state, retained):
        batches.append(feeds[generator.io.name(Role.TOKEN_IDS)].shape)
        return run(feeds, state, retained)

    generator.language.run_retained = recording
    try:
        report = BatchedEngine(generator, full_batch_size=slots).run(
            [EngineRequest(helpers.as_numpy(p), TAIL_NEW_TOKENS, 0) for p in (long, short)]
        )
    finally:
        del generator.language.run_retained
    for processed, done in zip((long, short), report.requests, strict=True):
        assert done.result.tokens == helpers.hf_generate(model, processed, TAIL_NEW_TOKENS)[0]
    tail = [record for record in report.requests[0].result.chunks if record.seq_len == 1]
    assert len(tail) == last - PREFILL_CCLS[-1] + 1
    assert (1, 1) not in batches and batches.count((slots, 1)) >= len(tail)  # every one-token call at batch 2
