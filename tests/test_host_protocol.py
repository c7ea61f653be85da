"""The host protocol stays torch-free: the planner, the checkpoint object and the runtime host side."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.errors import UserError
from qeff_vision.families import all_families

ROOT = Path(__file__).resolve().parents[1]


def test_planner_and_checkpoint_import_without_torch(tmp_path):
    # Runs in a fresh interpreter: this process has torch loaded already.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    code = (
        "import sys, qeff_vision.runtime.planner; assert 'torch' not in sys.modules;"
        "from qeff_vision.checkpoint import Checkpoint;"
        f"c = Checkpoint.open({str(tmp_path)!r}); print(c.family.name, list(c.eos_token_ids));"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["llava", "[5,", "6]"]


def test_checkpoint_without_config_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        Checkpoint.open(tmp_path)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _from_export(name: str) -> bool:
    return name == "qeff_vision.export" or name.startswith("qeff_vision.export.")


def test_runtime_imports_nothing_from_export():
    offenders = {
        str(path.relative_to(ROOT)): sorted(filter(_from_export, _imports(path)))
        for path in sorted((ROOT / "qeff_vision" / "runtime").glob("*.py"))
    }
    assert not {path: names for path, names in offenders.items() if names}


def test_every_host_protocol_is_torch_free():
    # Every family's host module loads in one fresh interpreter without torch or transformers.
    code = (
        "import sys, importlib; from qeff_vision.families import all_families;"
        "[f.parts.host for f in all_families()];"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-500:]
    assert all(family.parts.host for family in all_families() if family.decoder_kind)
