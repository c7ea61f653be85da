"""Shared helpers of the spec tests (imported by tests/test_spec*.py; holds no tests itself)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from qeff_vision.errors import SpecError
from qeff_vision.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"
CONFIG_3B = SPECS / "configs" / "Qwen2.5-VL-3B-Instruct" / "config.json"
DELETE = object()


def _merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if value is DELETE:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def spec_data(**overrides) -> dict:
    """A valid Qwen2.5-VL-3B spec (pinned config, absolute path) with ``overrides`` deep-merged in.

    A value of ``DELETE`` removes the key.
    """
    data = {
        "name": "test-spec",
        "model": "Qwen/Qwen2.5-VL-3B-Instruct",
        "config": str(CONFIG_3B),
        "ctx_len": 8192,
        "prefill": {"seq_lens": [128, 512]},
        "vision": {"images": [{"height": 354, "width": 536}]},
    }
    return _merge(copy.deepcopy(data), overrides)


def write_spec(directory: Path, content: dict | str, name: str = "spec.yaml") -> Path:
    """Write a spec (a dict is dumped as YAML, a string written as is) and return its path."""
    path = Path(directory) / name
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def problems_of(path: Path) -> list[str]:
    """The problems ``load_spec`` reports for ``path`` (it must fail)."""
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.problems
