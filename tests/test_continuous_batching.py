"""Continuous batching (issue 10 item 4): the export's IO, the spec key, and slot parity per family.

Parity: on a tiny checkpoint's continuous-batching export, run by hand on onnxruntime, a longer
prompt first occupies slot 0 and is then replaced; an image prompt is prefilled into slot 2 and
a text prompt into slot 0 (batch 1, chunk by chunk), then both decode together at batch
``full_batch_size`` = 4 with the idle slots at position -1. Each sequence's tokens equal
transformers' ``generate`` run alone on it, logits within fp32 tolerance. Parametrized over the
registry: every family that supports continuous batching is tested by being registered.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.cli import main
from qeff_vision.compile.onnxruntime_backend import untouched_slot_problems
from qeff_vision.contract.slot_names import is_slot_name
from qeff_vision.export_record import read_export
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import TOKEN_MERGE, no
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, find_specs, load_spec
from tests import helpers
from tests.cb_harness import SlotCaches, SlotProgram, batched_decode, prefill_into_slot, prefill_shape
from tests.test_spec_helpers import problems_of, spec_data
from tests.test_spec_helpers import write_spec as write_spec_data

CB_FAMILIES = [f.name for f in all_families() if f.features.continuous_batching.supported]
NO_CB_FAMILIES = [f.name for f in all_families() if not f.features.continuous_batching.supported]
# The slot parity below drives the token-merge host; the cross-attention kind (mllama) has its own
# staggered-request parity in tests/test_mllama_cb.py.
TOKEN_MERGE_CB = [f.name for f in all_families() if f.name in CB_FAMILIES and f.decoder_kind == TOKEN_MERGE]
FULL_BATCH_SIZE = 4
NEW_TOKENS = 6
LOGIT_TOLERANCE = 1e-3


def _generator(export_dir, program, shape) -> Generator:
    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
    # No program yet (the slot harness sets one): a language with no inputs to read the IO from.
    language = program if program is not None else SimpleNamespace(input_dims={})
    return Generator(checkpoint, vision, language, shape)


@pytest.mark.parametrize("family", CB_FAMILIES)
def test_language_io_is_qefficients_continuous_batching_io(family, cb_exported):
    """batch_index [batch_size, 1] after the caches; every cache and its retained state on full_batch_size."""
    manifest = read_export(cb_exported(family))
    assert manifest["continuous_batching"] is True
    inputs = manifest["programs"]["lang"]["inputs"]
    outputs = manifest["programs"]["lang"]["outputs"]
    assert inputs[symbols.BATCH_INDEX] == {
        "dtype": "int64",
        "shape": ["batch_size", 1],
        "axes": {"0": "batch_size"},
    }
    graph = onnx.load(str(cb_exported(family) / "lang" / "model.onnx"), load_external_data=False).graph
    names = [value.name for value in graph.input if value.name in inputs]  # graph order, no weights
    # Every per-slot row of a registered state kind: KV caches, a recurrent layer's conv and
    # recurrent states (Qwen3.5), an MLA layer's compressed_kv and k_pe (Kimi-K2.5).
    caches = [name for name in names if is_slot_name(name)]
    assert caches and names.index(symbols.BATCH_INDEX) == names.index(caches[-1]) + 1  # QEfficient's order
    for name in caches:
        assert inputs[name]["axes"]["0"] == symbols.FULL_BATCH_SIZE
        assert outputs[symbols.retained(name)]["axes"]["0"] == symbols.FULL_BATCH_SIZE
    assert outputs[symbols.LOGITS]["axes"]["0"] == symbols.BATCH_SIZE


@pytest.mark.parametrize("family", TOKEN_MERGE_CB)
def test_sequences_in_different_slots_match_generate_alone(family, cb_exported, hf_model):
    model, processor = hf_model(family)
    export_dir = cb_exported(family)
    manifest = read_export(export_dir)
    program = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"])
    requests = {
        "previous": helpers.process(
            processor, helpers.user_turn("Tell me a long story about a dragon, a castle and the sea."), []
        ),
        "image": helpers.process(
            processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
        ),
        "text": helpers.process(processor, helpers.user_turn("Hi there"), []),
    }
    processed = {name: helpers.as_numpy(inputs) for name, inputs in requests.items()}
    shape = prefill_shape([p["input_ids"].shape[1] for p in processed.values()], NEW_TOKENS)
    caches = None

    def in_slot(slot: int) -> Generator:
        nonlocal caches
        generator = _generator(export_dir, None, shape)
        caches = caches or SlotCaches(generator, FULL_BATCH_SIZE)
        generator.language = SlotProgram(program, caches, slot)
        return generator

    # The previous occupant of slot 0 writes more positions than its successor will.
    previous = prefill_into_slot(in_slot(0), processed["previous"], 0, NEW_TOKENS)
    first = in_slot(0)
    batched_decode(first, program, caches, [previous], first.eos_token_ids)
    image = prefill_into_slot(in_slot(2), processed["image"], 2, NEW_TOKENS)
    text = prefill_into_slot(in_slot(0), processed["text"], 0, NEW_TOKENS)
    calls = batched_decode(first, program, caches, [image, text], first.eos_token_ids)
    assert calls >= 1

    for name, sequence in (("image", image), ("text", text)):
        tokens, logits = helpers.hf_generate(model, requests[name], NEW_TOKENS)
        assert sequence.tokens == tokens, f"{family} {name} (slot {sequence.slot}): tokens differ"
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(sequence.logits, logits))
        assert worst <= LOGIT_TOLERANCE, f"{family} {name}: logits differ by {worst}"


# ---- spec key, validate, specializations, onnxruntime backend ----

SPECS = Path(__file__).resolve().parent.parent / "specs"


def _spec_from(path: Path, tmp_path: Path, **overrides) -> Path:
    """A copy of a repository spec with ``overrides`` at the top level, its config path made absolute."""
    data = yaml.safe_load(path.read_text())
    data["config"] = str((path.parent / data["config"]).resolve())
    data.update(overrides)
    return write_spec_data(tmp_path, data)


def test_full_batch_size_with_batch_size_above_one_is_refused_in_one_line(tmp_path, capsys):
    path = write_spec_data(tmp_path, spec_data(batch_size=2, full_batch_size=4))
    assert problems_of(path) == [
        "full_batch_size: continuous batching prefills one sequence at a time (batch_size 1) and "
        "decodes full_batch_size 4 at once; it cannot be combined with batch_size 2"
    ]
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One problem is the whole answer: the one error line names the spec and the problem.
    assert len(err) == 1 and f"{path}: full_batch_size: continuous batching prefills" in err[0]


@pytest.mark.parametrize("value", [0, -1, "four", 5000])
def test_full_batch_size_must_be_a_positive_integer_in_range(tmp_path, value):
    path = write_spec_data(tmp_path, spec_data(full_batch_size=value))
    assert [p for p in problems_of(path) if p.startswith("full_batch_size: must be")], problems_of(path)


def test_a_family_without_continuous_batching_is_refused_with_the_reason(tmp_path, capsys, monkeypatch):
    """Every registered family batches today; one that declares it cannot is refused with its reason."""
    family = get_family("llava")
    note = "the test family's reason"
    features = dataclasses.replace(family.features, continuous_batching=no(note))
    monkeypatch.setattr(family, "features", features)
    path = _spec_from(SPECS / "llava" / "llava-1.5-7b-hf.yaml", tmp_path, full_batch_size=4)
    assert problems_of(path) == [f"full_batch_size: {family.title} cannot do continuous batching: {note}"]
    assert main(["validate", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_specializations_follow_qefficient_continuous_batching():
    """Prefill: batch_size 1, full_batch_size and full_batch_exec_size F; decode: batch_size F."""
    spec = load_spec(SPECS / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct-cb.yaml")
    language = build_specializations(spec).language.specializations
    prefill, decode = language[:-1], language[-1]
    for item in prefill:
        assert item.symbols[symbols.BATCH_SIZE] == "1"
        assert item.symbols[symbols.FULL_BATCH_SIZE] == item.symbols[symbols.FULL_BATCH_EXEC_SIZE] == "4"
    assert decode.symbols[symbols.BATCH_SIZE] == decode.symbols[symbols.FULL_BATCH_SIZE] == "4"
    assert symbols.FULL_BATCH_EXEC_SIZE not in decode.symbols
    assert {item.symbols[symbols.VISION_BATCH_SIZE] for item in language} == {"1"}


def test_every_continuous_batching_family_has_a_golden_continuous_batching_spec():
    """One full_batch_size spec per family that supports it, its goldens specialized for CB."""
    specs = [load_spec(path) for path in find_specs(SPECS)]
    for family in CB_FAMILIES:
        cb_specs = [
            s
            for s in specs
            if s.family == family and s.full_batch_size is not None and s.deployment.mode == "dual"
        ]
        assert cb_specs, f"family {family} has no spec with full_batch_size under specs/"
        for spec in cb_specs:
            golden = SPECS / "golden" / spec.name / "lang" / "specializations.json"
            # Flat entries, or {"name", "symbols"} with specialization_layout: named.
            entries = [e.get("symbols", e) for e in json.loads(golden.read_text())["specializations"]]
            full = str(spec.full_batch_size)
            assert {e[symbols.FULL_BATCH_SIZE] for e in entries} == {full}, spec.name
            decode = [e for e in entries if e[symbols.SEQ_LEN] == "1"]
            assert decode and all(e[symbols.BATCH_SIZE] == full for e in decode), spec.name
    for family in NO_CB_FAMILIES:
        assert not [s for s in specs if s.family == family and s.full_batch_size is not None], family


CB_SPECS = {
    "qwen2_5_vl": "qwen2_5_vl/qwen2_5_vl-3b-instruct-cb",
    "gemma3": "gemma3/gemma-3-4b-it-cb",
    # Per-layer cache shapes and shared-KV layers without rows: the slot check reads the table's rows.
    "gemma4": "gemma4/gemma-4-e2b-it-cb",
}


@pytest.mark.parametrize("family", list(CB_SPECS))
def test_onnxruntime_backend_verifies_the_continuous_batching_specializations(
    family, cb_exported, tiny_checkpoint, tmp_path, capsys
):
    base = CB_SPECS[family]
    data = yaml.safe_load((SPECS / f"{base}.yaml").read_text())
    data.pop("config")
    data.update(model=str(tiny_checkpoint(family)), ctx_len=512, prefill={"seq_lens": [32, 64]})
    data["vision"]["images"] = data["vision"]["images"][:1]
    data.pop("compile", None)
    path = write_spec_data(tmp_path, data)
    out = tmp_path / "out"
    args = [
        "compile",
        str(path),
        "-o",
        str(out),
        "--backend",
        "onnxruntime",
        "--export",
        str(cb_exported(family)),
    ]
    assert main(args) == 0, capsys.readouterr().err
    lang = json.loads((out / "manifest.json").read_text())["programs"]["lang"]
    runs = lang["verification"]["runs"]
    assert [run["symbols"][symbols.BATCH_SIZE] for run in runs] == [1, 1, 4]
    for run in runs:
        assert run["output_shapes"][symbols.LOGITS][0] == run["symbols"][symbols.BATCH_SIZE]
        assert run["output_shapes"][symbols.retained(symbols.past_key(0))][0] == 4


def test_an_export_without_continuous_batching_is_refused_for_a_full_batch_size_spec(
    exported, tiny_checkpoint, tmp_path, capsys
):
    data = yaml.safe_load((SPECS / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct-cb.yaml").read_text())
    data.pop("config")
    data.update(model=str(tiny_checkpoint("qwen2_5_vl")), ctx_len=256, prefill={"seq_lens": [32]})
    data["vision"]["images"] = data["vision"]["images"][:1]
    path = write_spec_data(tmp_path, data)
    args = ["compile", str(path), "-o", str(tmp_path / "out"), "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported("qwen2_5_vl"))]) == 2
    assert "needs an export with continuous batching" in capsys.readouterr().err


def test_untouched_slots_check_names_a_slot_written_by_mistake():
    past = np.zeros((4, 1, 2, 1), np.float32)
    moved = past.copy()
    moved[3] = 1.0  # slot 3 changed although the call names slot 1 only
    feeds = {"past_key.0": past, symbols.BATCH_INDEX: np.array([[1]])}
    assert untouched_slot_problems(feeds, {"past_key.0_RetainedState": moved}) == [
        "past_key.0_RetainedState changed KV slots [0, 2, 3] that batch_index does not name"
    ]
    assert untouched_slot_problems(feeds, {"past_key.0_RetainedState": past}) == []
