"""Pooling programs at real widths (marker ``realwidth``): Qwen3-VL-Embedding-8B and -Reranker-8B.

Each pinned config (specs/configs) is built as a real-width random checkpoint
(:mod:`qeff_vision.real_width`: every width kept, depth and vocabulary cut; the reranker gets
``yes`` / ``no`` tokens), compiled with ``--backend onnxruntime`` and the default precision plan,
and run as ``run --embed`` / ``run --score`` does (:func:`qeff_vision.runtime.pooling_run.pool_inputs`)
at fp32 and at device precision, against transformers on the same processed inputs. Run it under
the machine-wide lock: ``flock /work/heavy.lock pytest -m realwidth tests/test_real_width_pooling.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qeff_vision.contract.tasks import EMBED, SCORE
from qeff_vision.real_width import PINNED_CONFIGS
from tests import helpers

pytestmark = pytest.mark.realwidth

CASES = {EMBED: "Qwen3-VL-Embedding-8B", SCORE: "Qwen3-VL-Reranker-8B"}


@pytest.mark.parametrize("task", [EMBED, SCORE])
def test_real_width_pooling_matches_transformers(task, tmp_path):
    from qeff_vision import api
    from qeff_vision.real_width import build_real_width_checkpoint
    from qeff_vision.runtime.pooling_run import PoolInput, pool_inputs

    checkpoint = build_real_width_checkpoint(
        "qwen3_vl", tmp_path / "built", config=PINNED_CONFIGS / CASES[task]
    )
    if task == SCORE:
        checkpoint = helpers.with_score_tokens(checkpoint, tmp_path / "reranker")
    spec = {
        "name": f"{CASES[task].lower()}-real-width",
        "model": str(checkpoint),
        "task": task,
        "ctx_len": 1024,
        "prefill": {"seq_lens": [256, 1024]},
        "vision": {"images": [{"height": 224, "width": 224}], "max_images": 2, "vision_size": "chunk"},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    api.compile(
        tmp_path / "spec.yaml", tmp_path / "out", backend="onnxruntime", progress=None, status_stream=None
    )
    helpers.image(224, 224, 0).save(tmp_path / "a.png")
    items = [PoolInput("A photo of a dog on a beach.", (tmp_path / "a.png",)), PoolInput("Tax law.")]
    query = PoolInput("dog", (tmp_path / "a.png",)) if task == SCORE else None
    figures = {}
    for precision in ("fp32", "device"):
        results = pool_inputs(
            tmp_path / "out", items, task, query=query, precision=precision, compare_hf=True
        )
        agreements = [result.agreement(task) for result in results]
        figures[precision] = [figure for figure, _ in agreements]
        assert all(ok for _, ok in agreements), (precision, agreements)
    print(json.dumps({"task": task, "config": CASES[task], "agreement": figures}))
    assert Path(tmp_path / "out" / "manifest.json").is_file()
