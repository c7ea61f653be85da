"""Spec key ``deployment``, the disaggregated programs' files and command lines, the stand-in compile.

No torch: specs on pinned configs, a synthetic export for the compile through the stand-in
compiler. Runtime parity of a disaggregated deployment: tests/test_disaggregated.py.
"""

from __future__ import annotations

import json

import onnx
import pytest
import yaml

from qeff_vision import api, symbols
from qeff_vision.cli import main
from qeff_vision.compile.deployment import golden_commands, program_options
from qeff_vision.compile.driver import compile_spec
from qeff_vision.contract.slot_names import is_kv_name, kv_prefix_of, with_kv_prefix_name
from qeff_vision.families import all_families
from qeff_vision.spec import build_specializations, load_spec
from qeff_vision.spec.deployment import DISAGGREGATED, DUAL, LANG_DECODE, LANG_PREFILL
from tests.compile_fixtures import REPO, calls, stand_in, synthetic_export, write_spec
from tests.test_spec_helpers import problems_of, spec_data
from tests.test_spec_helpers import write_spec as write_spec_data

PREFIX = "vllmKvCache"


def _disaggregated(tmp_path, **overrides):
    return write_spec_data(tmp_path, spec_data(deployment="disaggregated", full_batch_size=4, **overrides))


def test_deployment_defaults_to_dual_and_is_checked(tmp_path):
    spec = load_spec(write_spec_data(tmp_path, spec_data()))
    assert spec.deployment.mode == DUAL and spec.deployment.kv_cache_prefix is None
    assert list(spec.deployment.programs) == ["vision", "lang"]
    problems = problems_of(write_spec_data(tmp_path, spec_data(deployment="triple")))
    assert problems == ["deployment: must be one of dual, single, disaggregated (got 'triple')"]


def test_single_refuses_batching_keys_each_in_one_line(tmp_path):
    problems = problems_of(write_spec_data(tmp_path, spec_data(deployment="single", full_batch_size=4)))
    assert (
        "full_batch_size: deployment single serves one sequence (batch 1); remove full_batch_size" in problems
    )
    # Every problem is one line (the CLI prints each on its own line, exit 2).
    assert all("\n" not in problem for problem in problems)


def test_single_is_refused_with_the_familys_reason_where_not_built(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    from qeff_vision.families import get_family
    from qeff_vision.families.features import single_program_not_built

    path = write_spec_data(tmp_path, spec_data(deployment="single"))
    assert main(["validate", str(path)]) == 0  # Qwen2.5-VL (a patch-sequence tower) is built
    capsys.readouterr()
    # A family declaring it not built (every family may be built one day) is refused with its reason.
    family = type(get_family("qwen2_5_vl"))
    monkeypatch.setattr(
        family, "features", replace(family.features, single_program=single_program_not_built("a reason"))
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "deployment: Qwen2.5-VL cannot be deployed single: not built for this family: a reason" in err
    assert "Traceback" not in err


def test_kv_cache_prefix_needs_disaggregated_and_a_plain_name(tmp_path):
    problems = problems_of(write_spec_data(tmp_path, spec_data(kv_cache_prefix=PREFIX)))
    assert problems == [
        "kv_cache_prefix: names the KV tensors a prefill program hands to a decode program; it needs "
        "deployment: disaggregated"
    ]
    problems = problems_of(_disaggregated(tmp_path, kv_cache_prefix="a.b"))
    assert problems == ["kv_cache_prefix: must be letters and digits, starting with a letter (got 'a.b')"]
    assert load_spec(_disaggregated(tmp_path, kv_cache_prefix=PREFIX)).deployment.kv_cache_prefix == PREFIX


def test_families_table_has_a_row_per_mode_with_reasons():
    table = api.families_table()
    for family in all_families():
        assert family.features.deployment(DISAGGREGATED).supported, family.name
    assert table.count("disaggregated        yes (deployment: disaggregated") == len(all_families())
    single = {f.name for f in all_families() if f.features.deployment("single").supported}
    assert {"llava", "gemma3", "internvl", "mllama"} <= single
    assert table.count("single QPC           yes (one lang program") == len(single)
    assert table.count("single QPC           no (not built") == len(all_families()) - len(single)


def test_disaggregated_programs_split_the_language_specializations(tmp_path):
    spec = load_spec(_disaggregated(tmp_path, kv_cache_prefix=PREFIX))
    result = build_specializations(spec)
    programs = {files.directory: files for files in result.programs}
    assert list(programs) == ["vision", LANG_PREFILL, LANG_DECODE]
    prefill, decode = programs[LANG_PREFILL], programs[LANG_DECODE]
    # The prefill program has no decode specialization, the decode program no prefill one.
    assert [s.name for s in prefill.specializations] == ["Prefill-128", "Prefill-512"]
    assert [s.name for s in decode.specializations] == ["Decode"]
    for entry in prefill.specializations:
        assert entry.symbols[symbols.BATCH_SIZE] == "1" and entry.symbols[symbols.SEQ_LEN] != "1"
        assert entry.symbols[symbols.FULL_BATCH_SIZE] == "1"  # one request's cache: the hand-off unit
    (only,) = decode.specializations
    assert only.symbols[symbols.BATCH_SIZE] == "4" and only.symbols[symbols.FULL_BATCH_SIZE] == "4"
    assert only.symbols[symbols.SEQ_LEN] == "1"
    # Custom IO: every KV name carries the prefix on both programs; the vision rows keep theirs.
    for files in (prefill, decode):
        kv = [name for name, _ in files.custom_io if is_kv_name(name)]
        assert kv and all(f"_{PREFIX}" in name for name in kv)
        assert symbols.VISION_EMBEDS in dict(files.custom_io)
    assert set(result.files()) == {
        f"{program}/{name}" for program in programs for name in ("specializations.json", "custom_io.yaml")
    }


def test_kv_prefix_names_are_qefficients():
    assert with_kv_prefix_name("past_key.3", PREFIX) == "past_key.3_vllmKvCache"
    assert (
        with_kv_prefix_name("past_value.0_RetainedState", PREFIX) == "past_value.0_vllmKvCache_RetainedState"
    )
    assert with_kv_prefix_name("vision_embeds_RetainedState", PREFIX) == "vision_embeds_RetainedState"
    # A recurrent layer's states are per-sequence state handed over too (QEfficient renames them).
    assert with_kv_prefix_name("conv_state.1", PREFIX) == "conv_state.1_vllmKvCache"
    assert (
        with_kv_prefix_name("recurrent_state.1_RetainedState", PREFIX)
        == "recurrent_state.1_vllmKvCache_RetainedState"
    )
    assert kv_prefix_of(["input_ids", "conv_state.0_vllmKvCache"]) == PREFIX
    assert is_kv_name("past_key.3_vllmKvCache_RetainedState") and not is_kv_name("past_key.x_y")
    assert kv_prefix_of(["input_ids", "past_key.0_vllmKvCache"]) == PREFIX
    assert kv_prefix_of(["input_ids", "past_key.0"]) is None


def test_deployment_flags_default_to_the_launchers_choices(tmp_path):
    spec = load_spec(_disaggregated(tmp_path))
    prefill = program_options(spec.compile, spec.deployment, LANG_PREFILL)
    decode = program_options(spec.compile, spec.deployment, LANG_DECODE)
    assert (prefill.split_model_io, prefill.allow_mxint8_mdp_io, prefill.split_retained_state_io) == (
        True,
        True,
        False,
    )
    assert (decode.split_model_io, decode.allow_mxint8_mdp_io, decode.split_retained_state_io) == (True,) * 3
    # Dual keeps every flag off unless set: existing programs keep their command lines.
    dual = load_spec(write_spec_data(tmp_path, spec_data(compile={"language": {"split_model_io": True}})))
    lang = program_options(dual.compile, dual.deployment, "lang")
    assert (lang.split_model_io, lang.allow_mxint8_mdp_io, lang.split_retained_state_io) == (
        True,
        False,
        False,
    )
    # An explicit value wins over the deployment's default.
    off = load_spec(_disaggregated(tmp_path, compile={"language": {"split_retained_state_io": False}}))
    assert not program_options(off.compile, off.deployment, LANG_DECODE).split_retained_state_io
    problems = problems_of(_disaggregated(tmp_path, compile={"split_model_io": "yes"}))
    assert problems == ["compile.split_model_io: must be true or false"]


def test_golden_command_lines_name_each_programs_flags():
    spec = load_spec(REPO / "specs" / "llava" / "llava-1.5-7b-hf-disaggregated.yaml")
    lines = dict(line.split(": ", 1) for line in golden_commands(spec).splitlines()[1:])
    assert list(lines) == ["vision", LANG_PREFILL, LANG_DECODE]
    assert "-retained-state" not in lines["vision"].split()
    assert (
        "-allow-mxint8-mdp-io" in lines[LANG_PREFILL]
        and "-split-retained-state-io" not in lines[LANG_PREFILL]
    )
    assert "-allow-mxint8-mdp-io -split-retained-state-io -split-model-io" in lines[LANG_DECODE]
    assert all("-split-model-io" in line for line in lines.values())


def _stand_in_spec(tmp_path, **keys):
    path = write_spec(tmp_path / "spec.yaml")
    data = yaml.safe_load(path.read_text())
    data.update(keys)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_stand_in_compiler_takes_every_disaggregated_program(tmp_path):
    """Three programs compile; the language ones from one graph whose KV names carry the prefix."""
    spec = _stand_in_spec(tmp_path, deployment="disaggregated", kv_cache_prefix=PREFIX)
    export = synthetic_export(tmp_path / "export")
    compiler, record = stand_in(tmp_path)
    outcome = compile_spec(
        spec,
        tmp_path / "out",
        compiler=compiler,
        export_dir=export,
        progress=None,
        status_stream=None,
        env={},
    )
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest == outcome.manifest
    assert manifest["deployment"] == DISAGGREGATED and manifest["kv_cache_prefix"] == PREFIX
    assert sorted(manifest["programs"]) == sorted(["vision", LANG_PREFILL, LANG_DECODE])
    assert manifest["vllm"]["available"] is False
    argv = {call["argv"][-2].split("/")[-2]: call["argv"] for call in calls(record)}
    assert (
        "-split-retained-state-io" in argv[LANG_DECODE]
        and "-split-retained-state-io" not in argv[LANG_PREFILL]
    )
    onnx_files = {manifest["programs"][p]["onnx"] for p in (LANG_PREFILL, LANG_DECODE)}
    (renamed,) = onnx_files
    graph = onnx.load(renamed, load_external_data=False).graph
    names = [value.name for value in (*graph.input, *graph.output)]
    kv = [name for name in names if is_kv_name(name)]
    assert kv and all(f"_{PREFIX}" in name for name in kv), "every KV input and output carries the prefix"
    assert not any(name.startswith(("past_key.", "past_value.")) and PREFIX not in name for name in names)
    prefill = [s["name"] for s in manifest["programs"][LANG_PREFILL]["specializations"]]
    decode = [s["name"] for s in manifest["programs"][LANG_DECODE]["specializations"]]
    assert prefill == ["Prefill-64", "Prefill-128"] and decode == ["Decode"]


@pytest.mark.parametrize(
    "name", ["llava/llava-1.5-7b-hf-disaggregated.yaml", "gemma3/gemma-3-4b-it-disaggregated.yaml"]
)
def test_dry_run_prints_three_command_lines(name, tmp_path, monkeypatch, capsys):
    from qeff_vision.compile import driver

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(driver, "detect_sdk", lambda *args, **kwargs: None)
    assert main(["compile", str(REPO / "specs" / name), "-o", "out", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for program in ("vision", LANG_PREFILL, LANG_DECODE):
        assert f"-network-specialization-config=out/{program}/specializations.json" in out
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_kv_cache_prefix_is_refused_for_the_cross_attention_kind(tmp_path):
    source = REPO / "specs" / "mllama" / "llama-3.2-11b-vision-instruct.yaml"
    data = yaml.safe_load(source.read_text())
    data["config"] = str((source.parent / data["config"]).resolve())
    data.update(deployment="disaggregated", kv_cache_prefix=PREFIX)
    (problem,) = problems_of(write_spec_data(tmp_path, data))
    assert problem.startswith("kv_cache_prefix: Llama 3.2 Vision's cross-attention states are vision-program")
    data.pop("kv_cache_prefix")
    assert load_spec(write_spec_data(tmp_path, data)).deployment.mode == DISAGGREGATED
