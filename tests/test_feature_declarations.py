"""Features are declared once, default to "no (not declared)", and validate refuses what a family lacks."""

from __future__ import annotations

from pathlib import Path

from qeff_vision import api
from qeff_vision.cli import main
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import Features

SPECS = Path(__file__).resolve().parents[1] / "specs"
MLLAMA_SPEC = SPECS / "mllama" / "llama-3.2-11b-vision-instruct.yaml"


def test_every_feature_defaults_to_not_declared():
    # "dual QPC" is the one row no family declares: the default deployment works for every family.
    defaults = {name: support.cell() for name, support in Features().rows() if name != "dual QPC"}
    assert set(defaults.values()) == {"no (not declared)"}, defaults
    # Every registered family states each fact itself: none reads as "not declared".
    for family in all_families():
        assert all(support.note != "not declared" for _, support in family.features.rows()), family.name


def test_gemma3_two_way_image_attention_is_one_declaration():
    gemma = get_family("gemma3")
    assert not gemma.features.chunk_split.supported and gemma.bidirectional_images
    # Molmo2 declares it too (its image tokens attend both ways, across images as well).
    assert {f.name for f in all_families() if f.bidirectional_images} == {"gemma3", "molmo2"}
    assert all(f.features.chunk_split.supported for f in all_families() if not f.bidirectional_images)


def test_validate_refuses_ccl_for_a_family_without_it_with_the_families_reason(tmp_path, capsys):
    text = MLLAMA_SPEC.read_text().replace("../configs/", f"{SPECS}/configs/")
    spec = tmp_path / "ccl.yaml"
    spec.write_text(text + "  comp_ctx_lengths:\n    prefill: [4096]\n    decode: [4096, 8192]\n")
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    reason = get_family("mllama").features.comp_ctx_lengths
    assert not reason.supported
    # ``qeff-vision families`` prints the same reason in mllama's row.
    table = api.families_table().split("mllama [")[1].split("\n")
    assert any("comp_ctx_lengths" in line and line.endswith(reason.cell()) for line in table)
    assert f"{spec}: compile.comp_ctx_lengths: Llama 3.2 Vision cannot use compute-context lengths: " in err
    assert reason.note in err
    # The same spec without the CCL lists is valid.
    assert api.validate(MLLAMA_SPEC) == ([], [])
