"""Golden specs, the specialize/validate CLI, speed, and the no-torch guarantee of the spec package."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from qeff_vision.cli import main
from qeff_vision.compile.golden import check_golden
from qeff_vision.families import all_families
from qeff_vision.spec import find_specs, load_spec
from tests import helpers
from tests.test_spec_helpers import REPO, SPECS, spec_data, write_spec


@pytest.fixture
def specs_copy(tmp_path):
    """A scratch copy of specs/ (configs, golden files and all)."""
    copy = tmp_path / "specs"
    shutil.copytree(SPECS, copy)
    return copy


# ---- the repository's specs ----


def test_repository_specs_match_their_golden_files():
    report = check_golden(SPECS)
    assert report.ok, "\n".join(report.diffs + report.problems)
    assert len(report.specs) >= 2


def test_every_registered_family_has_a_spec_with_golden_files():
    specs = [load_spec(path) for path in find_specs(SPECS)]
    for family in all_families():
        found = [spec for spec in specs if spec.family == family.name]
        assert found, f"family {family.name} has no spec under specs/"
        for spec in found:
            for program in spec.deployment.programs:  # lang, or lang_prefill and lang_decode
                assert (SPECS / "golden" / spec.name / program / "specializations.json").is_file()


def test_spec_discovery_is_recursive_and_skips_golden(specs_copy):
    deep = specs_copy / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "c.yml").write_text("name: c\n")
    found = [path.relative_to(specs_copy).as_posix() for path in find_specs(specs_copy)]
    assert "a/b/c.yml" in found
    assert not [path for path in found if path.startswith("golden/") or path.startswith("configs/")]


def test_specialize_speed_benchmark_prints_every_spec_and_the_verdict(capsys):
    # The 1-second target is measured by benchmarks/specialize_speed.py (a table), not asserted
    # here: a timed assertion fails on a loaded machine without anything being wrong.
    benchmark = helpers.load_benchmark("specialize_speed")
    assert benchmark.main(["--specs", str(SPECS), "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    specs = find_specs(SPECS)
    assert len(lines) == len(specs) + 2  # header, one row per spec, the total
    assert all(int(line.split()[-1]) >= 2 for line in lines[1:-1])  # every spec generated files
    assert lines[-1].startswith(f"{len(specs)} specs: ") and "the 1 s target" in lines[-1]


def test_spec_package_imports_no_torch():
    code = (
        "import sys\n"
        "import qeff_vision.spec as spec, qeff_vision.cli.specialize, qeff_vision.cli.validate\n"
        "import qeff_vision.compile.golden as golden\n"
        "from qeff_vision import api\n"
        "assert golden.check_golden('specs').ok\n"
        "api.specialize('specs/qwen2_5_vl/qwen2_5_vl-3b-instruct.yaml', layout='auto')\n"
        "assert api.validate('specs/qwen2_5_vl/qwen2_5_vl-7b-instruct.yaml') == ([], [])\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnx', 'onnxruntime') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


# ---- the golden check ----


def test_golden_check_fails_on_a_one_character_change(specs_copy, capsys):
    golden = specs_copy / "golden" / "qwen2_5_vl-3b-instruct" / "lang" / "specializations.json"
    text = golden.read_text()
    assert text.count('"ctx_len": "8192"') == 3
    golden.write_text(text.replace('"ctx_len": "8192"', '"ctx_len": "8193"', 1))
    report = check_golden(specs_copy)
    assert not report.ok and not report.problems and len(report.diffs) == 1
    diff = report.diffs[0]
    assert f"--- {golden} (golden)" in diff
    assert '-      "ctx_len": "8193"' in diff and '+      "ctx_len": "8192"' in diff

    assert main(["specialize", "--check", str(specs_copy)]) == 2
    out, err = capsys.readouterr()
    assert "@@" in out and '+      "ctx_len": "8192"' in out
    assert (
        err.strip().splitlines()[-1].startswith("qeff-vision: error: golden check failed with 1 finding(s)")
    )

    assert main(["specialize", "--update-golden", str(specs_copy)]) == 0
    assert golden.read_text() == text
    assert check_golden(specs_copy).ok


def test_golden_check_reports_missing_stale_and_broken(specs_copy):
    shutil.rmtree(specs_copy / "golden" / "qwen2_5_vl-7b-instruct" / "vision")
    (specs_copy / "golden" / "qwen2_5_vl-3b-instruct" / "notes.txt").write_text("x")
    (specs_copy / "golden" / "renamed-spec").mkdir()
    (specs_copy / "broken.yaml").write_text("name: broken\nctx_len: 0\n")
    duplicate = (specs_copy / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct.yaml").read_text()
    (specs_copy / "again.yaml").write_text(duplicate.replace("../configs/", "configs/"))
    report = check_golden(specs_copy)
    problems = "\n".join(report.problems)
    assert "qwen2_5_vl-7b-instruct/vision/specializations.json: missing golden file" in problems
    assert "notes.txt: stale golden" in problems
    assert "renamed-spec: stale golden (no spec has this name)" in problems
    assert "broken.yaml: ctx_len: must be a positive integer" in problems
    assert "name 'qwen2_5_vl-3b-instruct' is also used by" in problems

    (specs_copy / "broken.yaml").unlink()
    (specs_copy / "again.yaml").unlink()
    report = check_golden(specs_copy, update=True)
    assert not report.problems and not report.diffs
    assert not (specs_copy / "golden" / "renamed-spec").exists()
    assert check_golden(specs_copy).ok


# ---- API and CLI ----


def test_api_verbs(tmp_path):
    from qeff_vision import api

    result = api.specialize(SPECS / "qwen2_5_vl" / "qwen2_5_vl-7b-instruct.yaml", tmp_path, layout="flat")
    assert result.language.layout == "flat" and (tmp_path / "lang" / "custom_io.yaml").is_file()
    problems, warnings = api.validate(write_spec(tmp_path, spec_data(ctx_len=0)))
    assert problems == ["ctx_len: must be a positive integer (got 0)"] and warnings == []
    assert api.check_golden(SPECS).ok


def test_specialize_writes_files_and_prints_the_table(tmp_path, capsys):
    spec = SPECS / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct.yaml"
    assert main(["specialize", str(spec), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Prefill-128" in out and "chunks@512" in out
    golden = SPECS / "golden" / "qwen2_5_vl-3b-instruct"
    for relative in (
        "vision/specializations.json",
        "vision/custom_io.yaml",
        "lang/specializations.json",
        "lang/custom_io.yaml",
    ):
        assert (tmp_path / "out" / relative).read_text() == (golden / relative).read_text()


def test_specialize_layout_override(tmp_path, capsys):
    spec = SPECS / "qwen2_5_vl" / "qwen2_5_vl-3b-instruct.yaml"
    assert main(["specialize", str(spec), "--layout", "named", "-o", str(tmp_path)]) == 0
    assert '"name": "Decode"' in (tmp_path / "lang" / "specializations.json").read_text()


def test_specialize_bad_spec_prints_one_line_and_writes_nothing(tmp_path, capsys):
    path = write_spec(tmp_path, spec_data(ctx_len=100, vision={"vision_size": 0}))
    assert main(["specialize", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"qeff-vision: error: {path}: ")
    assert "vision.vision_size:" in err and "prefill.seq_lens[0]:" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["specialize"],
        ["specialize", "a.yaml", "b.yaml"],
        ["specialize", "--check", "--update-golden"],
        ["specialize", "--check", "specs", "-o", "x"],
    ],
)
def test_specialize_usage_errors(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("qeff-vision: error:")


def test_validate_reports_every_problem_of_every_file(tmp_path, capsys):
    good = write_spec(tmp_path, spec_data(), "good.yaml")
    bad = write_spec(
        tmp_path, spec_data(batch_size=-1, prefill={"seq_lens": [64, 64]}, colour="red"), "bad.yaml"
    )
    worse = write_spec(tmp_path, "ctx_len: [\n", "worse.yaml")
    assert main(["validate", str(good), str(bad), str(worse)]) == 2
    out, err = capsys.readouterr()
    printed = out.splitlines()
    assert printed[0] == f"{good}: ok"  # then the good spec's attention figures, nothing of the others
    assert printed[1:] and all(
        line.startswith(f"{good}: ") and "attention scores" in line for line in printed[1:]
    )
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith(f"{bad}: ")] == [
        f"{bad}: colour: unknown key; allowed: name, model, revision, family, config, dtype, batch_size, "
        "full_batch_size, ctx_len, prefill, vision, specialization_layout, compile, deployment, "
        "kv_cache_prefix, retain_full_kv, weights, task",
        f"{bad}: batch_size: must be a positive integer (got -1)",
        f"{bad}: prefill.seq_lens[1]: duplicate bucket 64 (also prefill.seq_lens[0])",
    ]
    assert any(line.startswith(f"{worse}: YAML syntax:") for line in lines)
    assert lines[-1] == "qeff-vision: error: 4 problem(s) in 2 of 3 spec file(s)"


def test_validate_directories_and_warnings(tmp_path, capsys):
    assert main(["validate", str(SPECS)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == len(find_specs(SPECS))
    # Every specialization of every committed spec shows its attention scores (issue 54).
    for path in find_specs(SPECS):
        count = sum(len(files.specializations) for files in _programs(path))
        figures = [
            line for line in out.splitlines() if line.startswith(f"{path}: ") and " per block (" in line
        ]
        assert len(figures) == count, path
    write_spec(tmp_path, spec_data(vision={"images": [{"height": 1080, "width": 1920}], "vision_size": 512}))
    assert main(["validate", str(tmp_path)]) == 0
    assert "warning: vision.images[0]: 1080x1920 becomes 2691 image tokens" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "empty-dir-that-does-not-exist")]) == 2


def _programs(path):
    from qeff_vision.spec import build_specializations, load_spec

    generated = build_specializations(load_spec(path))
    return generated.programs or (generated.vision, generated.language)
