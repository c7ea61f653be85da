"""Shared fixtures. The default tier builds tiny random checkpoints on the fly (no downloads).

Tiers: plain ``pytest`` runs the fast tier (pyproject's addopts deselect ``slow``); ``pytest -m
slow`` runs the larger random configurations and long sweeps, ``make test-all`` both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import helpers


def _one_thread_per_worker() -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``): each worker's torch and onnxruntime on one thread.

    The workers already fill the cores; torch's and onnxruntime's own pools (one thread per core each,
    and onnxruntime's spin while waiting for work) would put four busy threads on two cores.
    Subprocesses a test starts keep their own settings (most set ``OMP_NUM_THREADS=1``).
    """
    import onnxruntime
    import torch

    torch.set_num_threads(1)

    class OneThreadSessionOptions(onnxruntime.SessionOptions):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.intra_op_num_threads = 1
            self.inter_op_num_threads = 1
            # Set as a config entry too: product code may set intra_op_num_threads after this.
            self.add_session_config_entry("session.intra_op.allow_spinning", "0")

    onnxruntime.SessionOptions = OneThreadSessionOptions


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("QEFF_TEST_WORKER_THREADS", "1") == "1":
        _one_thread_per_worker()


@pytest.fixture(autouse=True)
def _plan_store(tmp_path_factory, monkeypatch):
    """Each test its own precision-plan store (qeff_vision/compile/plan_store.py): a plan one
    test calibrated is never another test's cache hit, and nothing is written under ~/.cache."""
    monkeypatch.setenv("QEFF_VISION_CACHE", str(tmp_path_factory.mktemp("qeff-cache")))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family) -> Path``: a tiny checkpoint per family, built once per session."""
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = helpers.write_tiny(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return build


@pytest.fixture(scope="session")
def exported(tiny_checkpoint, tmp_path_factory):
    """``exported(family) -> Path``: the tiny checkpoint's export directory, built once per session."""
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            from qeff_vision.exporter import export_model

            out = tmp_path_factory.mktemp(f"export-{family}") / "export"
            export_model(tiny_checkpoint(family), out, progress=None)
            built[family] = out
        return built[family]

    return build


@pytest.fixture(scope="session")
def cb_exported(tiny_checkpoint, tmp_path_factory):
    """``cb_exported(family, ccl=False) -> Path``: the continuous-batching export, built once per session.

    ``batch_index`` and ``full_batch_size`` KV slots; ``ccl=True`` adds the ``comp_ctx_lengths`` input.
    """
    built: dict[tuple[str, bool], Path] = {}

    def build(family: str, ccl: bool = False) -> Path:
        if (family, ccl) not in built:
            from qeff_vision.exporter import export_model

            out = tmp_path_factory.mktemp(f"cb-export-{family}") / "export"
            export_model(
                tiny_checkpoint(family), out, continuous_batching=True, comp_ctx_lengths=ccl, progress=None
            )
            built[family, ccl] = out
        return built[family, ccl]

    return build


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    """``hf_model(family) -> (model, processor)`` loaded once per session with eager attention."""
    loaded: dict[str, tuple] = {}

    def load(family: str):
        if family not in loaded:
            loaded[family] = helpers.load_hf(tiny_checkpoint(family))
        return loaded[family]

    return load
