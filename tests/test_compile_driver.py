"""The compile driver against the stand-in compiler and synthetic graphs: cache, failures, logs, lock."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qeff_vision.cli import main
from qeff_vision.compile import cache, sdk
from qeff_vision.compile.driver import CompileFailed, compile_spec
from qeff_vision.compile.vllm_handoff import QPC_PLACEHOLDER, golden_serve_text, serve_sections, serve_text
from qeff_vision.errors import SpecError, UserError
from qeff_vision.spec import load_spec
from tests.compile_fixtures import REPO, calls, hanging, stand_in, synthetic_export, tree_state, write_spec
from tests.serve_form_rules import launcher_args, launcher_override


@pytest.fixture(autouse=True)
def temporary_directory(tmp_path, monkeypatch):
    """The temporary directory failed compiles keep their logs in, per test (not /tmp)."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.setenv("TMPDIR", str(directory))  # and in subprocesses
    return directory


@pytest.fixture
def setup(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export")
    return spec, export, tmp_path / "out"


def run(spec, out, export, compiler, **kwargs):
    kwargs.setdefault("env", {})
    return compile_spec(
        spec, out, compiler=compiler, export_dir=export, progress=None, status_stream=None, **kwargs
    )


def test_compile_writes_both_programs_logs_and_manifest(setup, tmp_path):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path)
    outcome = run(spec, out, export, compiler)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == outcome.manifest
    assert manifest["backend"] == "qaic" and manifest["family"] == "qwen2_5_vl"
    assert manifest["sdk"]["version"] == "1.20.2.0" and manifest["shapes"]["specialization_layout"] == "named"
    for program in ("vision", "lang"):
        entry = manifest["programs"][program]
        qpc = out / entry["path"]
        assert (qpc / "programqpc.bin").is_file()
        assert cache.cached_program(qpc, entry["cache_key"]) is not None
        assert "Compilation complete" in (out / program / "compile.log").read_text()
        assert "graph checks passed" in (out / program / "compile.log").read_text()  # stderr is logged too
        # The compiler ran in OUT's staging directory; the manifest names OUT.
        received = json.loads((qpc / "stand_in_argv.json").read_text())
        assert [re.sub(r"/\.out\.staging\.[^/]+/", "/out/", a) for a in received] == entry["argv"][1:]
    assert [s["name"] for s in manifest["programs"]["lang"]["specializations"]] == [
        "Prefill-64",
        "Prefill-128",
        "Decode",
    ]
    assert len(calls(record)) == 2
    vision, lang = (manifest["programs"][p]["path"] for p in ("vision", "lang"))
    assert manifest["vllm"]["qpc_path"] == f"{vision}:{lang}"  # relative to OUT, vision first


def test_cache_hit_miss_and_force(setup, tmp_path):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path)
    first = run(spec, out, export, compiler)
    assert first.cached == {"vision": False, "lang": False}
    second = run(spec, out, export, compiler)
    assert second.cached == {"vision": True, "lang": True} and len(calls(record)) == 2
    assert second.manifest["programs"]["lang"]["path"] == first.manifest["programs"]["lang"]["path"]
    # Another language option: only the language program is rebuilt, in a new directory.
    write_spec(spec, compile_section={"language": {"num_cores": 8}})
    third = run(spec, out, export, compiler)
    assert third.cached == {"vision": True, "lang": False} and len(calls(record)) == 3
    assert third.manifest["programs"]["lang"]["path"] != first.manifest["programs"]["lang"]["path"]
    fourth = run(spec, out, export, compiler, force=True)
    assert fourth.cached == {"vision": False, "lang": False} and len(calls(record)) == 5


def _corrupt(qpc, how):
    if how == "garbage record":
        (qpc / cache.RECORD_FILE).write_text("{not json")
    elif how == "other key":
        record = json.loads((qpc / cache.RECORD_FILE).read_text())
        (qpc / cache.RECORD_FILE).write_text(json.dumps(dict(record, key="0" * 64)))
    elif how == "truncated binary":
        (qpc / cache.QPC_FILE).write_bytes(b"x")
    elif how == "missing binary":
        (qpc / cache.QPC_FILE).unlink()
    elif how == "no record (crashed compile)":
        (qpc / cache.RECORD_FILE).unlink()


@pytest.mark.parametrize(
    "how",
    ["garbage record", "other key", "truncated binary", "missing binary", "no record (crashed compile)"],
)
def test_corrupt_cache_is_rebuilt(setup, tmp_path, how):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path)
    first = run(spec, out, export, compiler)
    qpc = out / first.manifest["programs"]["lang"]["path"]
    _corrupt(qpc, how)
    again = run(spec, out, export, compiler)
    assert again.cached == {"vision": True, "lang": False}
    assert len(calls(record)) == 3
    assert cache.cached_program(qpc, first.manifest["programs"]["lang"]["cache_key"]) is not None


def _log_of(error_text: str) -> Path:
    """The compiler log an error line names (kept outside OUT), after checking where it is."""
    path = Path(re.search(r"\(log: (\S+/compile\.log)\)", error_text).group(1))
    assert path.is_file() and path.parent.parent.name.startswith("qeff-vision-compile-")
    return path


def test_failure_exits_2_with_log_tail_and_leaves_nothing_valid(setup, tmp_path, capsys):
    spec, export, out = setup
    bad, _ = stand_in(tmp_path, mode="fail-vision")
    code = main(["compile", str(spec), "-o", str(out), "--compiler", str(bad), "--export", str(export)])
    err = capsys.readouterr().err
    assert code == 2
    assert "Error: stand-in failure requested" in err
    assert "stand-in: failure detail 39" in err and "stand-in: failure detail 10" not in err  # last 30 lines
    assert "compiler exited with code 1" in err
    assert tree_state(out) is None and not list(tmp_path.glob(".out.*")), "a failed compile left OUT behind"
    log = _log_of(err.splitlines()[-1])  # the error line names the log, outside OUT
    assert "failure detail 39" in log.read_text()
    # The language compile was still running: it is stopped, and its log (beside) says so.
    assert "compiler killed (stopped)" in (log.parent.parent / "lang" / "compile.log").read_text()
    shutil.rmtree(log.parent.parent)


def test_a_failed_forced_recompile_keeps_the_previous_result(setup, tmp_path):
    spec, export, out = setup
    good, _ = stand_in(tmp_path)
    before = run(spec, out, export, good).manifest
    state = tree_state(out)
    bad, _ = stand_in(tmp_path, mode="fail-vision")
    with pytest.raises(CompileFailed, match="compiler exited with code 1") as failure:
        run(spec, out, export, bad, force=True)
    # OUT is byte-for-byte as it was, its compile.log files included (they describe its programs).
    assert tree_state(out) == state and "Compilation complete" in (out / "vision" / "compile.log").read_text()
    assert "failure detail 39" in _log_of(str(failure.value)).read_text()  # the failure's log, elsewhere
    shutil.rmtree(_log_of(str(failure.value)).parent.parent)
    # A forced recompile that succeeds swaps the new programs in under the same names.
    again = run(spec, out, export, good, force=True).manifest
    assert again["programs"]["lang"]["path"] == before["programs"]["lang"]["path"]
    assert again["programs"]["lang"]["cached"] is False
    for program in ("vision", "lang"):
        path = out / before["programs"][program]["path"]
        assert cache.cached_program(path, before["programs"][program]["cache_key"]) is not None
        assert [p.name for p in (out / program).glob("qpc-*")] == [path.name]


def _corrupt_graph(export: Path) -> None:
    (export / "lang" / "model.onnx").write_bytes(b"not a protobuf at all")


def _other_family(export: Path) -> None:
    record = json.loads((export / "export.json").read_text())
    (export / "export.json").write_text(json.dumps(dict(record, family="llava")))


@pytest.mark.parametrize(
    "damage, message",
    [(_corrupt_graph, "not a readable ONNX model"), (_other_family, "exported family 'llava'")],
)
@pytest.mark.parametrize("previous", ["none", "valid"])
def test_an_input_error_leaves_out_as_it_was(tmp_path, damage, message, previous):
    spec = write_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    compiler, record = stand_in(tmp_path)
    if previous == "valid":
        run(spec, out, synthetic_export(tmp_path / "good-export"), compiler)
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    bad_export = synthetic_export(tmp_path / "bad-export")
    damage(bad_export)
    with pytest.raises(UserError, match=message):
        run(spec, out, bad_export, compiler)
    if previous == "none":
        assert not out.exists(), sorted(out.rglob("*"))
    else:
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    assert len(calls(record)) == (2 if previous == "valid" else 0)


def test_timeout_kills_a_hanging_compiler(setup, tmp_path):
    spec, export, out = setup
    compiler, _ = stand_in(tmp_path, mode="hang")
    with pytest.raises(CompileFailed) as failure:
        run(spec, out, export, compiler, timeout=1.5)
    one_line = r"(vision|lang): timed out after 1.5 s and was killed \(log: \S+/compile\.log\)"
    assert re.fullmatch(one_line, str(failure.value)), str(failure.value)
    # The stand-in printed this after writing a partial program: there was a half-written
    # directory, and the driver removed it.
    assert "stand-in: hanging" in failure.value.tail
    assert tree_state(out) is None
    shutil.rmtree(_log_of(str(failure.value)).parent.parent)
    # Killed after its timeout and promptly, by the driver's clock from the compiler's start. (The
    # whole compile_spec call is not timed: reading the spec and graphs takes seconds under load.)
    killed = r"\[qeff-vision\] compiler killed \(timeout\) after ([0-9.]+) s"
    note = re.fullmatch(killed, failure.value.tail[-1])
    assert note is not None and 1.5 <= float(note.group(1)) < 11.5, failure.value.tail


def test_spec_timeout_option_applies_per_program(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", compile_section={"vision": {"timeout": 1}})
    export = synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path, mode="hang")
    with pytest.raises(CompileFailed, match=r"^vision: timed out"):
        run(spec, tmp_path / "out", export, compiler, timeout=None)


def test_flooding_compiler_is_logged_in_full(setup, tmp_path):
    spec, export, out = setup
    compiler, _ = stand_in(tmp_path, mode="flood")
    outcome = run(spec, out, export, compiler)
    assert outcome.manifest is not None
    log = (out / "lang" / "compile.log").read_text()
    assert log.count("[flood]") == 200_000 and log.rstrip().endswith("Compilation complete")


def test_missing_compiler_names_paths_and_alternatives(setup, monkeypatch, capsys):
    spec, export, out = setup
    monkeypatch.delenv("QAIC_COMPILER", raising=False)
    monkeypatch.setattr(sdk, "DEFAULT_COMPILERS", (out / "none/qaic-exec", out / "none/qaic-compile"))
    code = main(["compile", str(spec), "-o", str(out), "--export", str(export)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "none/qaic-exec" in err and "none/qaic-compile" in err
    assert "--dry-run" in err and "--backend onnxruntime" in err


def test_compiler_from_environment(setup, tmp_path):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path)
    run(spec, out, export, None, env={"QAIC_COMPILER": str(compiler)})
    assert len(calls(record)) == 2


def test_dry_run_writes_inputs_prints_commands_and_compiles_nothing(setup, tmp_path, capsys):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path)
    code = main(
        [
            "compile",
            str(spec),
            "-o",
            str(out),
            "--compiler",
            str(compiler),
            "--export",
            str(export),
            "--dry-run",
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0
    assert stdout.splitlines()[0] == "# vision" and stdout.splitlines()[2] == "# lang"
    assert f"{compiler.resolve()} -m={export}/lang/model.onnx" in stdout and "-retained-state" in stdout
    assert calls(record) == [] and not (out / "manifest.json").exists() and not list(out.glob("*/qpc-*"))
    for program in ("vision", "lang"):
        assert (out / program / "specializations.json").is_file() and (
            out / program / "custom_io.yaml"
        ).is_file()


def test_concurrent_compiles_of_one_spec_are_serialized(setup, tmp_path):
    spec, export, out = setup
    compiler, record = stand_in(tmp_path, mode="slow", sleep=1)
    command = [
        sys.executable,
        "-m",
        "qeff_vision",
        "compile",
        str(spec),
        "-o",
        str(out),
        "--compiler",
        str(compiler),
        "--export",
        str(export),
    ]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outputs
    assert len(calls(record)) == 2, "the second compile must wait and then hit the cache"
    assert sum(out_text.count("(cached)") for out_text, _ in outputs) == 2
    assert any("waiting for another compile" in err for _, err in outputs)


def test_symbols_not_matching_the_graph_are_rejected_before_compiling(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml")
    export = synthetic_export(tmp_path / "export", rename={"vision_size": "vision_rows"})
    compiler, record = stand_in(tmp_path)
    with pytest.raises(SpecError) as error:
        run(spec, tmp_path / "out", export, compiler)
    message = str(error.value)
    assert (
        "symbol 'vision_rows' is missing (graph model.onnx has it on input vision_embeds axis 1)" in message
    )
    assert "symbol 'vision_size' is not a dimension of any input or output" in message
    assert calls(record) == []


def test_old_sdk_gets_the_flat_layout_and_refuses_named(tmp_path):
    export = synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path, version="1.16.1.0", layout="flat")
    spec = write_spec(tmp_path / "auto.yaml", layout="auto")
    outcome = run(spec, tmp_path / "out", export, compiler)
    assert outcome.manifest["shapes"]["specialization_layout"] == "flat"
    assert "-aic-hw-version=2.0" in outcome.manifest["programs"]["lang"]["argv"]
    named = write_spec(tmp_path / "named.yaml", layout="named")
    with pytest.raises(CompileFailed) as failure:
        run(named, tmp_path / "out-named", export, compiler)
    assert any("named layout not supported" in line for line in failure.value.tail)


def test_qaic_compile_name_and_multi_device_language(tmp_path):
    spec = write_spec(
        tmp_path / "spec.yaml",
        compile_section={"language": {"num_devices": 4, "kv_cache_dtype": "mxint8", "mxfp6_matmul": False}},
    )
    export = synthetic_export(tmp_path / "export")
    compiler, _ = stand_in(tmp_path, name="qaic-compile", version=None)
    outcome = run(spec, tmp_path / "out", export, compiler)
    lang = outcome.manifest["programs"]["lang"]
    assert "-compile-only" not in lang["argv"] and "-mxfp6-matmul" not in lang["argv"]
    assert f"-mdp-load-partition-config={tmp_path / 'out' / 'lang' / 'mdp_partition.json'}" in lang["argv"]
    partition = json.loads((tmp_path / "out" / lang["partition_file"]).read_text())
    assert [d["deviceId"] for d in partition["partitions"][0]["devices"]] == [0, 1, 2, 3]
    assert "Precision: mxint8" in (tmp_path / "out" / lang["custom_io_file"]).read_text()
    commands = outcome.manifest["vllm"]["commands"]
    assert "--encode-device-group 0 --decode-device-group 1,2,3,4" in commands["epd"]
    assert "'device_group': [1, 2, 3, 4]" in commands["plugin_offline"]
    assert all("mxint8" in command for command in commands.values())


def test_print_serve_prints_the_golden_vllm_commands(setup, tmp_path, capsys):
    """Issue 15 item 7: what --print-serve prints is the spec's golden text with the real QPC keys."""
    spec, export, out = setup
    compiler, _ = stand_in(tmp_path)
    code = main(
        [
            "compile",
            str(spec),
            "-o",
            str(out),
            "--compiler",
            str(compiler),
            "--export",
            str(export),
            "--print-serve",
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime_model"] is None  # the synthetic spec names no local checkpoint

    loaded = load_spec(spec)
    printed = stdout[stdout.index("# vLLM 0.23.0") :]
    golden = golden_serve_text(loaded).replace("'model': 'model'", f"'model': '{loaded.model}'")
    golden = golden.replace(" --model model ", f" --model {loaded.model} ").replace(
        " serve model ", f" serve {loaded.model} "
    )
    real = {program: manifest["programs"][program]["path"] for program in ("vision", "lang")}
    placeholder = f"vision/{QPC_PLACEHOLDER}:lang/{QPC_PLACEHOLDER}"  # the shell-quoted env value
    golden = golden.replace(
        f"={shlex.quote(placeholder)}", f"={shlex.quote(real['vision'] + ':' + real['lang'])}"
    )
    for program in ("vision", "lang"):  # golden <hash> keys become the real ones
        golden = golden.replace(f"{program}/{QPC_PLACEHOLDER}", manifest["programs"][program]["path"])
    assert printed == golden
    forms = serve_sections(printed)
    assert f"VLLM_QAIC_QPC_PATH={manifest['vllm']['qpc_path']} vllm serve" in forms["plugin_serve"]
    encode = launcher_override(launcher_args(forms["epd"])[1]["--encode-override-qaic-config"])
    assert encode == {
        "height": "224",
        "width": "224",
        "kv_offload": "True",
        "qpc_path": manifest["programs"]["vision"]["path"],
    }


def test_onnxruntime_backend_on_synthetic_graphs(setup):
    spec, export, out = setup
    outcome = compile_spec(spec, out, backend="onnxruntime", export_dir=export, progress=None, env={})
    manifest = json.loads((out / "manifest.json").read_text())
    assert outcome.manifest == manifest and manifest["backend"] == "onnxruntime" and manifest["sdk"] is None
    assert manifest["vllm"]["available"] is False
    lang = manifest["programs"]["lang"]
    assert lang["path"] == str((export / "lang" / "model.onnx").resolve())
    assert [
        run["output_shapes"]["vision_embeds_RetainedState"][1] for run in lang["verification"]["runs"]
    ] == [
        64,
        128,
        128,
    ]
    assert all(s["latency_ms"] >= 0 for s in lang["specializations"])
    with pytest.raises(UserError, match="no vLLM hand-off"):
        serve_text(manifest)


@pytest.mark.parametrize("previous", ["none", "valid"])
def test_interrupt_stops_the_compilers_and_leaves_nothing_valid(
    setup, tmp_path, previous, temporary_directory
):
    spec, export, out = setup
    if previous == "valid":
        run(spec, out, export, stand_in(tmp_path)[0])
    state = tree_state(out)
    compiler, record = stand_in(tmp_path, mode="hang")
    command = [sys.executable, "-m", "qeff_vision", "compile", str(spec), "-o", str(out)]
    command += ["--compiler", str(compiler), "--export", str(export), "--force"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # No sleeps: each stand-in appends a marker once it hangs with its partial output written.
    while hanging(record) < 2:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    assert len(_processes_mentioning(f"-aic-binary-dir={out.parent}/.out.staging.")) == 2
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err  # Ctrl-C: "interrupted", the shell convention
    assert err.splitlines()[-1] == "qeff-vision: interrupted" and "Traceback" not in err
    assert not _processes_mentioning(str(compiler.parent.parent)), (
        "a compiler outlived the interrupted compile"
    )
    assert tree_state(out) == state and not list(tmp_path.glob(".out.*"))  # OUT as it was, no staging
    assert not list(temporary_directory.glob("qeff-vision-*")), "the interrupted compile left its logs behind"


def _processes_mentioning(text):
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found
