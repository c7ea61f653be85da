"""``vision.video_pruning_rate``: validated, declared per family, and sized for before anything is encoded.

A pruned clip's row count depends only on its grid and the rate, so ``specialize`` gives the
language program the vision size of the kept rows (the vision program still encodes every row)
and ``validate`` says so in its notes.
"""

from __future__ import annotations

import re

import pytest

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.spec import build_specializations, load_spec
from tests.test_spec_helpers import SPECS, problems_of, spec_data, write_spec

EVS_SPEC = SPECS / "qwen2_5_vl" / "qwen2_5_vl-7b-instruct-video-evs.yaml"
VIDEO = {"height": 720, "width": 1280, "frames": 8}  # 4 x 26 x 46 = 4,784 rows on Qwen2.5-VL


def _video_spec(rate=None, **vision):
    section = {"videos": [VIDEO], "vision_size": "chunk", **vision}
    if rate is not None:
        section["video_pruning_rate"] = rate
    return spec_data(ctx_len=16384, prefill={"seq_lens": [512, 4096]}, vision=section)


def _sizes(result, program):
    return {s.name: s.symbols[symbols.VISION_SIZE] for s in getattr(result, program).specializations}


def test_the_language_program_is_sized_for_the_kept_rows(tmp_path):
    plain = build_specializations(load_spec(write_spec(tmp_path, _video_spec(), "plain.yaml")))
    pruned = build_specializations(load_spec(write_spec(tmp_path, _video_spec(0.75), "evs.yaml")))
    assert _sizes(plain, "language") == {"Prefill-512": "512", "Prefill-4096": "4096", "Decode": "4096"}
    # max(one temporal patch of 1,196 rows, int(4,784 x 0.25) = 1,196)
    assert _sizes(pruned, "language") == {"Prefill-512": "512", "Prefill-4096": "1196", "Decode": "1196"}
    stills_and_clip = {"Vision-354x536": "247", "Vision-720x1280x8": "4784"}
    assert _sizes(pruned, "vision") == _sizes(plain, "vision") == stills_and_clip
    assert pruned.request_image_tokens == 1196 and plain.request_image_tokens == 4784
    still, clip = pruned.images
    assert (still.tokens, clip.tokens) == (247, 1196) and clip.chunks[512] == (3, 4)


def test_rate_zero_specializes_exactly_as_no_key(tmp_path):
    plain = build_specializations(load_spec(write_spec(tmp_path, _video_spec(), "plain.yaml")))
    zero = build_specializations(load_spec(write_spec(tmp_path, _video_spec(0), "zero.yaml")))
    for program in ("vision", "language"):
        ours, theirs = getattr(zero, program), getattr(plain, program)
        assert ours.specializations_json() == theirs.specializations_json()
        assert ours.custom_io_yaml() == theirs.custom_io_yaml()


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        (1.0, "must be in [0, 1)"),
        (-0.25, "must be in [0, 1)"),
        ("half", "must be a number in [0, 1)"),
        (True, "must be a number in [0, 1)"),
    ],
)
def test_bad_rates_are_one_problem_each(tmp_path, capsys, rate, message):
    path = write_spec(tmp_path, _video_spec(rate))
    assert [p for p in problems_of(path) if "video_pruning_rate" in p] == [
        next(p for p in problems_of(path) if message in p)
    ]
    assert main(["validate", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "video_pruning_rate" in line]
    assert len(lines) == 1 and f"vision.video_pruning_rate: {message}" in lines[0]


def test_a_rate_needs_a_family_that_prunes_and_clips_to_prune(tmp_path):
    llava = spec_data(
        model="llava-hf/llava-1.5-7b-hf",
        config=str(SPECS / "configs" / "llava-1.5-7b-hf" / "config.json"),
        vision={"images": [{"height": 336, "width": 336}], "video_pruning_rate": 0.5},
    )
    (problem,) = problems_of(write_spec(tmp_path, llava, "llava.yaml"))
    assert problem == (
        "vision.video_pruning_rate: LLaVA-1.5 does not prune video tokens (the family takes no video); "
        "remove this key"
    )
    stills = spec_data(vision={"video_pruning_rate": 0.5})
    (problem,) = problems_of(write_spec(tmp_path, stills, "stills.yaml"))
    assert problem == "vision.video_pruning_rate: prunes clips, but vision.videos lists none"


def test_validate_notes_the_kept_rows_of_each_clip(capsys):
    assert main(["validate", str(EVS_SPEC)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note: video_pruning_rate" in line]
    assert len(notes) == 2
    assert "a 360x640x16f clip keeps 598 of its 2392 rows" in notes[0]
    assert "a 720x1280x8f clip keeps 1196 of its 4784 rows" in notes[1]
    assert all("depends only on its grid and the rate" in note for note in notes)


def test_families_table_shows_video_pruning():
    from qeff_vision import api
    from qeff_vision.families import all_families

    table = api.families_table()
    for family in all_families():
        cell = re.escape(family.features.video_pruning.cell())
        assert re.search(rf"\bvideo pruning +{cell}$", table, re.MULTILINE), family.name
    pruning = {family.name for family in all_families() if family.features.video_pruning.supported}
    assert pruning == {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
    assert all(f.features.video.supported for f in all_families() if f.name in pruning)
