"""An untested transformers release stops the export in one line instead of deep in a trace."""

from pathlib import Path

import pytest
import tomllib
import transformers
from packaging.requirements import Requirement

from qeff_vision import transformers_version
from qeff_vision.cli import main
from qeff_vision.errors import UserError
from qeff_vision.transformers_version import declared_range, require_supported_transformers

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_range() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (line,) = [dep for dep in project["dependencies"] if Requirement(dep).name == "transformers"]
    return str(Requirement(line).specifier)


def _constrained_version(name: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def test_the_check_reads_the_range_pyproject_declares():
    assert declared_range() == _pyproject_range()


def test_the_installed_and_the_constrained_transformers_are_supported():
    require_supported_transformers()
    pinned = _constrained_version("transformers")
    require_supported_transformers(installed=pinned, supported=_pyproject_range())
    assert transformers.__version__ == transformers_version.installed_version() == pinned


@pytest.mark.parametrize("version", ["5.24.0", "5.22.2", "6.0.0"])
def test_a_release_outside_the_range_is_one_line(version):
    with pytest.raises(UserError) as caught:
        require_supported_transformers(installed=version, supported=">=5.23,<5.24")
    message = str(caught.value)
    assert "\n" not in message
    assert f"transformers {version} is not supported" in message and "'transformers<5.24,>=5.23'" in message


def test_export_with_an_untested_release_exits_2_in_one_line(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(transformers_version, "installed_version", lambda: "5.24.0")
    code = main(["export", str(tiny_checkpoint("llava")), "-o", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "transformers 5.24.0 is not supported" in err
    assert not (tmp_path / "out").exists()
