"""On-device sampling end to end (issue 40 item 2): compile with the sampler, then ``run``.

A tiny Qwen2.5-VL spec with ``full_batch_size`` 4 and ``compile.language.sampler`` compiled with
``--backend onnxruntime`` (the precision plan's calibration runs the runtime on the sampler program
too), then served by the runtime, which feeds each request's sampling parameters and seeded random
numbers and reads ``next_tokens``:

* greedy requests through the batched engine (``run --requests``): tokens identical to
  transformers' ``generate``;
* a single sampled run: one seed gives the same tokens run after run, another seed others;
* a sampled request's tokens do not depend on which requests share its decode steps (its random
  numbers come from its own generator).
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


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("sampler-compiled")
    spec = {
        "name": "runtime-tiny-sampler",
        "model": str(tiny_checkpoint("qwen2_5_vl")),
        "full_batch_size": 4,
        "ctx_len": 512,
        "prefill": {"seq_lens": [32, 128]},
        "vision": {"images": [{"height": 112, "width": 112}], "max_images": 1, "vision_size": "chunk"},
        "compile": {"language": {"sampler": {"max_top_k_ids": 32}}},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = root / "out"
    api.compile(root / "spec.yaml", out, backend="onnxruntime", progress=None, status_stream=None)
    helpers.image(112, 112, 0).save(root / "square.png")
    return root


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(["run", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _requests(root, name: str, entries) -> str:
    path = root / name
    path.write_text("\n".join(json.dumps(entry) for entry in entries) + "\n")
    return str(path)


def test_the_compiled_program_returns_tokens(compiled):
    manifest = read_manifest(compiled / "out")
    lang = json.loads((compiled / "out" / "export" / "export.json").read_text())["programs"]["lang"]
    assert "next_tokens" in lang["outputs"] and "logits" not in lang["outputs"]
    assert manifest["programs"]  # compiled (calibration ran the runtime on the sampler program)


def test_greedy_requests_through_the_engine_equal_transformers(compiled, capsys):
    path = _requests(
        compiled,
        "greedy.jsonl",
        [
            {"prompt": "Describe it.", "images": [str(compiled / "square.png")], "max_new_tokens": 6},
            {"prompt": "Tell me a story about a cat.", "max_new_tokens": 6, "arrival_step": 1},
        ],
    )
    code, _, err = _run(capsys, compiled / "out", "--requests", path, "--compare-hf")
    assert code == 0, err
    assert "engine: full_batch_size 4 (one batched call per decode step)" in err
    assert err.count("tokens identical to transformers generate") == 2, err


def _tokens(capsys, compiled, seed: int) -> list[int]:
    code, out, err = _run(
        capsys,
        compiled / "out",
        "--image",
        compiled / "square.png",
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
    first, again, other = (_tokens(capsys, compiled, seed) for seed in (1, 1, 2))
    assert first == again
    assert first != other


def test_a_sampled_requests_tokens_do_not_depend_on_its_neighbours(compiled, capsys):
    request = {
        "prompt": "Describe it.",
        "images": [str(compiled / "square.png")],
        "max_new_tokens": 6,
        "temperature": 1.2,
        "top_k": 10,
        "repetition_penalty": 1.2,
        "seed": 9,
    }
    neighbour = {"prompt": "Tell me a story.", "max_new_tokens": 6, "temperature": 0.7, "seed": 4}

    def tokens(entries, name):
        code, out, err = _run(
            capsys, compiled / "out", "--requests", _requests(compiled, name, entries), "--json"
        )
        assert code == 0, err
        return json.loads(out)["requests"][0]["token_ids"]

    alone = tokens([request], "alone.jsonl")
    shared = tokens([request, neighbour], "shared.jsonl")
    assert alone == shared
