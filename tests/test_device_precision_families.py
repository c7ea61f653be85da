"""Every family's tiny checkpoint at device precision (fp16 emulation with its automatic plan).

The plan comes from the calibration runs ``compile`` uses (a prompt with a synthetic image through
the runtime, every node output recorded); tiny random checkpoints stay far from fp16's range, so
it is empty. The parity prompt of ``test_family_parity`` then runs at device precision: no inf/NaN,
logits within 1e-2 of transformers' logit range at every step, tokens identical wherever
transformers' top-1/top-2 margin exceeds the measured deviation.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.compile.calibration import prompt_ranges
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.numerics.plan import auto_plan
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

# Calibration inputs (compile/calibration.py) are generated for the token-merge IO; the
# cross-attention kind (mllama) has no calibration inputs yet.
FAMILIES = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE]
RELATIVE_TOLERANCE = 1e-2
NEW_TOKENS = 9


def _plans(export, length: int) -> dict[str, list[str]]:
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: length,
        symbols.VISION_SIZE: length,
        symbols.CTX_LEN: 512,
    }
    decode = {**bucket, symbols.SEQ_LEN: 1}
    ranges = prompt_ranges(export, None, [bucket, decode], [(100, 150)])
    plans = {}
    for program, path in (("vision", "vision/model.onnx"), ("lang", "lang/model.onnx")):
        model = onnx.load(str(export / path), load_external_data=False)
        plans[program] = auto_plan(model, ranges[program])
    return plans


@pytest.mark.parametrize("family", FAMILIES)
def test_device_precision_matches_transformers(family, hf_model, exported):
    model, processor = hf_model(family)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=NEW_TOKENS)
    length = inputs["input_ids"].shape[1]
    plans = _plans(exported(family), length + 3)
    assert plans == {"vision": [], "lang": []}  # a tiny random checkpoint never nears 65,504
    bucket = PrefillBucket(length + 3, length + 3)
    generator = generator_for_export(
        exported(family), LanguageShape((bucket,), bucket.vision_size, length + 64), fp32_values=plans
    )
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS, keep_logits=True)
    for step, (ours, ref) in enumerate(zip(result.logits, hf_logits)):
        assert np.isfinite(ours).all()
        deviation = np.abs(ours - ref).max()
        assert deviation <= RELATIVE_TOLERANCE * (ref.max() - ref.min()), (step, deviation)
        top = np.sort(ref)[-2:]
        if top[1] - top[0] > 2 * deviation:
            assert result.tokens[step] == hf_tokens[step], step
        if result.tokens[step] != hf_tokens[step]:
            break
