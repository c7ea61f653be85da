"""Disaggregated serving, every family: prefill on one program, decode on the other, KV handed over.

The two programs are each family's continuous-batching language graph viewed with disjoint
specializations, as ``deployment: disaggregated`` compiles them: ``lang_prefill`` prefill buckets
at batch 1 with ``full_batch_size`` 1 (one request's cache), ``lang_decode`` the decode step at
``full_batch_size`` 4. Five staggered requests (the fifth reuses a freed slot) go through the
batched engine; each finished prefill's KV is copied into its decode slot. Tokens must equal
transformers generate alone per request, logits within fp32 tolerance; a decode-shaped call on
the prefill program (or the reverse) would be refused by the views. The CLI path (compile with
``kv_cache_prefix``, ``run --requests --compare-hf`` and ``run`` over three turns) runs on tiny
LLaVA (continuous batching, vLLM's KV names) and Gemma 3 (batch-1 decode, window rings). Cost:
the session's CB exports (shared with test_batched_engine); LLaVA-NeXT is ``slow``.
"""

from __future__ import annotations

import json
import re

import onnx
import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.contract.slot_names import is_kv_name, is_state_name
from qeff_vision.families import all_families
from qeff_vision.families.base import CROSS_ATTENTION
from qeff_vision.runtime.disaggregated import DisaggregatedSlots, PhaseRouter, phase_programs
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.generate import make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import ShapeMismatch
from tests import helpers
from tests.family_runtime import CTX_LEN, FamilyRuntime
from tests.test_batched_engine import SLOTS, check_against_transformers, five_requests

FAMILIES = [
    pytest.param(f.name, marks=pytest.mark.slow) if f.name == "llava_next" else f.name
    for f in all_families()
    if f.features.disaggregated.supported
]
SEQ_LENS = (32, 128)
PREFIX = "vllmKvCache"


def _phases(seq_lens, buckets_vision) -> tuple[list[dict], list[dict]]:
    """QEfficient-shaped prefill (batch 1, one slot) and decode (batch = slots = F) symbol values."""
    prefill = [
        {symbols.BATCH_SIZE: 1, symbols.FULL_BATCH_SIZE: 1, symbols.SEQ_LEN: s, symbols.VISION_SIZE: v}
        for s, v in zip(seq_lens, buckets_vision)
    ]
    decode = [{symbols.BATCH_SIZE: SLOTS, symbols.FULL_BATCH_SIZE: SLOTS, symbols.SEQ_LEN: 1}]
    return prefill, decode


def _mllama_requests(processor):
    """test_mllama_cb's five requests: (numpy inputs, budget, arrival) and the processor outputs."""
    from tests.test_mllama_cb import _requests

    found = _requests(processor)
    return [(helpers.as_numpy(p), budget, arrival) for _, p, arrival, budget in found], [
        p for _, p, _, _ in found
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_five_staggered_requests_prefill_on_one_program_decode_on_the_other(family, hf_model, cb_exported):
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, cb_exported(family), model, processor)
    cross = runtime.family.decoder_kind == CROSS_ATTENTION
    seq_lens = (16,) if cross else SEQ_LENS
    visions = (1,) * len(seq_lens) if cross else seq_lens
    prefill, decode = _phases(seq_lens, visions)
    if cross:  # mllama: no vision_size; two image slots of cross states (as tests/test_mllama_cb.py)
        rows = runtime.family.states_per_image(runtime.checkpoint.description)
        slots = {symbols.MAX_NUM_IMAGES: 2, "cross_states": 2 * rows}
        for entry in (*prefill, *decode):
            entry.pop(symbols.VISION_SIZE, None)
            entry.update(slots)
    router = phase_programs(runtime.language, prefill, decode)
    buckets = tuple(PrefillBucket(s, v) for s, v in zip(seq_lens, visions))
    shape = LanguageShape(buckets, max(visions), 256 if cross else CTX_LEN)
    generator = make_generator(runtime.checkpoint, runtime.vision, router, shape, EmbeddingCache(64 * 2**20))
    requests, originals = _mllama_requests(processor) if cross else (five_requests(runtime), None)
    engine = BatchedEngine(generator)
    assert isinstance(engine.slots, DisaggregatedSlots) and engine.full_batch_size == SLOTS
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    if cross:
        for (_, new, _), processed, done in zip(requests, originals, report.requests):
            tokens, _ = helpers.hf_generate(model, processed, new)
            assert done.result.tokens == tokens, f"mllama request {done.number}: tokens differ"
    else:
        check_against_transformers(runtime, requests, report)
    # Each program ran only its own phase; every request's prefill KV was handed over once.
    assert router.prefill.calls == report.prefill_calls and router.decode.calls == len(report.decode_batches)
    assert router.handoffs == len(requests)
    one_cache = sum(array.nbytes for array in generator.empty_cache(1).values())
    assert router.handoff_bytes == len(requests) * one_cache
    fifth = report.requests[4]
    assert any(r.slot == fifth.slot and r.finished_step < fifth.admitted_step for r in report.requests[:4])
    assert max(report.decode_batches) >= 2


def test_each_program_refuses_the_other_phase(hf_model, cb_exported):
    model, processor = hf_model("qwen2_5_vl")
    runtime = FamilyRuntime("qwen2_5_vl", cb_exported("qwen2_5_vl"), model, processor)
    router = phase_programs(runtime.language, *_phases(SEQ_LENS, SEQ_LENS))
    assert isinstance(router, PhaseRouter)
    decode_shaped = {symbols.BATCH_SIZE: SLOTS, symbols.FULL_BATCH_SIZE: SLOTS, symbols.SEQ_LEN: 1}
    with pytest.raises(ShapeMismatch):
        router.prefill.check_specialization(decode_shaped)
    prefill_shaped = {symbols.BATCH_SIZE: 1, symbols.FULL_BATCH_SIZE: 1, symbols.SEQ_LEN: 32}
    with pytest.raises(ShapeMismatch):
        router.decode.check_specialization(prefill_shaped)


# (family, spec keys): LLaVA with continuous batching and vLLM's KV names; Gemma 3 with a batch-1
# decode program and an 8-slot window ring (the tiny config) that a three-turn chat overruns: the
# ring handed over serves later turns exactly, without a full-length cache on the window layers.
COMPILED = {
    "llava": {"full_batch_size": SLOTS, "kv_cache_prefix": PREFIX},
    "gemma3": {},
    # Recurrent (Gated DeltaNet) layers: their conv and recurrent states carry the prefix too, as
    # QEfficient names them (they are per-sequence state the decode program needs).
    "qwen3_5": {"full_batch_size": SLOTS, "kv_cache_prefix": PREFIX},
}


@pytest.fixture(scope="module", params=list(COMPILED))
def compiled(request, tiny_checkpoint, tmp_path_factory):
    """A tiny checkpoint compiled disaggregated on the onnxruntime backend, with two images beside it."""
    family = request.param
    root = tmp_path_factory.mktemp(f"disaggregated-{family}")
    spec = {
        "name": f"{family}-dis",
        "model": str(tiny_checkpoint(family)),
        "ctx_len": 256,
        "deployment": "disaggregated",
        **COMPILED[family],
        "prefill": {"seq_lens": [32, 128]},
        "vision": {"images": [{"height": 336, "width": 336}], "max_images": 2},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert (
        main(["compile", str(root / "spec.yaml"), "-o", str(root / "out"), "--backend", "onnxruntime"]) == 0
    )
    for name, (height, width) in {"a": (112, 112), "b": (140, 196)}.items():
        helpers.image(height, width, len(name)).save(root / f"{name}.png")
    return family, root


def test_compiled_artifact_names_every_kv_with_the_prefix(compiled):
    family, root = compiled
    manifest = json.loads((root / "out" / "manifest.json").read_text())
    assert manifest["deployment"] == "disaggregated"
    assert manifest["kv_cache_prefix"] == COMPILED[family].get("kv_cache_prefix")
    (path,) = {manifest["programs"][p]["path"] for p in ("lang_prefill", "lang_decode")}
    graph = onnx.load(str(root / "out" / path), load_external_data=False).graph
    names = [value.name for value in (*graph.input, *graph.output)]
    kv = [name for name in names if is_kv_name(name)]
    assert kv and len(kv) % 4 == 0  # per layer: key and value, input and retained output
    suffix = f"_{PREFIX}" if "kv_cache_prefix" in COMPILED[family] else ""
    assert all(re.fullmatch(rf"past_(key|value)\.\d+{suffix}(_RetainedState)?", name) for name in kv)
    states = [name for name in names if is_state_name(name)]
    assert bool(states) == (family == "qwen3_5")
    assert all(re.fullmatch(rf"(conv|recurrent)_state\.\d+{suffix}(_RetainedState)?", n) for n in states)


def test_run_requests_and_a_three_turn_run_match_transformers(compiled, capsys):
    family, root = compiled
    lines = [
        {"prompt": "Describe it.", "images": ["a.png"], "max_new_tokens": 5},
        {"prompt": "Tell me a story about a cat.", "max_new_tokens": 4},
        {"prompt": "Compare.", "images": ["b.png", "a.png"], "arrival_step": 1},
        {"prompt": "What now?", "images": ["b.png"], "arrival_step": 2, "max_new_tokens": 3},
        {"prompt": "Write a poem.", "arrival_step": 3, "max_new_tokens": 5},
    ]
    (root / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = str(root / "out")
    args = ["run", out, "--requests", str(root / "requests.jsonl"), "--max-new-tokens", "5", "--compare-hf"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 5
    assert "5 KV hand-off(s) into decode slots" in err
    # One sequence, three turns: prefill on lang_prefill, decode on lang_decode (at full_batch_size
    # 4 a batch of one of the engine in slot 0, each turn prefilled whole).
    turns = ["--prompt", "Describe it.", "--prompt", "And the colours?", "--prompt", "Thanks. Summarise."]
    assert (
        main(["run", out, "--image", str(root / "a.png"), *turns, "--max-new-tokens", "4", "--compare-hf"])
        == 0
    )
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 3
    assert err.count("prefilled again in slot 0") == (2 if "full_batch_size" in COMPILED[family] else 0)


def test_handoffs_are_reported_for_a_disaggregated_pair_only():
    from types import SimpleNamespace

    from qeff_vision.runtime.deployment import deployment_of

    def handoff_counts(language):  # what ``run --requests`` reports (BatchRun.handoffs)
        return deployment_of(language).handoffs(language)

    def program(seq_len: int) -> SimpleNamespace:
        entry = {symbols.SEQ_LEN: seq_len, symbols.FULL_BATCH_SIZE: SLOTS}
        return SimpleNamespace(
            path="lang", input_dims={}, output_names=[], retains_state=False, specializations=[entry]
        )

    router = PhaseRouter(program(32), program(1))
    router.handoffs, router.handoff_bytes = 2, 4096
    assert handoff_counts(router) == (2, 4096)
    # A program that merely has such attributes is not a disaggregated pair.
    assert handoff_counts(SimpleNamespace(handoffs=3, handoff_bytes=1)) is None


def test_engine_takes_its_slots_from_a_declared_slot_provider_only():
    from types import SimpleNamespace

    from qeff_vision.runtime.deployment import deployment_of
    from qeff_vision.runtime.slots import BatchedSlots, SlotProvider

    def program(full_batch_size: int, seq_len: int) -> SimpleNamespace:
        entry = {symbols.SEQ_LEN: seq_len, symbols.FULL_BATCH_SIZE: full_batch_size}
        return SimpleNamespace(
            path="lang", input_dims={}, output_names=[], retains_state=False, specializations=[entry]
        )

    def engine_over(language) -> BatchedEngine:
        # A continuous-batching host whose language program is ``language`` (no call is made).
        generator = SimpleNamespace(
            io=SimpleNamespace(has=lambda role: True),
            language=language,
            deployment=deployment_of(language),  # what make_generator gives a runner
            empty_cache=lambda slots=1: {},
            decode_vision_feeds=lambda: {},
        )
        return BatchedEngine(generator)

    # The pair: its slots, counted on the decode program (the prefill program binds 1).
    router = PhaseRouter(program(1, 32), program(SLOTS, 1))
    assert isinstance(router, SlotProvider)
    engine = engine_over(router)
    assert isinstance(engine.slots, DisaggregatedSlots) and engine.full_batch_size == SLOTS

    # A program that merely has members of those names is an ordinary continuous-batching one.
    def engine_slots(generator, full_batch_size):
        raise AssertionError("a look-alike's engine_slots was called")

    look_alike = program(2, 1)
    look_alike.engine_slots, look_alike.decode_specializations = engine_slots, router.decode_specializations
    assert not isinstance(look_alike, SlotProvider)
    engine = engine_over(look_alike)
    assert type(engine.slots) is BatchedSlots and engine.full_batch_size == 2
