"""Continuous batching for Llama 3.2 Vision (mllama, the cross-attention kind) on the tiny checkpoint.

The continuous-batching language program holds every cache on ``full_batch_size`` slots, the
cross-attention K/V included: the host writes a request's image states into the slot it takes
(:class:`CrossSlotProgram`, as a device's retained buffer is written), each row of a call reads its
own slot (``batch_index``), and a request without images writes nothing and reads no cross values
whatever its slot still holds. Five requests (different images and sizes, one with two images, one
text-only) arrive at staggered steps on 4 slots under the engine's scheduler (one request's prefill
per step, one batched decode call for the running ones); the text-only one takes the slot an image
request freed, which still holds that request's states. Each request's tokens equal transformers'
``generate`` run alone on it, logits within fp32 tolerance. The language program runs with
QEfficient-shaped continuous-batching specializations (prefill batch 1, decode batch 4), so every
call has a compiled shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.cli import main
from qeff_vision.export_record import read_export
from qeff_vision.families import get_family
from qeff_vision.families.base import describe_checkpoint
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.test_spec_helpers import write_spec as write_spec_data

FAMILY = "mllama"
SPECS = Path(__file__).resolve().parent.parent / "specs"
FULL_BATCH_SIZE = 4
IMAGE_SLOTS = 2  # images per request the language program is specialized for
CTX_LEN = 256
SEQ_LEN = 16
NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def cb_export(cb_exported) -> Path:
    return cb_exported(FAMILY)


def _language(export_dir: Path, rows_per_image: int) -> OnnxProgram:
    """The CB language program with QEfficient's CB specializations (prefill batch 1, decode batch F)."""
    common = {
        symbols.FULL_BATCH_SIZE: FULL_BATCH_SIZE,
        symbols.CTX_LEN: CTX_LEN,
        symbols.MAX_NUM_IMAGES: IMAGE_SLOTS,
        "cross_states": IMAGE_SLOTS * rows_per_image,
    }
    prefill = {**common, symbols.BATCH_SIZE: 1, symbols.SEQ_LEN: SEQ_LEN}
    decode = {**common, symbols.BATCH_SIZE: FULL_BATCH_SIZE, symbols.SEQ_LEN: 1}
    return OnnxProgram(export_dir / "lang" / "model.onnx", [prefill, decode])


def _generator(export_dir: Path) -> CrossAttentionGenerator:
    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    rows = checkpoint.family.states_per_image(checkpoint.description)
    return CrossAttentionGenerator(
        checkpoint,
        OnnxProgram(export_dir / manifest["programs"]["vision"]["path"]),
        _language(export_dir, rows),
        LanguageShape((PrefillBucket(SEQ_LEN, 1),), 1, CTX_LEN),
    )


def _requests(processor) -> list[tuple[str, dict, int, int]]:
    """(label, processed, arrival step, max new tokens) of the five staggered requests."""
    turn = helpers.user_turn
    specs = [
        ("one image", turn("<image>", "Describe this picture."), [helpers.image(100, 150, 1)], 0, NEW_TOKENS),
        ("two images", turn("<image>", "and", "<image>", "Which is wider?"), [helpers.image(300, 120, 2),
         helpers.image(50, 50, 3)], 0, NEW_TOKENS),
        ("short", turn("<image>", "Colour?"), [helpers.image(60, 250, 4)], 1, 2),
        ("long prompt", turn("<image>", "The light is soft in the morning, " * 4 + "what time is it?"),
         [helpers.image(120, 90, 5)], 2, NEW_TOKENS),
        ("text only", turn("Tell me a story about a lighthouse."), [], 3, NEW_TOKENS),
    ]  # fmt: skip
    return [
        (label, helpers.process(processor, messages, images), arrival, budget)
        for label, messages, images, arrival, budget in specs
    ]


def test_staggered_requests_through_the_engine_match_generate_alone(cb_export, hf_model):
    model, processor = hf_model(FAMILY)
    generator = _generator(cb_export)
    requests = _requests(processor)
    engine = BatchedEngine(generator)  # full_batch_size from the compiled specializations
    assert engine.slots.batched and engine.full_batch_size == FULL_BATCH_SIZE
    # What each prefill call finds in its slot and brings: (slot, cross states supplied, slot held states).
    seen, prefill = [], engine.slots.prefill
    cross = generator.cross_names

    def recording(slot, feeds):
        held = any(np.any(engine.slots.past[name][slot]) for name in cross)
        seen.append((slot, any(name in feeds for name in cross), held))
        return prefill(slot, feeds)

    engine.slots.prefill = recording
    report = engine.run(
        [EngineRequest(helpers.as_numpy(p), budget, arrival) for _, p, arrival, budget in requests],
        keep_logits=True,
    )
    for (label, processed, _, budget), done in zip(requests, report.requests):
        tokens, logits = helpers.hf_generate(model, processed, budget)
        assert done.result.tokens == tokens, f"{label}: tokens differ from transformers generate alone"
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(done.result.logits, logits))
        assert worst <= LOGIT_TOLERANCE, f"{label}: logits differ by {worst}"
    # The text-only request took a slot an image request had freed; its first chunk brought no
    # states and found the previous occupant's still there (which the program must not read).
    text_only = report.requests[-1]
    before = [r for r in report.requests[:-1] if r.slot == text_only.slot]
    assert before and all(r.finished_step < text_only.admitted_step for r in before)
    assert (text_only.slot, False, True) in seen
    assert max(report.decode_batches) >= 2, "several requests decode in one call"
    assert len(report.decode_batches) < sum(len(r.result.tokens) - 1 for r in report.requests)
    assert report.encoder_calls == 5  # five different images, each encoded once
    assert [r.result.images for r in report.requests] == [1, 2, 1, 1, 0]


def test_language_io_holds_the_cross_states_per_slot(cb_export):
    """Every cache, cross K/V included, on full_batch_size; batch_index after the caches."""
    manifest = read_export(cb_export)
    inputs = manifest["programs"]["lang"]["inputs"]
    graph = onnx.load(str(cb_export / "lang" / "model.onnx"), load_external_data=False).graph
    names = [value.name for value in graph.input if value.name in inputs]  # graph order, no weights
    cross = get_family(FAMILY).vision_outputs(describe_checkpoint(manifest["model"]))
    assert cross and all(inputs[name]["axes"]["0"] == symbols.FULL_BATCH_SIZE for name in cross)
    assert inputs[symbols.CROSS_ATTENTION_MASK]["axes"]["0"] == symbols.BATCH_SIZE
    assert names.index(symbols.BATCH_INDEX) == max(names.index(n) for n in names if n.startswith("past_")) + 1


def test_cb_spec_onnxruntime_backend_and_run_requests(cb_export, tiny_checkpoint, tmp_path, capsys):
    """The 11B CB spec: prefill batch 1 with full_batch_size, decode batch 4; the tiny export verifies
    every specialization on onnxruntime, then serves three requests through ``run --requests``."""
    spec = load_spec(SPECS / "mllama" / "llama-3.2-11b-vision-instruct-cb.yaml")
    language = build_specializations(spec).language.specializations
    for item in language[:-1]:
        assert item.symbols[symbols.BATCH_SIZE] == "1"
        assert item.symbols[symbols.FULL_BATCH_SIZE] == item.symbols[symbols.FULL_BATCH_EXEC_SIZE] == "4"
    assert language[-1].symbols[symbols.BATCH_SIZE] == language[-1].symbols[symbols.FULL_BATCH_SIZE] == "4"
    assert {item.symbols["cross_states"] for item in language} == {str(2 * 4 * 1601)}

    data = yaml.safe_load((SPECS / "mllama" / "llama-3.2-11b-vision-instruct-cb.yaml").read_text())
    data.pop("config")
    data.pop("compile", None)
    data.update(model=str(tiny_checkpoint(FAMILY)), ctx_len=CTX_LEN, prefill={"seq_lens": [SEQ_LEN]})
    data["vision"]["images"] = data["vision"]["images"][:1]
    path = write_spec_data(tmp_path, data)
    out = tmp_path / "out"
    args = ["compile", str(path), "-o", str(out), "--backend", "onnxruntime", "--export", str(cb_export)]
    assert main(args) == 0, capsys.readouterr().err
    runs = json.loads((out / "manifest.json").read_text())["programs"]["lang"]["verification"]["runs"]
    assert [run["symbols"][symbols.BATCH_SIZE] for run in runs] == [1, FULL_BATCH_SIZE]
    for run in runs:  # the untouched-slot check ran on every cache, the cross K/V included
        assert run["output_shapes"][symbols.retained(symbols.past_key(1))][0] == FULL_BATCH_SIZE

    # run --requests on the compiled artifact: the batched engine, one call per decode step.
    helpers.image(100, 150, 1).save(tmp_path / "a.png")
    helpers.image(300, 120, 2).save(tmp_path / "b.png")
    entries = [
        {"prompt": "Describe it.", "images": ["a.png"], "max_new_tokens": 3},
        {"prompt": "Compare.", "images": ["b.png", "a.png"], "max_new_tokens": 4},
        {"prompt": "Tell me a story about a cat.", "arrival_step": 2, "max_new_tokens": 4},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    capsys.readouterr()
    assert main(["run", str(out), "--requests", str(requests), "--compare-hf"]) == 0
    err = capsys.readouterr().err
    assert f"engine: full_batch_size {FULL_BATCH_SIZE} (one batched call per decode step)" in err, err
    assert err.count("tokens identical to transformers generate") == 3
