"""On-device sampling end to end (issue 40 item 2): compile with the sampler, then ``run``.

A tiny Qwen2.5-VL spec with ``full_batch_size`` 4 and ``compile.language.sampler`` compiled with
``--backend onnxruntime`` (the precision plan's calibration runs the runtime on the sampler program
too), then served by the runtime, which feeds each request's sampling parameters and seeded random
numbers and reads ``next_tokens``:

* greedy requests through the batched engine (``run --requests``): tokens identical to
  transformers' ``generate``;
* a single sampled run: one seed gives the same tokens run after run, another seed others;
* a sampled request's tokens do not depend on which requests share its decode steps (its random
  numbers come from its own generator);
* a disaggregated compile samples the tokens the dual one does (the penalty buffers travel with
  the KV hand-off); Llama 3.2 Vision (cross-attention) is served greedy like Qwen2.5-VL.
"""

from __future__ import annotations

import json

import pytest
import yaml

from qeff_vision import api
from qeff_vision.cli import main
from qeff_vision.compile_record import read_manifest
from tests import helpers

SAMPLING = ["--temperature", 1.0, "--top-k", 20, "--top-p", 0.9, "--min-p", 0.05]
PENALTIES = ["--repetition-penalty", 1.3, "--presence-penalty", 0.5]


# Per family: (image, spec keys) of a small continuous-batching spec.
CASES = {
    "qwen2_5_vl": ((112, 112), {"ctx_len": 512, "prefill": {"seq_lens": [32, 128]}}),
    "mllama": ((100, 150), {"ctx_len": 256, "prefill": {"seq_lens": [32]}}),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_checkpoint):
    """``compiled(family, deployment="dual") -> root`` holding OUT (``out``) and its image (``image.png``)."""
    built = {}

    def build(family: str, deployment: str = "dual", seq_lens: tuple[int, ...] | None = None, sampler=True):
        key = (family, deployment, seq_lens, sampler)
        if key not in built:
            (height, width), keys = CASES[family]
            if seq_lens is not None:
                keys = {**keys, "prefill": {"seq_lens": list(seq_lens)}}
            root = tmp_path_factory.mktemp(f"sampler-{family}-{deployment}")
            vision = {"images": [{"height": height, "width": width}], "max_images": 1}
            if family != "mllama":  # a cross-attention family has no image rows in its chunks
                vision["vision_size"] = "chunk"
            spec = {
                "name": f"tiny-sampler-{family}",
                "model": str(tiny_checkpoint(family)),
                "full_batch_size": 4,
                "deployment": deployment,
                **keys,
                "vision": vision,
                "compile": {"language": {"sampler": {"max_top_k_ids": 32}} if sampler else {}},
            }
            (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
            api.compile(
                root / "spec.yaml", root / "out", backend="onnxruntime", progress=None, status_stream=None
            )
            helpers.image(height, width, 0).save(root / "image.png")
            built[key] = root
        return built[key]

    return build


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(["run", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _requests(root, name: str, entries) -> str:
    path = root / name
    path.write_text("\n".join(json.dumps(entry) for entry in entries) + "\n")
    return str(path)


@pytest.mark.parametrize("family", sorted(CASES))
def test_greedy_requests_equal_transformers_through_the_engine_and_alone(compiled, family, capsys):
    """Compiled (the calibration ran the runtime on the sampler program), then greedy == generate."""
    root = compiled(family)
    lang = json.loads((root / "out" / "export" / "export.json").read_text())["programs"]["lang"]
    assert "next_tokens" in lang["outputs"] and "logits" not in lang["outputs"]
    assert read_manifest(root / "out")["programs"]
    path = _requests(
        root,
        "greedy.jsonl",
        [
            {"prompt": "Describe it.", "images": [str(root / "image.png")], "max_new_tokens": 6},
            {"prompt": "Tell me a story about a cat.", "max_new_tokens": 6, "arrival_step": 1},
        ],
    )
    code, _, err = _run(capsys, root / "out", "--requests", path, "--compare-hf")
    assert code == 0, err
    assert "engine: full_batch_size 4 (one batched call per decode step)" in err
    assert err.count("tokens identical to transformers generate") == 2, err
    image = ["--image", root / "image.png", "--prompt", "Describe it.", "--max-new-tokens", 6]
    code, _, err = _run(capsys, root / "out", *image, "--compare-hf")
    assert code == 0 and "compare-hf: tokens identical to transformers generate" in err, err


def _tokens(capsys, root, seed: int) -> list[int]:
    code, out, err = _run(
        capsys,
        root / "out",
        "--image",
        root / "image.png",
        "--prompt",
        "Describe it.",
        "--max-new-tokens",
        8,
        *SAMPLING,
        *PENALTIES,
        "--seed",
        seed,
        "--json",
    )
    assert code == 0, err
    return json.loads(out)["turns"][0]["token_ids"]


def test_a_seed_gives_the_same_tokens_and_another_seed_others(compiled, capsys):
    root = compiled("qwen2_5_vl")
    first, again, other = (_tokens(capsys, root, seed) for seed in (1, 1, 2))
    assert first == again
    assert first != other


def test_a_sampled_requests_tokens_do_not_depend_on_its_neighbours(compiled, capsys):
    root = compiled("qwen2_5_vl")
    request = {
        "prompt": "Describe it.",
        "images": [str(root / "image.png")],
        "max_new_tokens": 6,
        "temperature": 1.2,
        "top_k": 10,
        "repetition_penalty": 1.2,
        "seed": 9,
    }
    neighbour = {"prompt": "Tell me a story.", "max_new_tokens": 6, "temperature": 0.7, "seed": 4}

    alone = _request_tokens(capsys, root, [request], "alone.jsonl")[0]
    shared = _request_tokens(capsys, root, [request, neighbour], "shared.jsonl")[0]
    assert alone == shared


def _request_tokens(capsys, root, entries, name) -> list[list[int]]:
    code, out, err = _run(capsys, root / "out", "--requests", _requests(root, name, entries), "--json")
    assert code == 0, err
    return [request["token_ids"] for request in json.loads(out)["requests"]]


def test_disaggregated_samples_the_tokens_dual_does(compiled, capsys):
    """The prefill program's repetition buffer reaches the decode slot with the KV (the hand-off)."""
    entries = [
        {
            "prompt": "Describe it.",
            "images": [str(compiled("qwen2_5_vl") / "image.png")],
            "max_new_tokens": 8,
            "temperature": 1.1,
            "repetition_penalty": 1.8,
            "presence_penalty": 1.5,
            "top_k": 12,
            "seed": 3,
        },
        {"prompt": "Tell me a story.", "max_new_tokens": 8, "temperature": 0.9, "min_p": 0.1, "seed": 5},
    ]
    dual = _request_tokens(capsys, compiled("qwen2_5_vl"), entries, "sampled.jsonl")
    split = _request_tokens(capsys, compiled("qwen2_5_vl", "disaggregated"), entries, "sampled.jsonl")
    assert dual == split


@pytest.mark.parametrize("sampler", [True, False], ids=["device-sampler", "host-sampler"])
def test_a_seed_gives_the_same_tokens_whatever_the_chunking(compiled, sampler, capsys):
    """Only calls whose token is used take a draw: one chunk or several, alone or not, same tokens."""
    request = {
        "prompt": "Describe this picture in a few words, please.",
        "images": [str(compiled("qwen2_5_vl") / "image.png")],
        "max_new_tokens": 8,
        "temperature": 1.1,
        "top_k": 12,
        "repetition_penalty": 1.3,
        "seed": 7,
    }
    neighbour = {"prompt": "Tell me a story.", "max_new_tokens": 8, "temperature": 0.8, "seed": 2}
    tokens, chunks = [], []
    for seq_lens in ((128,), (16,)):
        root = compiled("qwen2_5_vl", seq_lens=seq_lens, sampler=sampler)
        code, out, err = _run(
            capsys, root / "out", "--requests", _requests(root, "one.jsonl", [request]), "--json"
        )
        assert code == 0, err
        result = json.loads(out)["requests"][0]
        chunks.append(len(result["chunks"]))
        tokens.append(result["token_ids"])
        tokens.append(_request_tokens(capsys, root, [neighbour, request], "two.jsonl")[1])
    assert chunks[0] == 1 and chunks[1] > 1, chunks  # the two bucket sets chunk the prompt differently
    assert all(run == tokens[0] for run in tokens), tokens
