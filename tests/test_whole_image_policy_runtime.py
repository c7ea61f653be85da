"""The whole-image ``chunk`` policy end to end: a Gemma 3 spec compiled on onnxruntime, then run.

Buckets sized by the policy (V below S) must still carry every image whole and give transformers'
tokens; the programs refuse any shape outside the compiled specializations.
"""

from __future__ import annotations

import yaml

from qeff_vision import api
from tests import helpers

FAMILY = "gemma3"


def test_policy_sized_buckets_run_whole_images_like_transformers(tmp_path, tiny_checkpoint, exported):
    spec = {
        "name": "gemma-whole-images",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 256,
        "prefill": {"seq_lens": [16, 48]},
        "vision": {"images": [{"height": 112, "width": 112}], "max_images": 3, "vision_size": "chunk"},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    specialized = api.specialize(tmp_path / "spec.yaml")
    sizes = {s.name: int(s.symbols["vision_size"]) for s in specialized.language.specializations}
    # 16 tokens per image: one fits in 16 tokens; two need 16 + 2 + 16 = 34 <= 48; three need 52.
    assert sizes == {"Prefill-16": 16, "Prefill-48": 32, "Decode": 32}
    api.compile(
        tmp_path / "spec.yaml",
        tmp_path / "out",
        backend="onnxruntime",
        export_dir=exported(FAMILY),
        progress=None,
        status_stream=None,
    )
    images = [helpers.image(112, 112, 1), helpers.image(112, 112, 2)]
    turn = api.run(tmp_path / "out", images, ["Compare them."], max_new_tokens=6, compare_hf=True)[0]
    assert turn.comparison.identical, turn.comparison.describe()
    assert all(chunk.rows <= chunk.vision_size <= chunk.seq_len for chunk in turn.result.chunks)
    assert any(chunk.vision_size < chunk.seq_len for chunk in turn.result.chunks)
