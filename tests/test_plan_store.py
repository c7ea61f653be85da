"""A precision plan is calibrated once per (graph, weights, calibration inputs) (issue 48).

A second compile that needs the same program (another spec: other compiler options, another
OUT) reuses the plan the first one calibrated, through the store under the user's cache
directory: no calibration stage in its log, the same plan file. A changed calibration input (a
prompt) calibrates again; ``QEFF_VISION_CACHE=off`` turns the store off.
"""

from __future__ import annotations

import yaml

from qeff_vision.cli import main
from tests.compile_fixtures import stand_in
from tests.test_calibration_fit import _small_spec

FAMILY = "qwen2_5_vl"
STAGE = "calibrating device precision"


def _compile(spec, out, export, compiler, capsys) -> str:
    code = main(["compile", str(spec), "-o", str(out), "--export", str(export), "--compiler", str(compiler)])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def _variant(spec, tmp_path, name: str, **compile_options):
    data = yaml.safe_load(spec.read_text())
    data["name"] = f"{data.get('name', 'spec')}-{name}"
    data.setdefault("compile", {}).update(compile_options)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_another_spec_needing_the_same_program_reuses_its_plan(
    tiny_checkpoint, exported, tmp_path, capsys, monkeypatch
):
    spec, _ = _small_spec(FAMILY, tiny_checkpoint(FAMILY), tmp_path, "auto")
    export = exported(FAMILY)
    compiler, _ = stand_in(tmp_path)
    first = _compile(spec, tmp_path / "out-a", export, compiler, capsys)
    assert STAGE in first
    plans = {
        p.relative_to(tmp_path / "out-a"): p.read_text()
        for p in (tmp_path / "out-a").rglob("node_precision.yaml")
    }
    assert plans  # the rotary angle chains at least

    # The same spec into the same OUT again: the plan recorded there, no calibration stage.
    again = _compile(spec, tmp_path / "out-a", export, compiler, capsys)
    assert STAGE not in again, again

    other = _variant(spec, tmp_path, "cores", language={"num_cores": 8})
    second = _compile(other, tmp_path / "out-b", export, compiler, capsys)
    assert STAGE not in second, second
    assert {p: (tmp_path / "out-b" / p).read_text() for p in plans} == plans

    # A changed calibration input calibrates again; so does a compile with the store off.
    prompted = _variant(spec, tmp_path, "prompt", calibration={"prompts": ["A different prompt."]})
    assert STAGE in _compile(prompted, tmp_path / "out-c", export, compiler, capsys)
    monkeypatch.setenv("QEFF_VISION_CACHE", "off")
    assert STAGE in _compile(other, tmp_path / "out-d", export, compiler, capsys)


def test_an_export_outside_out_is_hashed_once_for_every_out(tmp_path, monkeypatch):
    """A compile into another OUT of the same ``--export`` finds its hashes in the user's cache.

    At full depth that is 15 GB not read again (56 s off disk); a changed file is hashed again,
    files inside OUT stay in OUT's own memo, and with the store off nothing is shared.
    """
    import os

    from qeff_vision.compile import cache

    monkeypatch.setenv("QEFF_VISION_CACHE", str(tmp_path / "cache"))
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx.data").write_bytes(b"weights" * 1000)
    inside = tmp_path / "out-a" / "lang"
    inside.mkdir(parents=True)
    (inside / "plan.yaml").write_text("plan")

    first = cache.ContentHasher(tmp_path / "out-a" / cache.HASH_MEMO_FILE, root=tmp_path / "out-a")
    digest = first.file(export / "model.onnx.data")
    first.file(inside / "plan.yaml")
    first.save()
    shared = cache.shared_memo_path()
    assert shared is not None and shared.is_file()
    assert str(inside / "plan.yaml") not in shared.read_text()  # OUT's files stay in OUT's memo

    def refused(*args, **kwargs):
        raise AssertionError("hashed again")

    monkeypatch.setattr(cache, "sha256_file", refused)
    second = cache.ContentHasher(tmp_path / "out-b" / cache.HASH_MEMO_FILE, root=tmp_path / "out-b")
    assert second.file(export / "model.onnx.data") == digest
    monkeypatch.undo()

    monkeypatch.setenv("QEFF_VISION_CACHE", str(tmp_path / "cache"))
    (export / "model.onnx.data").write_bytes(b"changed" * 1000)  # same size: the mtime tells
    stat = (export / "model.onnx.data").stat()
    os.utime(export / "model.onnx.data", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    third = cache.ContentHasher(tmp_path / "out-c" / cache.HASH_MEMO_FILE, root=tmp_path / "out-c")
    assert third.file(export / "model.onnx.data") != digest

    monkeypatch.setenv("QEFF_VISION_CACHE", "off")
    assert cache.shared_memo_path() is None
    off = cache.ContentHasher(tmp_path / "out-d" / cache.HASH_MEMO_FILE, root=tmp_path / "out-d")
    off.file(export / "model.onnx.data")
    off.save()
    assert off.shared_path is None
