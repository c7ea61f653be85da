"""EVS masks and recomputed M-RoPE positions equal vLLM's on the same embeddings and prompts.

The default tier compares with outputs of vLLM's own functions recorded in
tests/golden/video_pruning/vllm_evs.json (``python -m tests.evs_cases --record`` rewrites it). The
live check recomputes them with vLLM's ``evs.py`` when it is installed (importable here, or in
.venv-vllm-evs, which ``make test-vllm-evs`` builds: vLLM 0.33.0 without dependencies, torch lent
by a .pth line), and is skipped otherwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qeff_vision.contract.video_pruning import kept_rows
from qeff_vision.families import get_family
from qeff_vision.families.base import describe_checkpoint
from qeff_vision.runtime.video_pruning import retention_mask
from tests import evs_cases
from tests.evs_cases import IDS, MASK_CASES, PROMPT_CASES, TOKENS_PER_SECOND


@pytest.fixture(scope="module")
def recording():
    return json.loads(evs_cases.RECORDING.read_text())


@pytest.fixture(scope="module")
def hosts(tiny_checkpoint):
    """The tiny Qwen hosts; the cases' ids and tokens_per_second must be theirs."""
    built = {}
    for family in ("qwen2_5_vl", "qwen3_vl"):
        description = describe_checkpoint(tiny_checkpoint(family))
        config = description.config
        ids = {key: config[f"{key}_token_id"] for key in IDS}
        assert ids == IDS, "the tiny ids changed: update IDS, then python -m tests.evs_cases --record"
        built[family] = get_family(family).host(description)
    assert get_family("qwen2_5_vl").vision(built["qwen2_5_vl"].model).tokens_per_second == TOKENS_PER_SECOND
    return built


def _ours_mask(case) -> np.ndarray:
    _, kind, seed, grid, width, rate = case
    return retention_mask(evs_cases.embeddings(kind, seed, grid, width), grid, rate)


@pytest.mark.parametrize("case", MASK_CASES, ids=[case[0] for case in MASK_CASES])
def test_retention_mask_and_count_equal_recorded_vllm(recording, case):
    name, kind, seed, grid, width, rate = case
    recorded = recording["masks"][name]
    rows = evs_cases.embeddings(kind, seed, grid, width)
    assert recorded["inputs"] == evs_cases.digest(rows), "the case's embeddings changed: re-record"
    mask = _ours_mask(case)
    assert mask.astype(int).tolist() == recorded["mask"]
    assert kept_rows(grid[0], grid[1] * grid[2], rate) == recorded["kept"] == int(mask.sum())
    assert mask[: grid[1] * grid[2]].all()  # the first temporal patch is kept whole


def _ours_positions(hosts, case, mask) -> np.ndarray:
    built = evs_cases.prompt(case, mask)
    positions = hosts[case[1]].pruned_positions(built["processed"], built["keep"], built["masks"])
    assert positions.shape == (4, 1, int(built["keep"].sum()))
    assert positions[0, 0].tolist() == list(range(positions.shape[-1]))  # KV slots count the kept tokens
    return positions[1:, 0]


@pytest.mark.parametrize("case", PROMPT_CASES, ids=[case[0] for case in PROMPT_CASES])
def test_pruned_positions_equal_recorded_vllm(recording, hosts, case):
    mask = np.array(recording["masks"][case[2]]["mask"], dtype=bool)
    assert _ours_positions(hosts, case, mask).tolist() == recording["positions"][case[0]]


def test_qwen2_5_vl_positions_follow_vllm_not_the_unpruned_rule(recording, hosts):
    """A tall image continues at start + width, and 1.5 s temporal patches step by 4 (int(1.5) x 4), not 6."""
    case = next(c for c in PROMPT_CASES if c[0] == "qwen2_5_vl-clip-then-tall-image")
    everything = np.ones(len(recording["masks"][case[2]]["mask"]), dtype=bool)
    built = evs_cases.prompt(case, everything)
    host = hosts["qwen2_5_vl"]
    unpruned = host.prompt_positions(built["processed"])
    kept_all = host.pruned_positions(built["processed"], built["keep"], built["masks"])
    # Rate 0 never reaches this rule (nothing is pruned, today's positions stay); with everything
    # kept it differs only after the 3x1 image: width 1, not max(3, 1).
    assert kept_all.shape == unpruned.shape
    differs = np.flatnonzero((kept_all != unpruned).any(axis=(0, 1)))
    image_end = int(np.flatnonzero(built["processed"]["input_ids"][0] == IDS["image"])[-1])
    assert differs.size and differs.min() > image_end


def test_live_vllm_evs_matches_the_recording_and_ours(recording, hosts):
    found = evs_cases.find_vllm_evs()
    if found is None:
        pytest.skip(f"vLLM's evs.py is not installed (import vllm, or {evs_cases.EVS_VENV})")
    evs, version = found
    live = evs_cases.vllm_results(evs)
    assert {"vllm": version, **live} == recording, f"recording is stale for vLLM {version}: re-record"
    # Beyond the recording: 24 more random clips, rates and widths against vLLM directly.
    import torch

    rng = np.random.default_rng(30)
    for _ in range(24):
        grid = (int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        rate = float(rng.choice([0.1, 0.25, 0.5, 0.75, 0.9, 0.99]))
        rows = rng.standard_normal((int(np.prod(grid)), int(rng.integers(2, 64)))).astype(np.float32)
        unmerged = (grid[0], grid[1] * 2, grid[2] * 2)
        theirs = evs.compute_retention_mask(torch.from_numpy(rows), unmerged, 2, rate).numpy()
        assert (retention_mask(rows, grid, rate) == theirs).all(), (grid, rate)
