"""Calibration in one pass over the slices (issue 48): the same ranges and plan as one pass per call.

The generated calibration inputs of every specialization of a program run slice-major
(:meth:`SlicedRecorder.run_many`): each slice's session is built once for every input instead of
once per input. The reference is the way it ran before, one full pass per input (each slice's
session built per call), on the same slices. Every family's tiny export (mixture of experts,
cross-attention and Gated DeltaNet included) with the specializations of its own repository spec,
cut into an eighth of its weights per slice so that several slices exchange values.
"""

from __future__ import annotations

import pytest

from qeff_vision import symbols
from qeff_vision.compile.inputs import given_export, plan_inputs
from qeff_vision.compile.precision import calibration_feeds
from qeff_vision.families import all_families
from qeff_vision.graph_file import load_graph
from qeff_vision.numerics.device import float_outputs, value_types
from qeff_vision.numerics.plan import auto_plan
from qeff_vision.numerics.recording import SlicedRecorder
from qeff_vision.spec import build_specializations, load_spec
from tests.helpers import tiered
from tests.test_calibration_fit import _small_spec

FAMILIES = [family.name for family in all_families()]


def _program_feeds(family, tiny_checkpoint, exported, tmp_path):
    """Per program: (graph path, the generated calibration input of each of its specializations)."""
    path, _ = _small_spec(family, tiny_checkpoint(family), tmp_path, "auto")
    spec = load_spec(path)
    export = given_export(spec, exported(family))
    plans = plan_inputs(build_specializations(spec, layout="flat"), spec, tmp_path / "out", export)
    programs = {}
    for plan in plans.values():
        # A disaggregated deployment compiles one graph twice: calibrate it once.
        # Two seeds: a program with one specialization still has several inputs in the pass.
        for seed in (0, 1):
            feeds = calibration_feeds(plan.onnx, plan.symbol_values(), seed, plan.image_sizes())
            programs.setdefault(plan.onnx, []).extend(feeds)
    return programs


def _recorder(onnx_path, parts: int = 8) -> SlicedRecorder:
    model = load_graph(onnx_path)
    types = value_types(model)
    budget = max(1, sum(f.stat().st_size for f in onnx_path.parent.glob("*.data")) // parts)
    outputs = [value.name for value in model.graph.output]
    return SlicedRecorder(
        model, onnx_path.parent, float_outputs(model, types), types, outputs, slice_bytes=budget
    )


@pytest.mark.parametrize("family", tiered(FAMILIES))
def test_one_pass_over_the_slices_records_the_ranges_of_one_pass_per_input(
    family, tiny_checkpoint, exported, tmp_path
):
    for onnx_path, feeds in _program_feeds(family, tiny_checkpoint, exported, tmp_path).items():
        assert len(feeds) >= 2, onnx_path
        per_call = _recorder(onnx_path)
        expected_outputs = [per_call.run(feed) for feed in feeds]
        one_pass = _recorder(onnx_path)
        outputs = one_pass.run_many(feeds)
        where = f"{family} {onnx_path.parent.name}"
        assert one_pass.ranges == pytest.approx(per_call.ranges, rel=1e-6, abs=0), where
        assert [c.stop for c in one_pass.slices] == [c.stop for c in per_call.slices], where
        for got, expected in zip(outputs, expected_outputs):
            assert got.keys() == expected.keys()
            for name in got:
                assert got[name].shape == expected[name].shape, (where, name)
                assert abs(got[name].astype(float) - expected[name].astype(float)).max() <= 1e-5, (
                    where,
                    name,
                )
        model = load_graph(onnx_path)
        assert auto_plan(model, one_pass.ranges) == auto_plan(model, per_call.ranges), where
        # Each slice's session is built once for all the inputs, not once per input.
        assert one_pass.sessions_built < per_call.sessions_built, where
        assert len(one_pass.slices) >= 2, where


BUCKET = 32


def _prompt_ranges(export, monkeypatch, one_pass: bool, parts: int = 8, generated=None):
    """The calibration prompts' ranges, all calls of a program in one pass or each call on its own.

    Also the two recording programs (vision, language). ``generated``: graph path -> generated
    inputs that join the prompts' calls of that program.
    """
    from qeff_vision.compile import calibration

    init = calibration.RecordingProgram.__init__
    programs = []

    def sliced(self, path, specs=None, slice_bytes=None, deferred=False):
        weights = sum(data.stat().st_size for data in path.parent.glob("*.data"))
        init(self, path, specs, slice_bytes=max(1, weights // parts), deferred=deferred)
        programs.append(self)

    monkeypatch.setattr(calibration.RecordingProgram, "__init__", sliced)
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: BUCKET,
        symbols.VISION_SIZE: BUCKET,
        symbols.CTX_LEN: 512,
    }
    language = [bucket, {**bucket, symbols.SEQ_LEN: 1}]
    extra = {}
    for onnx_path, feeds in (generated or {}).items():  # by graph: the export's two programs
        extra[onnx_path.parent.name] = feeds
    try:
        ranges = calibration.prompt_ranges(
            export, None, language, [(100, 150)], generated=extra, one_pass=one_pass
        )
    finally:
        monkeypatch.setattr(calibration.RecordingProgram, "__init__", init)
    return ranges, programs


@pytest.mark.parametrize("family", tiered(FAMILIES))
def test_every_call_of_a_program_in_one_pass_records_the_ranges_of_calls_run_one_by_one(
    family, tiny_checkpoint, exported, monkeypatch, tmp_path
):
    """Slice-major calibration (decision 047): every image's vision call, every prompt's prefill
    chunks and teacher-forced decode steps and the generated inputs, one pass per program: the
    ranges and plans of the same calls run one by one (one pass each)."""
    export = exported(family)
    generated = _program_feeds(family, tiny_checkpoint, exported, tmp_path)
    assert {path.parent.name for path in generated} == {"vision", "lang"}, family
    eager, _ = _prompt_ranges(export, monkeypatch, one_pass=False, generated=generated)
    one, programs = _prompt_ranges(export, monkeypatch, one_pass=True, generated=generated)
    for program in ("vision", "lang"):
        assert one[program] == pytest.approx(eager[program], rel=1e-6, abs=0), program
        model = load_graph(export / program / "model.onnx")
        assert auto_plan(model, one[program]) == auto_plan(model, eager[program]), program
    vision, language = programs[-2:]
    # Each program's calls share one pass over its slices: each weight read once.
    assert language.recorder.passes == 1, language.recorder.passes
    assert language.recorder.calls_run >= 8, language.recorder.calls_run  # chunks, 3 steps, 2 runs
    assert vision.recorder.passes == 1, vision.recorder.passes
    assert len(language.recorder.slices) >= 2


def test_decode_steps_are_teacher_forced_by_the_prompt_text(exported):
    """A calibration prompt continues with its own text's first tokens, never reading the logits."""
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.compile.calibration import DECODE_STEPS, ForcedTokens, continuation_ids
    from qeff_vision.export_record import read_export

    manifest = read_export(exported("qwen2_5_vl"))
    processor = Checkpoint.open(manifest["model"], manifest["family"]).processor
    text = "Describe this image in detail."
    ids = continuation_ids(processor, text, [7, 8, 9])
    assert ids == processor.tokenizer(text, add_special_tokens=False)["input_ids"][:DECODE_STEPS]
    assert continuation_ids(processor, "", [7, 8, 9]) == [9]  # no words: the prompt's last token
    forced = ForcedTokens([5, 6])
    assert [forced.next_token(object()) for _ in range(3)] == [5, 6, 6]
    assert ForcedTokens.reads_logits is False


def test_a_generated_input_runs_only_for_shapes_no_prompt_ran(
    tiny_checkpoint, exported, monkeypatch, tmp_path
):
    """A generated input gives a specialization no prompt reaches its ranges; one whose input shapes
    a prompt's call already ran is not run again (its 0.1-std noise records lower peaks than the
    processed image, and at 1080x1920 the repeat would cost a full-depth tower's pass)."""
    import numpy as np

    from qeff_vision.compile.recording_program import call_shapes

    family = "qwen2_5_vl"
    export = exported(family)
    _, programs = _prompt_ranges(export, monkeypatch, one_pass=True)
    vision = programs[-2]
    prompt_calls = vision.recorder.calls_run
    ran = sorted(vision.shapes_run)
    assert ran, "the prompt encoded no image"
    rng = np.random.default_rng(3)
    dtypes = vision.input_dtypes
    duplicate = {
        name: (rng.standard_normal(shape) * 0.1).astype(dtypes[name])
        if np.issubdtype(dtypes[name], np.floating)
        else np.zeros(shape, dtypes[name])
        for name, shape in ran[0]
    }
    generated = _program_feeds(family, tiny_checkpoint, exported, tmp_path)
    vision_path = next(path for path in generated if path.parent.name == "vision")
    new = [feeds for feeds in generated[vision_path] if call_shapes(feeds) not in vision.shapes_run]
    assert new, "every generated vision input repeats the prompt's shapes: nothing to compare"
    _, programs = _prompt_ranges(
        export, monkeypatch, one_pass=True, generated={vision_path: [duplicate, *new]}
    )
    vision = programs[-2]
    distinct = {call_shapes(feeds) for feeds in new}
    # One call per shape not run before: the duplicate is skipped, and so is a second generated
    # input of a shape the first one ran.
    assert vision.recorder.calls_run == prompt_calls + len(distinct), (prompt_calls, len(new), len(distinct))
    assert vision.recorder.passes == 1
