"""``run --image --prompt`` on a continuous-batching artifact, every family that batches (issue 36 item 3).

A program compiled with ``full_batch_size`` F decodes only at batch F, so one sequence is a batch of
one of the batched engine: it takes slot 0 and decodes in batch-F calls with the other rows idle,
as vLLM sends a lone request. Per family, the repository's continuous-batching spec (dual,
``full_batch_size`` kept) is compiled on the tiny checkpoint with the onnxruntime backend, then
``run`` over two turns (an image, then a text-only follow-up that prefills the whole conversation
again) and a text-only conversation, each turn ``--compare-hf`` identical to transformers
generate. This covers the token-merge families, mllama (cross-attention states in the slot) and
Qwen3.5 (recurrent state in the slot); a disaggregated pair at F > 1 takes the same path
(``tests/test_disaggregated.py``, its three-turn ``run``). Before the engine served lone requests,
every family failed with "shapes ... match no compiled specialization".

Cost: one onnxruntime compile (no precision plan) and three short generations per family, 2-7 s
each on the session's CB exports (57 s for the 13 families on this 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.cli import main
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import ImageSize
from qeff_vision.spec import find_specs, load_spec
from tests import helpers
from tests.test_spec_helpers import write_spec as write_spec_data

SPECS = Path(__file__).resolve().parent.parent / "specs"
FAMILIES = [f.name for f in all_families() if f.features.continuous_batching.supported]
BUCKET = 32
NEW_TOKENS = 4
IDENTICAL = "tokens identical to transformers generate"


def _cb_spec(family: str, model: Path, tmp_path: Path) -> tuple[Path, tuple[int, int]]:
    """(spec path, image size): the family's continuous-batching spec on the tiny ``model``."""
    base = next(
        path
        for path in find_specs(SPECS)
        if (spec := load_spec(path)).family == family
        and spec.deployment.mode == "dual"
        and spec.full_batch_size is not None
        and spec.compile.comp_ctx_lengths is None
        and spec.compile.language.sampler is None  # the plain CB spec, not its sampler sibling
    )
    description = Checkpoint.open(model, family).description
    sizes = [ImageSize(h, w) for h, w in load_adapter(get_family(family)).test_image_sizes]
    image = max(sizes, key=lambda size: get_family(family).image_tokens(description, size))
    rows = get_family(family).image_tokens(description, image)
    data = yaml.safe_load(base.read_text())
    data.pop("config")
    data.pop("compile", None)
    # Two turns: the image's rows, the chat template's tokens and the first reply.
    data.update(model=str(model), ctx_len=rows + 8 * BUCKET, prefill={"seq_lens": [BUCKET]})
    data["vision"]["images"] = [{"height": image.height, "width": image.width}]
    data["vision"].pop("max_images", None)
    data["compile"] = {"node_precision": "none"}
    return write_spec_data(tmp_path, data), (image.height, image.width)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_runs_in_slot_zero_of_a_continuous_batching_artifact(
    family, tiny_checkpoint, cb_exported, tmp_path, capsys
):
    spec, (height, width) = _cb_spec(family, tiny_checkpoint(family), tmp_path)
    out = tmp_path / "out"
    compiled = ["compile", str(spec), "-o", str(out), "--backend", "onnxruntime"]
    assert main([*compiled, "--export", str(cb_exported(family))]) == 0, capsys.readouterr().err
    slots = load_spec(spec).full_batch_size
    assert slots > 1
    capsys.readouterr()
    image = tmp_path / "image.png"
    helpers.image(height, width, seed=1).save(image)
    budget = ["--max-new-tokens", str(NEW_TOKENS), "--compare-hf"]
    turns = ["--prompt", "Describe this picture.", "--prompt", "What colour dominates?"]
    code = main(["run", str(out), "--image", str(image), *turns, *budget])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count(IDENTICAL) == 2, err
    assert "prefilled again in slot 0" in err.split("[turn 2]")[1], "turn 2 ran through the engine"
    code = main(["run", str(out), "--prompt", "Write a poem about the sea.", *budget])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count(IDENTICAL) == 1, err
    assert "0 image(s)" in err
