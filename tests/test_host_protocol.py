"""The host protocol stays torch-free: the planner, the checkpoint object and the runtime host side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.errors import UserError

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
