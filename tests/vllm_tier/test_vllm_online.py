"""The printed online form run as printed: two ``vllm serve`` endpoints over HTTP (issue 50).

Per family, the continuous-batching artifact the in-process tier serves (``built``, compiled
once per session): the two ``vllm serve`` lines of ``--print-serve`` started as separate process
groups in OUT (endpoints.py: only the port and ``--host 127.0.0.1`` change), vLLM's
multiprocessing on, the device-runtime stand-in as their runtime. Requests go through the package's
client (qeff_vision/serving/client.py): each ``image_url`` to the encode endpoint (plain HTTP:
chat-form ``/v1/embeddings``, ``encoding_format=bytes``), the embeddings to the language endpoint as
``image_embeds`` chat content with the official ``openai`` client, ``image_grid_thw`` along for the
Qwen families. Greedy tokens must equal transformers' ``generate`` on the processor's outputs,
streamed and not, and vLLM's prompt must equal the processor's token ids.

``add_special_tokens=True`` in each chat request: vLLM's chat endpoint tokenizes the rendered
template without special tokens by default, the processor (and the in-process tier's
``LLM.generate``) with them; LLaVA's template has no ``<s>``, so the default would drop the BOS the
reference has.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from qeff_vision.serving.client import EncodeError, EncodeThenChat, image_data_url
from tests.vllm_tier import endpoints, prepare
from tests.vllm_tier.test_vllm_serving import SERVED, VENV, _vllm_env

# Every family the in-process tier serves (test_vllm_serving.SERVED), over HTTP.
ONLINE = SERVED
# Concurrency and encode-endpoint faults: one family whose images travel alone and one Qwen family
# (embeddings with image_grid_thw); the HTTP path is family-independent past the first request.
FAULTS = ONLINE[:2]
assert FAULTS == ("llava", "qwen2_5_vl")
CONCURRENT_REQUESTS = 16
# An image request whose encode endpoint is down or stalled fails within this many seconds (the
# client's encode timeout) plus this slack for the host.
ENCODE_TIMEOUT_S = 5.0
ERROR_SLACK_S = 5.0
CHAT_EXTRA = {"return_token_ids": True, "ignore_eos": True, "add_special_tokens": True}


def _base_env() -> dict[str, str]:
    env = _vllm_env()
    # No network: the model is OUT's copy; no usage report.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


class Online:
    """A family's two running endpoints, its client and its requests with transformers' tokens."""

    def __init__(self, family: str, root: Path, jobs: dict):
        self.family, self.root = family, root
        self.out = root / f"{family}-cb"
        self.spec_file = root / f"{family}-cb.yaml"
        self.servers = endpoints.start_pair(self.spec_file, self.out, _base_env(), VENV / "bin")
        self.client = self.make_client()
        # The distinct requests of both jobs (an image over several chunks, a second image prompt,
        # two text-only prompts), keyed by prompt.
        requests = [r for job in jobs.values() for batch in job["batches"] for r in batch]
        self.requests = list({r["prompt"]: r for r in requests}.values())

    def make_client(self, encode_timeout: float = 60.0) -> EncodeThenChat:
        return EncodeThenChat.for_artifact(
            self.out,
            f"{self.servers['encode'].base_url}/v1",
            f"{self.servers['language'].base_url}/v1",
            encode_timeout=encode_timeout,
            timeout=120.0,
        )

    def stop(self) -> dict[str, tuple[bool, float, bool]]:
        """SIGTERM each server: {name: (clean, seconds, port free after)}."""
        done = {}
        for name, server in self.servers.items():
            clean, seconds = server.stop(signal.SIGTERM)
            done[name] = (clean, seconds, endpoints.port_is_free(server.port))
        return done


def messages(request: dict) -> list[dict]:
    """The request's user turn as OpenAI chat content, its images as ``data:`` URLs."""
    images = iter(request.get("images", []))
    content = [
        {"type": "image_url", "image_url": {"url": image_data_url(next(images))}}
        if part == "<image>"
        else {"type": "text", "text": part}
        for part in request["parts"]
    ]
    return [{"role": "user", "content": content}]


def ask(
    client: EncodeThenChat, request: dict, *, stream: bool = False, grid: bool = True
) -> tuple[list[int], list[int]]:
    """(prompt token ids, greedy token ids) of one chat request through ``client``.

    ``grid``: send the processor's ``image_grid_thw`` (Qwen families); False sends the plugin's
    placeholder, as a client that does not run the processor does.
    """
    reply = client.chat(
        messages(request),
        grids=request.get("image_grid_thw") if grid else None,
        temperature=0.0,
        max_tokens=prepare.NEW_TOKENS,
        stream=stream,
        extra_body=CHAT_EXTRA,
    )
    if not stream:
        data = reply.model_dump()
        return data["prompt_token_ids"], data["choices"][0]["token_ids"]
    prompt, tokens = None, []
    for chunk in reply:
        data = chunk.model_dump()
        prompt = data.get("prompt_token_ids") or prompt
        for choice in data["choices"]:
            tokens += choice.get("token_ids") or []
    return prompt, tokens


@pytest.fixture(scope="module", params=ONLINE)
def online(request, built):
    """The family's printed endpoints, started once per module and family; SIGTERM in teardown,
    which must be clean (every process of both groups gone, both ports free)."""
    root, jobs = built(request.param)
    served = Online(request.param, root, jobs)
    try:
        yield served
    finally:
        stopped = served.stop()
    assert all(clean and free for clean, _, free in stopped.values()), stopped


def test_printed_endpoints_answer_health_and_models(online):
    for server in online.servers.values():
        assert endpoints.http_status(f"{server.base_url}/health") == 200
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["model"]
    assert [m.id for m in online.client.language.models.list()] == ["model"]


def test_chat_through_both_endpoints_matches_transformers_streamed_and_not(online):
    assert any("images" in r for r in online.requests) and any("images" not in r for r in online.requests)
    for request in online.requests:
        prompt, tokens = ask(online.client, request)
        assert prompt == request["input_ids"], "vLLM's chat prompt differs from the processor's"
        assert tokens == request["reference"], f"greedy tokens differ from transformers: {request['parts']}"
        _, streamed = ask(online.client, request, stream=True)
        assert streamed == tokens
        if online.client.grid and "images" in request:
            assert ask(online.client, request, grid=False) == (prompt, tokens)  # the placeholder grid


@pytest.mark.parametrize("online", FAULTS, indirect=True)
def test_sixteen_concurrent_chats_match_one_at_a_time(online):
    """Mixed image and text-only chats at once on the continuous-batching language endpoint."""
    alone = {r["prompt"]: ask(online.client, r)[1] for r in online.requests}
    mix = [online.requests[i % len(online.requests)] for i in range(CONCURRENT_REQUESTS)]
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        futures = [pool.submit(ask, online.client, r) for r in mix]
        together = [f.result(timeout=300)[1] for f in futures]
    assert together == [alone[r["prompt"]] for r in mix]
    assert together == [r["reference"] for r in mix]


def _timed(call):
    began = time.monotonic()
    try:
        return call(), time.monotonic() - began
    except Exception as error:  # returned, so the test asserts which error and how fast
        return error, time.monotonic() - began


@pytest.mark.parametrize("online", FAULTS, indirect=True)
def test_encode_endpoint_stalled_killed_and_restarted(online):
    """A stalled or dead encode endpoint fails image chats within the stated timeout; text-only
    chats keep being served meanwhile; a restarted encode endpoint serves images again."""
    images = [r for r in online.requests if "images" in r]
    texts = [r for r in online.requests if "images" not in r]
    client = online.make_client(encode_timeout=ENCODE_TIMEOUT_S)
    encode = online.servers["encode"]
    try:
        encode.send(signal.SIGSTOP)  # stalled: accepts the connection, never answers
        error, seconds = _timed(lambda: ask(client, images[0]))
    finally:
        encode.send(signal.SIGCONT)
    assert isinstance(error, EncodeError), error
    assert f"did not answer within {ENCODE_TIMEOUT_S:g} s" in str(error), error
    assert seconds < ENCODE_TIMEOUT_S + ERROR_SLACK_S, seconds

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(ask, client, texts[i % len(texts)]) for i in range(4)]
        encode.send(signal.SIGKILL)  # dies mid-run, text-only chats in flight
        gone = time.monotonic() + 10
        while endpoints.group_alive(encode.process.pid) and time.monotonic() < gone:
            encode.process.poll()
            time.sleep(0.1)
        attempts = [pool.submit(_timed, lambda r=r: ask(client, r)) for r in images]
        in_flight += [pool.submit(ask, client, texts[i % len(texts)]) for i in range(4)]
        for future in attempts:
            error, seconds = future.result(timeout=60)
            assert isinstance(error, EncodeError) and "unreachable" in str(error), error
            assert f"{encode.base_url}/v1" in str(error)
            assert seconds < ENCODE_TIMEOUT_S + ERROR_SLACK_S, seconds
        served = [future.result(timeout=120) for future in in_flight]
    expected = [texts[i % len(texts)]["reference"] for i in [*range(4), *range(4)]]
    assert [tokens for _, tokens in served] == expected
    encode.stop(signal.SIGKILL, timeout=10)  # reap what the kill left
    assert not endpoints.group_alive(encode.process.pid) and endpoints.port_is_free(encode.port)

    encode.start().wait_ready(time.monotonic() + endpoints.START_TIMEOUT_S)  # the printed line again
    for request in images:
        assert ask(client, request)[1] == request["reference"]
