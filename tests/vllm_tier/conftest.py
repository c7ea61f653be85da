"""The vLLM tier runs only when asked (``make test-vllm`` sets QEFF_VLLM_TIER=1).

It needs a second venv with vLLM 0.23.0 (VLLM_VENV, default .venv-vllm) and a vllm-qaic checkout
(VLLM_QAIC_SRC); the default ``make test`` does not collect it.
"""

from __future__ import annotations

import os

import pytest

collect_ignore_glob = [] if os.environ.get("QEFF_VLLM_TIER") == "1" else ["test_*.py"]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """``built(family) -> (root, {label: job})``: a family's two artifacts compiled once per session.

    The in-process tests (test_vllm_serving.py) and the printed endpoints over HTTP
    (test_vllm_online.py) serve the same compiled artifacts.
    """
    from tests.vllm_tier import prepare

    done: dict[str, tuple] = {}

    def build(family: str):
        if family not in done:
            root = tmp_path_factory.mktemp(family)
            done[family] = (root, prepare.build(prepare.CASES[family], root))
        return done[family]

    return build
