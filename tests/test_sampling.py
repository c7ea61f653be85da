"""Sampling per request with vLLM's parameter names (issue 38 item 5).

Greedy stays the default (every parity test runs it); temperature 0 and top-k 1 give the greedy
tokens; a seeded request draws the same tokens run after run and whether it runs alone or among
other requests in the batched engine's steps; every sampled token lies in the top-k / top-p set
computed from transformers' logits for the same prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision.errors import UserError
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.sampling import TokenSampler, candidate_tokens, greedy_token
from tests import helpers
from tests.family_runtime import FamilyRuntime

FAMILY = "qwen2_5_vl"
SEQ_LENS = (32, 128)
SLOTS = 4
NEW = 8
SAMPLED = SamplingParams(temperature=1.5, top_k=6, top_p=0.9, seed=7)


def test_greedy_is_the_default_and_the_argmax():
    logits = np.array([0.1, 2.0, 2.0, -1.0])
    assert SamplingParams().greedy
    assert TokenSampler().next_token(logits) == greedy_token(logits) == 1  # first of a tie
    assert TokenSampler(SamplingParams(temperature=0.8, top_k=1, seed=3)).next_token(logits) == 1


def test_bad_values_are_user_errors_naming_the_parameter():
    for values, name in (
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"seed": "x"}, "seed"),
    ):
        with pytest.raises(UserError, match=name):
            SamplingParams(**values)


def test_candidates_apply_min_p_then_top_k_then_top_p():
    probs = np.array([0.05, 0.4, 0.3, 0.15, 0.1])
    assert candidate_tokens(probs).tolist() == [1, 2, 3, 4, 0]
    assert candidate_tokens(probs, top_k=2).tolist() == [1, 2]
    assert candidate_tokens(probs, top_p=0.7).tolist() == [1, 2]  # 0.4 + 0.3 reaches 0.7
    assert candidate_tokens(probs, top_p=0.71).tolist() == [1, 2, 3]
    assert candidate_tokens(probs, min_p=0.5).tolist() == [1, 2]  # >= 0.2
    assert candidate_tokens(probs, top_k=3, top_p=0.8).tolist() == [1, 2]  # renormalized over the 3


def test_seeded_draws_repeat_and_stay_in_the_kept_set():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=50) for _ in range(40)]
    params = SamplingParams(temperature=1.0, top_k=5, seed=11)

    def draw():
        sampler = TokenSampler(params)
        return [sampler.next_token(row) for row in rows]

    first = draw()
    assert draw() == first
    assert all(token in np.argsort(-row)[:5] for token, row in zip(first, rows))
    assert len(set(first)) > 1 and first != [greedy_token(row) for row in rows]


def test_penalties_follow_vllm():
    logits = np.array([3.0, 2.9, -1.0])
    # Token 0 is in the prompt: a positive logit is divided by the repetition penalty.
    assert TokenSampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0]).next_token(logits) == 1
    # Presence counts generated tokens only: the first pick is 0, then it is penalized.
    sampler = TokenSampler(SamplingParams(presence_penalty=0.5), prompt_ids=[1])
    assert [sampler.next_token(logits), sampler.next_token(logits)] == [0, 1]


@pytest.fixture
def runtime(hf_model, cb_exported) -> FamilyRuntime:
    model, processor = hf_model(FAMILY)
    return FamilyRuntime(FAMILY, cb_exported(FAMILY), model, processor)


def _requests(runtime: FamilyRuntime) -> list[dict]:
    return [
        runtime.inputs(("<image>", "Describe this image."), [helpers.image(64, 64, seed=1)]),
        runtime.inputs(("<image>", "What is this?"), [helpers.image(64, 96, seed=4)]),
        runtime.inputs(("Write a poem.",), []),
    ]


def _hf_logits(runtime: FamilyRuntime, processed: dict, tokens: list[int]) -> list[np.ndarray]:
    """transformers' raw last-position logits for the prompt followed by each prefix of ``tokens``.

    Its own generate, forced onto ``tokens`` (``prefix_allowed_tokens_fn``), so positions, caches
    and processor extras are transformers' (``output_logits`` are the logits before any processor).
    """
    inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
    length = inputs["input_ids"].shape[1]

    def forced(batch: int, ids: torch.Tensor) -> list[int]:
        return [tokens[ids.shape[-1] - length]]

    with torch.no_grad():
        out = runtime.model.generate(
            **inputs,
            max_new_tokens=len(tokens),
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            prefix_allowed_tokens_fn=forced,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0, length:].tolist() == tokens
    return [step[0].float().numpy() for step in out.logits]


def test_seeded_request_is_the_same_alone_and_among_others(runtime):
    generator = runtime.generator(SEQ_LENS, cache=EmbeddingCache(64 * 2**20))
    engine = BatchedEngine(generator, full_batch_size=SLOTS)
    first, second, third = _requests(runtime)
    alone = engine.generate(first, NEW, sampling=SAMPLED).tokens
    assert engine.generate(first, NEW, sampling=SAMPLED).tokens == alone, "same seed, same tokens"
    others = [
        EngineRequest(second, NEW, 0, sampling=SamplingParams(temperature=1.0, seed=1)),
        EngineRequest(third, NEW, 0),  # greedy
        EngineRequest(first, NEW, 1, sampling=SAMPLED),  # arrives while the others decode
        EngineRequest(second, NEW, 2, sampling=SamplingParams(temperature=0.7, top_p=0.8, seed=2)),
    ]
    report = engine.run(others)
    assert max(report.decode_batches) >= 3, "the seeded request shared decode calls"
    assert report.requests[2].result.tokens == alone
    # Every sampled token lies in the top-k / top-p set of transformers' logits for its prefix.
    for token, logits in zip(alone, _hf_logits(runtime, first, alone)):
        scaled = logits.astype(np.float64) / SAMPLED.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        assert token in candidate_tokens(probs, SAMPLED.top_k, SAMPLED.top_p).tolist()
    assert alone != runtime.reference(first)[0][:NEW], "sampling changed the tokens"


def test_temperature_zero_and_top_k_one_give_the_greedy_tokens(runtime):
    generator = runtime.generator(SEQ_LENS)
    processed = _requests(runtime)[0]
    greedy = runtime.reference(processed)[0]
    for params in (SamplingParams(temperature=0.0, seed=5), SamplingParams(temperature=1.3, top_k=1, seed=5)):
        result = generator.generate(processed, max_new_tokens=len(greedy), sampling=params)
        assert result.tokens == greedy, params
