"""Truncated external data and a full disk (issue 53): one line, exit 2, nothing left or changed.

1. A ``model.onnx.data`` shorter than its graph says (a copy cut short), or a graph whose
   external-data entry claims more bytes than its shape needs, is refused where graphs are read
   (:func:`qeff_vision.graph_file.check_external_data`): ``compile --export`` with either backend,
   and ``run`` on an OUT holding such an export. The line names the file, the tensor and the sizes.
2. Every command that writes (``tiny``, ``export``, ``specialize``, ``compile``) on a full disk:
   a real one, a small tmpfs filled to the last byte or to its last few KiB (mounting needs root;
   without it those cases skip), and a writer failure injected in-process (every user).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import onnx
import pytest

from qeff_vision.fsutil import disk_full
from tests import helpers
from tests.compile_fixtures import stand_in, synthetic_export, tree_state, write_spec
from tests.test_bad_input import FAMILY, cli, compiled, copy_of, inputs, one_error_line  # noqa: F401, F811

# ---- truncated / oversized external data ------------------------------------------------------------


def _truncate(path: Path, keep: int) -> int:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(keep)
    return size


def _first_external(graph: Path) -> onnx.TensorProto:
    model = onnx.load(str(graph), load_external_data=False)
    return next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)


def _oversize_entry(graph: Path) -> str:
    """Rewrite the graph so its first external tensor claims twice the bytes its shape needs."""
    model = onnx.load(str(graph), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "length":
            entry.value = str(int(entry.value) * 2)
    onnx.save_model(model, str(graph))
    return tensor.name


@pytest.mark.parametrize("program", ["vision", "lang"])
@pytest.mark.parametrize("damage", ["truncated", "oversized-entry"])
@pytest.mark.parametrize("backend", ["onnxruntime", "stand-in"])
def test_damaged_external_data_under_compile_export(
    backend,
    damage,
    program,
    inputs,  # noqa: F811
    exported,
    tmp_path,
    capsys,
):
    paths, _, _ = inputs
    broken = tmp_path / "export"
    shutil.copytree(exported(FAMILY), broken)
    data = broken / program / "model.onnx.data"
    if damage == "truncated":
        tensor = _first_external(broken / program / "model.onnx")
        offsets = {e.key: int(e.value) for e in tensor.external_data if e.key in ("offset", "length")}
        size = _truncate(data, offsets.get("offset", 0) + offsets["length"] // 2)  # cut inside the tensor
        needles = [str(data), repr(tensor.name), "truncated", f"{data.stat().st_size:,} bytes"]
        assert size > data.stat().st_size
    else:
        name = _oversize_entry(broken / program / "model.onnx")
        needles = [str(data), repr(name), "do not match"]
    out = tmp_path / "out"
    if backend == "onnxruntime":
        options = ["--backend", "onnxruntime"]
    else:
        compiler, _ = stand_in(tmp_path)
        options = ["--compiler", compiler]
    code, err = cli(capsys, "compile", paths["spec"], "-o", out, "--export", broken, "-q", *options)
    line = one_error_line(code, err, needles[0])
    assert all(needle in line for needle in needles), line
    assert (
        tree_state(out) is None and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )


def test_truncated_external_data_under_run(compiled, tmp_path, capsys):  # noqa: F811
    artifacts = copy_of(compiled, tmp_path)
    data = artifacts / "export" / "lang" / "model.onnx.data"
    data.unlink()  # a copy of the linked file, cut short: the fixture's OUT stays whole
    shutil.copyfile(compiled / "export" / "lang" / "model.onnx.data", data)
    _truncate(data, data.stat().st_size // 3)
    before = tree_state(artifacts)
    image = tmp_path / "ok.png"
    helpers.image(112, 112).save(image)
    code, err = cli(capsys, "run", artifacts, "--image", image, "--prompt", "hi", "--max-new-tokens", 2)
    line = one_error_line(code, err, str(data))
    assert "truncated: tensor" in line and "but the file holds" in line
    assert tree_state(artifacts) == before


def test_the_check_reads_no_data_and_accepts_trailing_bytes(exported, tmp_path):
    """A data file longer than its references (appended to) is fine; only sizes are read."""
    from qeff_vision.graph_file import load_graph

    export = tmp_path / "export"
    shutil.copytree(exported(FAMILY), export)
    with open(export / "lang" / "model.onnx.data", "ab") as handle:
        handle.write(b"\0" * 4096)
    assert load_graph(export / "lang" / "model.onnx").graph.initializer


# ---- a full disk, for every command that writes -------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs under ``tmp_path`` (root only; skipped when the mount is refused)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); see the injected cases"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path, leave: int) -> None:
    """Write a filler until the disk is full, then give back ``leave`` bytes."""
    with open(mount / "filler", "wb", buffering=0) as handle:  # unbuffered: close has nothing to flush
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    if leave:
        _truncate(mount / "filler", (mount / "filler").stat().st_size - leave)


def _writing_command(command: str, paths: dict, tmp_path: Path, out: Path) -> list:
    if command == "compile":
        spec = write_spec(tmp_path / "spec.yaml")
        export = synthetic_export(tmp_path / "synthetic-export")
        compiler, _ = stand_in(tmp_path)
        return ["compile", spec, "-o", out, "--export", export, "--compiler", compiler, "-q"]
    return {
        "tiny": ["tiny", FAMILY, "-o", out],
        "export": ["export", paths["model"], "-o", out, "-q"],
        "specialize": ["specialize", paths["spec"], "-o", out],
    }[command]


# left free after filling: nothing, or enough for the small files (config, JSON) and not the weights
LEFT = {"full": 0, "nearly-full": 48 * 1024}


@pytest.mark.parametrize("left", list(LEFT))
@pytest.mark.parametrize("command", ["tiny", "export", "specialize", "compile"])
def test_full_disk(command, left, small_disk, inputs, tmp_path, capsys):  # noqa: F811
    paths, _, _ = inputs
    out = small_disk / "out"
    args = _writing_command(command, paths, tmp_path, out)
    _fill(small_disk, LEFT[left])
    code, err = cli(capsys, *args)
    if code == 0:  # what the command writes fits in what was left (specialize's few JSON files)
        assert left == "nearly-full" and command == "specialize", err
        return
    line = one_error_line(code, err, str(out))
    assert "no space left on device" in line.lower(), line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"], "staging left on the full disk"


def test_full_disk_over_an_existing_output(small_disk, inputs, tmp_path, capsys):  # noqa: F811
    """``tiny --force`` over a checkpoint on a disk that filled since: the old one stays as it was."""
    out = small_disk / "out"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "config.json").write_text("{}\n")
    before = tree_state(out)
    _fill(small_disk, 0)
    code, err = cli(capsys, "tiny", FAMILY, "-o", out, "--force")
    one_error_line(code, err, str(out))
    assert tree_state(out) == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out"]


def _safetensors_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _protobuf_full(*args, **kwargs):
    raise ValueError("could not write the model: [Errno 28] No space left on device")


INJECTED = {
    # what safetensors raises from Rust (not an OSError): the `tiny` traceback of the issue
    "tiny": ("transformers.modeling_utils.safe_save_file", _safetensors_full),
    # an error type that only carries the text, raised by an ONNX writer deep in export
    "export": ("onnx.save_model", _protobuf_full),
}


@pytest.mark.parametrize("command", list(INJECTED))
def test_injected_writer_failure(command, inputs, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Every user (no mount needed): the writer fails as a full disk makes it fail."""
    paths, _, _ = inputs
    target, failure = INJECTED[command]
    module, _, name = target.rpartition(".")
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, failure)
    out = tmp_path / "new" / "out"
    code, err = cli(capsys, *_writing_command(command, paths, tmp_path, out))
    line = one_error_line(code, err, str(out))
    assert "no space left on device" in line
    assert not (tmp_path / "new").exists()


def test_disk_full_is_told_from_other_errors():
    import errno

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(ValueError("bad shape"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("export failed") from inner
    except RuntimeError as outer:
        assert disk_full(outer)
