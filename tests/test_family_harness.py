"""One harness for every registered family: chunked runs and compile-and-run against transformers.

Parametrized over the registry, so a new family is covered by registering it. Each family's
images are its adapter's ``test_image_sizes``; references are transformers' own greedy generate.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision.demo import compile_and_run
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import CROSS_ATTENTION
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime

FAMILIES = [family.name for family in all_families()]


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turn_conversation(family, exported, hf_model):
    """Image, text-only follow-up, new image: tokens and logits match transformers every turn, and
    each later turn prefills only what follows the prefix the language program holds."""
    runtime = FamilyRuntime(family, exported(family), *hf_model(family))
    sizes = load_adapter(get_family(family)).test_image_sizes
    cache = EmbeddingCache(16 * 2**20)
    chat = Conversation(
        runtime.generator([16, 64], "chunk", cache), runtime.processor, max_new_tokens=NEW_TOKENS
    )
    first, second = helpers.image(*sizes[0], 5), helpers.image(*sizes[-1], 6)
    results = runtime.three_turns(chat, first, second, family)
    assert [r.images_encoded for r in results] == [1, 0, 1]  # turn one's image is encoded once
    whole = [r.prompt_tokens for r in results]  # what re-prefilling the history would prefill
    prefilled = [r.prefilled_tokens for r in results]
    print(f"{family}: prefilled {prefilled} of {whole} ({sum(prefilled)} vs {sum(whole)})")
    assert prefilled[0] == whole[0] and prefilled[1] < whole[1], (prefilled, whole)
    if runtime.family.decoder_kind == CROSS_ATTENTION:
        # mllama: a token that sees no image reads every image's states, so a new image
        # prefills the text again (its single program does the same).
        assert prefilled[2] == whole[2]
    else:
        assert prefilled[2] < whole[2]
        first_ids, third_ids = (runtime.turn_inputs[turn]["input_ids"].reshape(-1) for turn in (0, 2))
        host = runtime.family.host(runtime.checkpoint.description)
        image_stop = host.segments(runtime.turn_inputs[0])[0].stop
        if np.array_equal(third_ids[:image_stop], first_ids[:image_stop]):
            assert results[2].served[0] == "image 1: KV held from an earlier turn"
        else:  # the template rewrote what precedes image 1 (Molmo2 lists every image first, numbered)
            assert results[2].served[0] == "image 1: embedding cache (encoded by an earlier turn)"
    assert sum(prefilled) < sum(whole)
    for result, tokens in zip(results, prefilled):
        if tokens < result.prompt_tokens:
            kept = result.prompt_tokens - tokens
            assert f"{kept} of {result.prompt_tokens} prompt tokens already held" in result.notes[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_specialize_compile_onnxruntime_and_run_match_transformers(
    family, tiny_checkpoint, exported, tmp_path
):
    """The demo pipeline: a two-resolution spec, every specialization run on onnxruntime, then
    ``run`` with two images (``--compare-hf``): tokens identical to transformers generate."""
    assert compile_and_run(tmp_path, tiny_checkpoint(family), exported(family), get_family(family))
