"""Calibration fits its prompts to the compiled shapes: a small valid ctx_len compiles (issue 31).

Every family's tiny checkpoint compiles on onnxruntime with ``ctx_len`` just above its largest
image's rows plus its largest prefill bucket, with ``node_precision`` ``auto`` and ``none`` (both
run the device-precision calibration). The default calibration prompt does not fit whole there
(tiny tokenizers spend a token on almost every character); it is shortened, one note says so, and
nothing asks the user to change a prompt they did not write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.cli import main
from qeff_vision.compile.calibration import DEFAULT_PROMPT, _Fitting, within_budget
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import ImageSize
from qeff_vision.spec import find_specs, load_spec
from tests import helpers
from tests.test_spec_helpers import write_spec as write_spec_data

SPECS = Path(__file__).resolve().parent.parent / "specs"
FAMILIES = [family.name for family in all_families()]
BUCKET = 32


def _small_spec(family: str, model: Path, tmp_path: Path, node_precision: str) -> tuple[Path, int]:
    """(spec path, ctx_len): the family's plain repository spec on ``model``, ctx_len just big enough."""
    base = next(
        path
        for path in find_specs(SPECS)
        if (spec := load_spec(path)).family == family
        and spec.deployment.mode == "dual"
        and spec.full_batch_size is None
        and spec.compile.comp_ctx_lengths is None
        and not spec.vision.patch_buckets
        and not any(image.video for image in spec.vision.images)
    )
    description = Checkpoint.open(model, family).description
    sizes = [ImageSize(height, width) for height, width in load_adapter(get_family(family)).test_image_sizes]
    largest = max(sizes, key=lambda size: get_family(family).image_tokens(description, size))
    rows = get_family(family).image_tokens(description, largest)
    data = yaml.safe_load(base.read_text())
    data.pop("config")
    data.pop("compile", None)
    ctx_len = rows + BUCKET + 1
    data.update(model=str(model), ctx_len=ctx_len, prefill={"seq_lens": [BUCKET]})
    data["vision"]["images"] = [{"height": largest.height, "width": largest.width}]
    data["vision"].pop("max_images", None)
    data["compile"] = {"node_precision": node_precision}
    return write_spec_data(tmp_path, data), ctx_len


# Two onnxruntime compiles per family (the costliest every-family suite of the default tier): the
# default tier runs one family per decoder and state kind, `-m slow` every family.
@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_every_family_compiles_with_ctx_len_just_above_an_image_and_a_bucket(
    family, tiny_checkpoint, exported, tmp_path, capsys
):
    for node_precision in ("auto", "none"):
        work = tmp_path / node_precision
        work.mkdir()
        path, ctx_len = _small_spec(family, tiny_checkpoint(family), work, node_precision)
        out = work / "out"
        args = [
            "compile",
            str(path),
            "-o",
            str(out),
            "--backend",
            "onnxruntime",
            "--export",
            str(exported(family)),
        ]
        code = main(args)
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert "shorten the prompt" not in captured.out + captured.err
        manifest = json.loads((out / "manifest.json").read_text())
        runs = manifest["programs"]["lang"]["verification"]["runs"]
        assert all(run["symbols"]["ctx_len"] == ctx_len for run in runs)
        # Calibration ran with its prompts fitted (the default one is too long whole here).
        assert f"to fit the compiled ctx_len {ctx_len}" in captured.out + captured.err


class _Chat:
    """A conversation stand-in whose prompt is the template (``base`` tokens) plus one token a word."""

    def __init__(self, base: int):
        self.base = base

    def prepare(self, images, text):
        import numpy as np

        class Inputs:
            processed = {"input_ids": np.zeros((1, self.base + len(text.split())), np.int64)}

        return Inputs()


def test_fitting_keeps_the_longest_prefix_that_leaves_a_decode_step_and_skips_what_cannot_fit():
    words = len(DEFAULT_PROMPT.split())
    fitting = _Fitting(ctx_len=20)
    assert fitting.fit(_Chat(5), [], DEFAULT_PROMPT) == (
        " ".join(DEFAULT_PROMPT.split()[:words]),
        3,
        5 + words,
    )
    assert fitting.note() == ""
    kept, steps, tokens = fitting.fit(_Chat(12), [], DEFAULT_PROMPT)
    assert len(kept.split()) == 7 and steps == 1 and tokens == 19  # one new token fits
    assert fitting.fit(_Chat(20), ["image"], DEFAULT_PROMPT) is None
    assert fitting.note() == (
        "note: to fit the compiled ctx_len 20, 1 of 3 calibration prompts shortened, "
        "1 skipped (an image's prompt needs 20+ tokens before any words)"
    )


def test_the_language_runs_prompts_within_the_budget_and_always_one_image_prompt():
    picture, text = object(), "words"
    runs = [(text, picture), (text, picture), (text, None)]
    fitted = [("w", 3, 2700), ("w", 3, 300), ("w", 3, 20)]  # 1080p, 448, text alone
    assert within_budget(runs, fitted, None) == [True, True, True]
    assert within_budget(runs, fitted, 1024) == [False, True, True]
    assert within_budget(runs, fitted, 300) == [False, True, True]  # the bound is inclusive
    # No image prompt within the bound: the shortest image prompt runs whole.
    assert within_budget(runs, fitted, 100) == [False, True, True]
    assert within_budget(runs, fitted, 10) == [False, True, False]
    only_long = [(text, picture), (text, None)]
    assert within_budget(only_long, [("w", 3, 2700), ("w", 3, 20)], 1024) == [True, True]
    # A prompt that does not fit ctx_len (None) never runs, and is not the image prompt chosen.
    assert within_budget(runs, [None, ("w", 3, 2000), ("w", 3, 20)], 1024) == [False, True, True]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (0, "must be a positive integer or null"),
        (-5, "must be a positive integer or null"),
        ("1024", "must be a positive integer or null"),
        (True, "must be a positive integer or null"),
        (1.5, "must be a positive integer or null"),
    ],
)
def test_a_bad_prompt_budget_is_one_clear_problem(value, problem):
    from qeff_vision.spec.compile_options import parse_calibration

    calibration, problems = parse_calibration({"max_prompt_tokens": value}, "compile.calibration")
    assert calibration is None and problems == [
        f"compile.calibration.max_prompt_tokens: {problem}, got {value!r}"
    ]


def test_the_prompt_budget_defaults_to_1024_and_null_lifts_it():
    from qeff_vision.spec.compile_options import DEFAULT_MAX_PROMPT_TOKENS, parse_calibration

    assert parse_calibration({}, "c")[0].max_prompt_tokens == DEFAULT_MAX_PROMPT_TOKENS == 1024
    assert parse_calibration({"max_prompt_tokens": None}, "c")[0].max_prompt_tokens is None
    assert parse_calibration({"max_prompt_tokens": 4096}, "c")[0].max_prompt_tokens == 4096


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_a_prompt_over_the_budget_encodes_its_image_and_skips_the_language(family, exported, monkeypatch):
    """A budget below every prompt: both images still go through the vision program, the language
    program runs the shortest image prompt alone (a subset of the calls: peaks no larger), a note
    names the prompts left out."""
    from qeff_vision import symbols
    from qeff_vision.compile.calibration import prompt_ranges
    from qeff_vision.numerics.recording import SlicedRecorder

    export = exported(family)
    calls: dict[str, int] = {}
    run_many = SlicedRecorder.run_many

    def counted(self, feeds, *args, **kwargs):  # calls run, per graph (the images' in round 1)
        name = self.model_dir.name
        calls[name] = calls.get(name, 0) + len(feeds)
        return run_many(self, feeds, *args, **kwargs)

    monkeypatch.setattr(SlicedRecorder, "run_many", counted)
    sizes = sorted(load_adapter(get_family(family)).test_image_sizes, key=lambda hw: hw[0] * hw[1])
    resolutions = [tuple(sizes[0]), tuple(sizes[-1])]
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: BUCKET,
        symbols.VISION_SIZE: BUCKET,
        symbols.CTX_LEN: 4096,
    }
    language = [bucket, {**bucket, symbols.SEQ_LEN: 1}]
    results = {}
    for budget in (None, 1):
        calls.clear()
        notes: list[str] = []
        ranges = prompt_ranges(
            export, None, language, resolutions, say=notes.append, max_prompt_tokens=budget
        )
        results[budget] = ranges, dict(calls), notes
    (whole, whole_calls, whole_notes), (bounded, bounded_calls, bounded_notes) = results[None], results[1]
    assert not whole_notes
    assert bounded_calls["vision"] == whole_calls["vision"]  # every image encoded
    assert 0 < bounded_calls["lang"] < whole_calls["lang"]
    assert [note.split(" (up to")[0] for note in bounded_notes] == [
        "note: 2 calibration prompt(s) longer than 1 tokens left out of the language program"
    ]
    assert bounded["vision"] == whole["vision"]
    assert bounded["lang"].keys() == whole["lang"].keys()
    assert all(bounded["lang"][name] <= whole["lang"][name] for name in whole["lang"])
