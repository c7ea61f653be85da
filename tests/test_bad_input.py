"""The bad-input contract over every command (issue 37): one line, exit 2, nothing left or changed.

Every case runs a command as a user would and asserts the same four things: exit code 2 (130
after Ctrl-C), exactly one line on stderr naming the offending path or value, no traceback, and
the output path exactly as it was (absent, or the same tree byte for byte: :func:`tree_state`).
The cases are grouped by the issue's classes, one registry each:

1. output paths the operating system refuses (a parent that is a file, ``/proc``, a parent that
   refuses new entries, a missing ``model.onnx.data``);
2. corrupt input that reaches a library (safetensors, images, prompts, tokenizer files);
3. a failed compile (the compiler fails, hangs, crashes, writes no program), over no OUT and
   over a valid one with ``--force``;
4. unbounded work (a spec nested 100,000 levels deep, a spec of megabytes);
5. ``specialize --update-golden`` with a broken spec;

plus Ctrl-C at every stage (export, calibration, compilers), which must end with "interrupted"
and 130 whatever the timing: each run waits for a marker (a progress line, the stand-in's
"hanging" record) instead of sleeping.

Nothing here relies on the process not being root: refused writes are a path below a regular
file, a path under ``/proc`` (refused for root too) or a monkeypatched refusal in-process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from qeff_vision.cli import main
from tests import helpers
from tests.compile_fixtures import REPO, hanging, stand_in, synthetic_export, tree_state, write_spec

FAMILY = "llava"  # a placeholder text users could type: "<image>"


@pytest.fixture(autouse=True)
def temporary_directory(tmp_path, monkeypatch):
    """Where failed compiles keep their logs: per test, in-process and in subprocesses."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.setenv("TMPDIR", str(directory))
    return directory


def one_error_line(code: int, err: str, needle: str, expected_code: int = 2) -> str:
    """The contract's stderr: the exit code, one ``qeff-vision:`` line naming ``needle``, no traceback."""
    assert "Traceback" not in err, err
    assert code == expected_code, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qeff-vision: "), err
    assert needle in lines[0], (needle, err)
    return lines[0]


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(arg) for arg in args])
    return code, capsys.readouterr().err


# ---- shared inputs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_checkpoint):
    """A tiny checkpoint and its spec, a stand-in SDK and a synthetic export (compile cases)."""
    root = tmp_path_factory.mktemp("bad-input")
    model = tiny_checkpoint(FAMILY)
    spec = root / "spec.yaml"
    data = {
        "name": "bad-input",
        "model": str(model),
        "ctx_len": 256,
        "prefill": {"seq_lens": [64]},
        "vision": {"images": [{"height": 112, "width": 112}], "max_images": 1, "vision_size": "chunk"},
    }
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    synthetic_spec = write_spec(root / "synthetic" / "spec.yaml")
    export = synthetic_export(root / "synthetic" / "export")
    compiler, _ = stand_in(root / "synthetic")
    return {"model": model, "spec": spec, "root": root, "synthetic_spec": synthetic_spec}, export, compiler


@pytest.fixture(scope="module")
def compiled(inputs, tmp_path_factory):
    """OUT of ``compile --backend onnxruntime`` holding its own export (for ``run``)."""
    paths, _, _ = inputs
    out = tmp_path_factory.mktemp("bad-input-compiled") / "out"
    from qeff_vision import api

    api.compile(paths["spec"], out, backend="onnxruntime", progress=None, status_stream=None)
    return out


def copy_of(out: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "artifacts"
    shutil.copytree(out, copy, symlinks=True)
    return copy


# ---- class 1: output paths ---------------------------------------------------------------------


def _below_a_file(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("a regular file\n")
    return tmp_path / "afile" / "out", "afile is not a directory"


def _is_a_file(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("a regular file\n")
    return tmp_path / "afile", "afile"


def _under_proc(tmp_path, monkeypatch):
    return Path("/proc/qeff-vision-bad-input/out"), "/proc"  # refused for root too


def _refusing_parent(tmp_path, monkeypatch):
    # A read-only directory, as every user sees one (root ignores mode bits): creating an entry
    # in it fails with EACCES. Everything else (the staging of other directories) still works.
    parent = tmp_path / "read-only"
    parent.mkdir()
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        if Path(kwargs.get("dir") or "") == parent:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return parent / "out", "Permission denied"


OUTPUT_PATHS = {
    "below-a-file": _below_a_file,
    "is-a-file": _is_a_file,
    "under-proc": _under_proc,
    "refusing-parent": _refusing_parent,
}


def _command(name: str, paths: dict, export: Path, compiler: Path, out: Path) -> list:
    return {
        "tiny": ["tiny", FAMILY, "-o", out],
        "export": ["export", paths["model"], "-o", out, "-q"],
        "specialize": ["specialize", paths["spec"], "-o", out],
        "compile": [
            "compile",
            paths["synthetic_spec"],
            "-o",
            out,
            "--export",
            export,
            "--compiler",
            compiler,
            "-q",
        ],
    }[name]


@pytest.mark.parametrize("where", list(OUTPUT_PATHS))
@pytest.mark.parametrize("command", ["tiny", "export", "specialize", "compile"])
def test_output_path_refused(command, where, inputs, tmp_path, monkeypatch, capsys):
    paths, export, compiler = inputs
    out, needle = OUTPUT_PATHS[where](tmp_path, monkeypatch)
    before = tree_state(out) if out.parent.is_dir() else None
    code, err = cli(capsys, *_command(command, paths, export, compiler, out))
    one_error_line(code, err, needle)
    assert str(out) in err or str(out.name) in err
    assert (tree_state(out) if out.parent.is_dir() else None) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging left beside OUT"


def test_missing_external_data(inputs, exported, compiled, tmp_path, capsys):
    """An export whose model.onnx.data is gone: compile --export, and run on an OUT holding one."""
    paths, _, _ = inputs
    broken = tmp_path / "export"
    shutil.copytree(exported(FAMILY), broken)
    (broken / "lang" / "model.onnx.data").unlink()
    out = tmp_path / "out"
    code, err = cli(
        capsys, "compile", paths["spec"], "-o", out, "--export", broken, "--backend", "onnxruntime", "-q"
    )
    one_error_line(code, err, str(broken / "lang" / "model.onnx.data"))
    assert tree_state(out) is None
    artifacts = copy_of(compiled, tmp_path)
    (artifacts / "export" / "lang" / "model.onnx.data").unlink()
    before = tree_state(artifacts)
    image = tmp_path / "ok.png"
    helpers.image(112, 112).save(image)
    code, err = cli(capsys, "run", artifacts, "--image", image, "--prompt", "hi", "--max-new-tokens", 2)
    one_error_line(code, err, "model.onnx")
    assert tree_state(artifacts) == before


# ---- class 2: corrupt input reaching a library ---------------------------------------------------


def _bomb_png(path: Path) -> Path:
    """A valid PNG header claiming 30000 x 30000 pixels (900 megapixels), and almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
    return path


@dataclass
class RunCase:
    """A ``run`` on a copy of the compiled OUT: how to damage it or what to pass, what the line names."""

    prompt: str = "Describe it."
    bomb: bool = False
    damage: str | None = None  # files under OUT/model to delete
    needle: str = ""


RUN_CASES = {
    # PIL refuses the header (DecompressionBombError) before decoding anything.
    "image-bomb": RunCase(bomb=True, needle="bomb.png"),
    # What a shell passes for `--prompt $'\xff\xfe'`: Python decodes argv with surrogateescape.
    "invalid-utf8-prompt": RunCase(prompt="bad \udcff\udcfe bytes", needle="byte 0xff"),
    # Not valid input: transformers' own processor refuses it (it would count 2 placeholders for
    # 1 image), so there is no reference to be identical to. Images come with --image; the text
    # holding the placeholder is named in the one line.
    "placeholder-in-prompt": RunCase(prompt="What is <image> here?", needle="'<image>'"),
    # Without tokenizer files generation could only print ids: refused before anything runs.
    "no-tokenizer-files": RunCase(damage="tokenizer*", needle="model"),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_run_corrupt_input(case, compiled, tmp_path, capsys):
    spec = RUN_CASES[case]
    artifacts = copy_of(compiled, tmp_path)
    if spec.damage:
        for path in (artifacts / "model").glob(spec.damage):
            path.unlink()
    before = tree_state(artifacts)
    image = _bomb_png(tmp_path / "bomb.png") if spec.bomb else tmp_path / "ok.png"
    if not spec.bomb:
        helpers.image(112, 112).save(image)
    code, err = cli(
        capsys, "run", artifacts, "--image", image, "--prompt", spec.prompt, "--max-new-tokens", 2
    )
    one_error_line(code, err, spec.needle)
    assert tree_state(artifacts) == before


def test_run_without_tokenizer_files_via_requests(compiled, tmp_path, capsys):
    artifacts = copy_of(compiled, tmp_path)
    for path in (artifacts / "model").glob("tokenizer*"):
        path.unlink()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "hi", "images": []}) + "\n")
    code, err = cli(capsys, "run", artifacts, "--requests", requests)
    one_error_line(code, err, "model")


@pytest.fixture
def random_weights(inputs, tmp_path):
    """A copy of the tiny checkpoint whose .safetensors is random bytes (a header of petabytes)."""
    paths, _, _ = inputs
    model = tmp_path / "model"
    shutil.copytree(paths["model"], model)
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    spec = tmp_path / "spec.yaml"
    data = yaml.safe_load(paths["spec"].read_text())
    spec.write_text(yaml.safe_dump({**data, "model": str(model)}, sort_keys=False))
    return model, spec


@pytest.mark.parametrize("command", ["export", "compile"])
def test_random_bytes_in_safetensors(command, random_weights, tmp_path, capsys):
    model, spec = random_weights
    out = tmp_path / "out"
    if command == "export":
        code, err = cli(capsys, "export", model, "-o", out, "-q")
    else:  # compile exports into OUT first
        code, err = cli(capsys, "compile", spec, "-o", out, "--backend", "onnxruntime", "-q")
    one_error_line(code, err, str(model / "model.safetensors"))
    assert tree_state(out) is None and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("command", ["validate", "specialize", "compile"])
def test_spec_with_invalid_utf8(command, inputs, tmp_path, capsys):
    paths, export, compiler = inputs
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(paths["spec"].read_bytes() + b"# \xff\xfe\n")
    out = tmp_path / "out"
    args = {"validate": [], "specialize": ["-o", out], "compile": ["-o", out, "--export", export, "-q"]}[
        command
    ]
    code, err = cli(capsys, command, spec, *args)
    one_error_line(code, err, str(spec))
    assert tree_state(out) is None


# ---- class 3: a failed compile -----------------------------------------------------------------

# stand-in mode -> (extra options, what the error line says)
COMPILER_FAILURES = {
    "fail": ([], "compiler exited with code 1"),
    "hang": (["--timeout", "1"], "timed out after 1 s and was killed"),
    "signal": ([], "compiler exited with code -9"),
    "no-program": ([], "exited 0 but wrote no programqpc.bin"),
}


@pytest.mark.parametrize("previous", ["none", "valid"])
@pytest.mark.parametrize("mode", list(COMPILER_FAILURES))
def test_failed_compile_leaves_out_as_it_was(mode, previous, tmp_path, temporary_directory, capsys):
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export")
    # A new OUT under parents that do not exist yet: the failed compile removes those too.
    out = tmp_path / "out" if previous == "valid" else tmp_path / "new" / "parents" / "out"
    if previous == "valid":
        good, _ = stand_in(tmp_path)
        code, err = cli(capsys, "compile", spec, "-o", out, "--export", export, "--compiler", good, "-q")
        assert code == 0, err
    before = tree_state(out)
    compiler, _ = stand_in(tmp_path, mode=mode)
    options, what = COMPILER_FAILURES[mode]
    force = ["--force"] if previous == "valid" else []  # over a valid OUT: a failing recompile
    args = ["compile", spec, "-o", out, "--export", export, "--compiler", compiler, "-q", *options, *force]
    code, err = cli(capsys, *args)
    line = one_error_line(code, err, what)
    # OUT byte for byte as it was: its compile.log files still describe the programs beside them.
    assert tree_state(out) == before and (previous == "valid" or not (tmp_path / "new").exists())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "staging left beside OUT"
    # The failed compiler's log is kept outside OUT, where the line says.
    log = Path(line.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.is_relative_to(temporary_directory) and not log.is_relative_to(out)
    assert log.read_text().startswith("$ ")


# ---- class 4: unbounded work ---------------------------------------------------------------------


def _deep(tmp_path: Path) -> tuple[Path, str]:
    spec = tmp_path / "deep.yaml"
    spec.write_text("name: deep\nvision: " + "[" * 100_000 + "]" * 100_000 + "\n")
    return spec, "nests more than 32 levels"


def _deep_block(tmp_path: Path) -> tuple[Path, str]:
    spec = tmp_path / "deep-block.yaml"
    spec.write_text("name: deep\n" + "".join(" " * i + f"k{i}:\n" for i in range(1000)))
    return spec, "nests more than 32 levels"


def _huge(tmp_path: Path) -> tuple[Path, str]:
    spec = tmp_path / "huge.yaml"
    spec.write_text("name: huge\n" + "# padding\n" * 200_000)
    return spec, "larger than 1,048,576 bytes"


UNBOUNDED = {"deep-flow": _deep, "deep-block": _deep_block, "huge": _huge}


@pytest.mark.parametrize("shape", list(UNBOUNDED))
@pytest.mark.parametrize("command", ["validate", "specialize", "compile"])
def test_unbounded_spec_is_refused_before_parsing(command, shape, inputs, tmp_path):
    """Answered at once: a subprocess with a generous limit only guards against a hang."""
    _, export, _ = inputs
    spec, needle = UNBOUNDED[shape](tmp_path)
    out = tmp_path / "out"
    args = {"validate": [], "specialize": ["-o", out], "compile": ["-o", out, "--export", export, "-q"]}[
        command
    ]
    run = subprocess.run(
        [sys.executable, "-m", "qeff_vision", command, str(spec), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(run.returncode, run.stderr, needle)
    assert str(spec) in run.stderr and tree_state(out) is None


# ---- class 5: --update-golden with a broken spec -----------------------------------------------------


def test_update_golden_with_a_broken_spec_changes_nothing(tmp_path, capsys):
    """A batch command: it reports every spec's finding, then one error line; no golden file changes."""
    specs = tmp_path / "specs"
    for name in ("llava-1.5-7b-hf.yaml", "llava-1.5-7b-hf-cb.yaml"):
        source = REPO / "specs" / "llava" / name
        text = source.read_text().replace("../configs/", str(REPO / "specs" / "configs") + "/")
        (specs / "llava").mkdir(parents=True, exist_ok=True)
        (specs / "llava" / name).write_text(text)
    assert main(["specialize", "--update-golden", str(specs)]) == 0
    capsys.readouterr()
    before = tree_state(specs)
    broken = specs / "llava" / "llava-1.5-7b-hf.yaml"
    broken.write_text(broken.read_text().replace("ctx_len:", "ctx_len: [", 1))
    state = tree_state(specs)
    code, err = cli(capsys, "specialize", "--update-golden", specs)
    assert code == 2 and "Traceback" not in err
    assert str(broken) in err and err.splitlines()[-1].endswith("no golden file was changed")
    assert tree_state(specs) == state and state.keys() == before.keys()  # the broken spec's golden stays


# ---- Ctrl-C at every stage --------------------------------------------------------------------------


def _interrupt_at(command: list, marker, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``command``, send SIGINT once ``marker(stderr so far)`` holds, and wait for the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qeff_vision", *map(str, command)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    while not marker("".join(seen)):
        line = process.stderr.readline()
        assert line, f"the command ended before the marker: {''.join(seen)}"
        seen.append(line)
    process.send_signal(signal.SIGINT)
    rest = process.stderr.read()
    process.wait(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, "", "".join(seen) + rest)


def _stage_line(text: str):
    return lambda err: f"[qeff-vision] {text}" in err


INTERRUPT_STAGES = {
    "export": ("export", _stage_line("export language")),
    "compile-export": ("compile", _stage_line("export language")),
    "calibration": ("compile", _stage_line("calibrating device precision")),
}


@pytest.mark.parametrize("stage", list(INTERRUPT_STAGES))
def test_ctrl_c_at_every_stage(stage, inputs, tmp_path, temporary_directory):
    paths, _, _ = inputs
    command, marker = INTERRUPT_STAGES[stage]
    out = tmp_path / "out"
    if command == "export":
        args = ["export", paths["model"], "-o", out]
    else:
        args = ["compile", paths["spec"], "-o", out, "--backend", "onnxruntime"]
    result = _interrupt_at(args, marker, tmp_path)
    assert result.returncode == 130, result.stderr  # not -2: the interpreter must not re-kill itself
    assert result.stderr.splitlines()[-1] == "qeff-vision: interrupted" and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("qeff-vision:")]
    assert errors == ["qeff-vision: interrupted"]
    assert tree_state(out) is None and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert not list(temporary_directory.glob("qeff-vision-*"))


def test_ctrl_c_while_the_compilers_run(tmp_path, temporary_directory):
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export")
    compiler, record = stand_in(tmp_path, mode="hang")
    out = tmp_path / "out"
    command = ["compile", spec, "-o", out, "--export", export, "--compiler", compiler, "-q"]
    process = subprocess.Popen(
        [sys.executable, "-m", "qeff_vision", *map(str, command)], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    while hanging(record) < 2:  # both stand-ins wrote their partial output and said so
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    one_error_line(process.returncode, err, "interrupted", expected_code=130)
    assert tree_state(out) is None and not list(temporary_directory.glob("qeff-vision-*"))


# ---- the staging every output goes through ----------------------------------------------------------


@pytest.mark.parametrize("fails", [True, False])
def test_staged_directory_over_an_existing_output(tmp_path, fails):
    """Files are hard links (replaced, never written into); a shared directory is used in place."""
    from qeff_vision.errors import UserError
    from qeff_vision.fsutil import atomic_write_text, staged_directory

    final = tmp_path / "out"
    (final / "export").mkdir(parents=True)
    (final / "export" / "model.onnx").write_text("graph\n")
    (final / "lang").mkdir()
    (final / "lang" / "compile.log").write_text("the log of the program beside it\n")
    before = tree_state(final)
    with pytest.raises(UserError) if fails else contextlib.nullcontext():
        with staged_directory(final, start_from_final=True, shared=("export",)) as staging:
            assert (staging / "export").is_symlink() and (
                staging / "lang" / "compile.log"
            ).stat().st_nlink == 2
            atomic_write_text(staging / "lang" / "compile.log", "a new log\n")  # replaces the link
            (staging / "export" / "single.onnx").write_text("derived\n")  # through the symlink
            assert tree_state(final)["lang/compile.log"] == before["lang/compile.log"]
            if fails:
                raise UserError("the compiler failed")
    if fails:
        assert tree_state(final) == before  # the derived file added in place is gone too
    else:
        assert not (final / "export").is_symlink() and (final / "export" / "single.onnx").is_file()
        assert (final / "lang" / "compile.log").read_text() == "a new log\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tmp"]
