"""Every family's tiny checkpoint at device precision (fp16 emulation with its automatic plan).

The plan comes from the calibration runs ``compile`` uses (a prompt with a synthetic image through
the runtime, every node output recorded); tiny random checkpoints stay far from fp16's range, so
it keeps only the rotary angle chains (position x inv_freq up to Cos/Sin, kept for precision, not
range: at positions near 500 an fp16 angle moves the retained keys by 0.03 of their range, in fp32
0.0005; ``test_rotary_angles_in_fp32_keep_keys_close_far_into_the_context``).
The parity prompt of ``test_family_parity`` then runs at device precision: no inf/NaN, logits
within 1e-2 of transformers' logit range at every step, tokens identical wherever transformers'
top-1/top-2 margin exceeds the measured deviation.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.compile.calibration import prompt_ranges
from qeff_vision.compile.graph_io import read_graph_io
from qeff_vision.compile.onnxruntime_backend import bound_shape, generated_input
from qeff_vision.families import all_families
from qeff_vision.families.base import TOKEN_MERGE
from qeff_vision.graph_file import load_graph
from qeff_vision.numerics.device import device_session, session_for
from qeff_vision.numerics.plan import angle_chains, auto_plan
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

# Calibration inputs (compile/calibration.py) are generated for the token-merge IO; the
# cross-attention kind (mllama) has no calibration inputs yet.
FAMILIES = [family.name for family in all_families() if family.decoder_kind == TOKEN_MERGE]
RELATIVE_TOLERANCE = 1e-2
NEW_TOKENS = 9


def _plans(export, length: int) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """Each program's automatic plan and its angle chains."""
    bucket = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: length,
        symbols.VISION_SIZE: length,
        symbols.CTX_LEN: 512,
    }
    decode = {**bucket, symbols.SEQ_LEN: 1}
    ranges = prompt_ranges(export, None, [bucket, decode], [(100, 150)])
    plans, angles = {}, {}
    for program, path in (("vision", "vision/model.onnx"), ("lang", "lang/model.onnx")):
        model = onnx.load(str(export / path), load_external_data=False)
        plans[program] = auto_plan(model, ranges[program])
        angles[program] = angle_chains(model)
    return plans, angles


# The default tier runs one family per state kind (tests.helpers.DEFAULT_TIER_FAMILIES), `-m slow`
# every token-merge family.
@pytest.mark.parametrize("family", helpers.tiered(FAMILIES))
def test_device_precision_matches_transformers(family, hf_model, exported):
    model, processor = hf_model(family)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=NEW_TOKENS)
    length = inputs["input_ids"].shape[1]
    plans, angles = _plans(exported(family), length + 3)
    # A tiny random checkpoint never nears 65,504: only the rotary angles are kept.
    assert {program: set(plan) for program, plan in plans.items()} == angles
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


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_rotary_angles_in_fp32_keep_keys_close_far_into_the_context(family, exported):
    """A 32-token chunk at positions 480-511: retained keys at device precision against fp32.

    With the angle (position x inv_freq) in fp16 it is off by up to 0.125 rad there and the keys
    by 0.03 of their range (llava, measured); with the angle chain in fp32, as the automatic plan
    keeps it, about 0.0005: the rounding of the keys themselves, as at position 0.
    """
    path = exported(family) / "lang" / "model.onnx"
    graph = read_graph_io(path)
    model = load_graph(path)
    angles = angle_chains(model)
    assert any(name.endswith("Cos_output_0") for name in angles)
    assert not any("position_ids" in name for name in angles)  # the walk stops at the integer ids
    values = {
        symbols.BATCH_SIZE: 1,
        symbols.SEQ_LEN: 32,
        symbols.CTX_LEN: 1024,
        symbols.VISION_SIZE: 32,
        symbols.VISION_BATCH_SIZE: 1,
    }
    rng = np.random.default_rng(0)
    feeds = {
        tensor.name: generated_input(tensor, bound_shape(tensor, values, family), rng)
        for tensor in graph.inputs
    }
    feeds[symbols.POSITION_IDS] = feeds[symbols.POSITION_IDS] + 480
    names = [tensor.name for tensor in graph.outputs]
    keys = [name for name in names if name.startswith("past_key.")]
    reference = dict(zip(names, session_for(model, path.parent).run(names, feeds)))

    def key_deviation(plan) -> float:
        device = dict(zip(names, device_session(path, plan).run(names, feeds)))
        return max(float(np.abs(device[k] - reference[k]).max() / np.ptp(reference[k])) for k in keys)

    in_fp16, in_fp32 = key_deviation([]), key_deviation(sorted(angles))
    assert in_fp16 > 0.01, in_fp16
    assert in_fp32 < 0.002, in_fp32
