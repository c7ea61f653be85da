"""tests/routing_ties.py on real models: ties found only where the fp32 margin is within bf16's shift.

The parity test of ai200 (tests/test_ai200_parity.py) calls it only on a step past its bound; here
its findings are checked directly, on Llama 4's tiny bf16 checkpoint (top-1 sigmoid routing) and
on a dense family (no ``topk`` call: no tie).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import helpers
from tests.routing_ties import routing_ties, swapped_references
from tests.test_ai200_families import bf16_checkpoint

TOKENS = [5, 6, 7]


def _model_and_prompt(tiny_checkpoint, tmp_path, family):
    checkpoint = bf16_checkpoint(tiny_checkpoint(family), tmp_path / "checkpoint")
    model, processor = helpers.load_hf(checkpoint)
    image = helpers.image(100, 150)
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Describe this image."), [image])
    return model, inputs


def test_a_dense_family_has_no_routing_tie(tiny_checkpoint, tmp_path):
    model, inputs = _model_and_prompt(tiny_checkpoint, tmp_path, "llava")
    assert routing_ties(model, inputs, TOKENS) == []


@pytest.mark.slow
def test_moe_ties_are_within_bf16_shift_and_swapping_one_changes_the_run(tiny_checkpoint, tmp_path):
    model, inputs = _model_and_prompt(tiny_checkpoint, tmp_path, "llama4")
    ties = routing_ties(model, inputs, TOKENS)
    assert ties, "Llama 4's tiny prompt has near-ties in its routers (8 in the prompt rows)"
    experts = model.config.text_config.num_local_experts
    for tie in ties:
        assert 0 <= tie.gap < tie.shift, tie
        assert tie.chosen != tie.runner_up and {tie.chosen, tie.runner_up} <= set(range(experts))
        assert 0 <= tie.step < len(TOKENS)
    assert [t.gap / t.shift for t in ties] == sorted(t.gap / t.shift for t in ties)
    # Taking the closest tie the other way changes transformers' fp32 logits from that step on only.
    tie = ties[0]
    from qeff_vision.reference import reference_teacher_forced

    plain = reference_teacher_forced(model, inputs, TOKENS)
    swapped, _ = swapped_references(model, inputs, TOKENS, tie)
    moved = [float(np.abs(a - b).max()) for a, b in zip(plain, swapped)]
    assert all(m == 0 for m in moved[: tie.step]), moved
    assert moved[tie.step] > 0, moved
