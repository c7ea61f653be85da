import stat

import pytest

from qeff_vision.compile import sdk
from qeff_vision.errors import UserError

APPS_XML = """<?xml version="1.0"?>
<versions><ci_build><base_name>AIC_APPS</base_name><base_version>{base}</base_version>
<build_id>{build}</build_id></ci_build></versions>
"""


def make_sdk(tmp_path, name="qaic-exec", base="1.19", build="8.0"):
    root = tmp_path / "qti-aic"
    (root / "exec").mkdir(parents=True)
    (root / "versions").mkdir()
    compiler = root / "exec" / name
    compiler.write_text("#!/bin/sh\nexit 0\n")
    compiler.chmod(compiler.stat().st_mode | stat.S_IXUSR)
    if base is not None:
        (root / "versions" / "apps.xml").write_text(APPS_XML.format(base=base, build=build))
    return root, compiler


@pytest.fixture(autouse=True)
def no_default_sdk(monkeypatch, tmp_path):
    missing = tmp_path / "absent"
    monkeypatch.setattr(sdk, "DEFAULT_COMPILERS", (missing / "exec/qaic-exec", missing / "exec/qaic-compile"))
    monkeypatch.setattr(sdk, "DEFAULT_SDK_ROOT", missing)


def test_version_read_from_apps_xml(tmp_path):
    root, _ = make_sdk(tmp_path, base="1.20", build="2.0")
    assert sdk.read_sdk_version(root) == "1.20.2.0"
    assert sdk.read_sdk_version(tmp_path / "nowhere") is None
    (root / "versions" / "apps.xml").write_text("<not xml")
    assert sdk.read_sdk_version(root) is None


def test_lookup_order_explicit_then_env(tmp_path):
    _, compiler = make_sdk(tmp_path)
    assert sdk.find_compiler(compiler, env={}) == compiler.resolve()
    assert sdk.find_compiler(None, env={"QAIC_COMPILER": str(compiler)}) == compiler.resolve()
    with pytest.raises(UserError, match="from --compiler"):
        sdk.find_compiler(tmp_path / "missing", env={"QAIC_COMPILER": str(compiler)})


def test_missing_compiler_names_every_path_and_the_alternatives(tmp_path):
    with pytest.raises(UserError) as info:
        sdk.find_compiler(None, env={})
    message = str(info.value)
    assert "absent/exec/qaic-exec" in message and "absent/exec/qaic-compile" in message
    assert "--dry-run" in message and "--backend onnxruntime" in message
    assert sdk.detect_sdk(env={}) is None


@pytest.mark.parametrize(
    "name, base, layout, hw",
    [
        ("qaic-exec", "1.16", "flat", "2.0"),
        ("qaic-exec", "1.19", "flat", "ai100"),
        ("qaic-exec", "1.20", "named", "ai100"),
        ("qaic-exec", None, "flat", "ai100"),
        ("qaic-compile", None, "named", "ai100"),
    ],
)
def test_version_decides_layout_and_spelling(tmp_path, name, base, layout, hw):
    _, compiler = make_sdk(tmp_path, name=name, base=base)
    info = sdk.detect_sdk(compiler, env={})
    assert info is not None and info.compiler == compiler.resolve()
    assert info.specialization_layout == layout
    assert info.hw_version_flag_value("ai100") == hw
