"""``qeff-vision run ART --requests FILE.jsonl``: replies, the table, --compare-hf, bad request files."""

from __future__ import annotations

import json
import re

import pytest

from qeff_vision.cli import main
from tests import helpers
from tests.test_runtime_artifacts import compile_tiny


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory, tiny_checkpoint, exported):
    return compile_tiny(tmp_path_factory, tiny_checkpoint, exported)


@pytest.fixture(scope="module")
def request_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("requests")
    (root / "images").mkdir()
    helpers.image(112, 112, 0).save(root / "images" / "square.png")
    helpers.image(140, 196, 1).save(root / "images" / "wide.png")
    return root


def write_requests(directory, entries, name="requests.jsonl") -> str:
    path = directory / name
    path.write_text("\n".join(e if isinstance(e, str) else json.dumps(e) for e in entries) + "\n")
    return str(path)


def run(capsys, *args):
    code = main(["run", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_requests_file_replies_table_shared_cache_and_compare_hf(artifacts_dir, request_dir, capsys):
    path = write_requests(
        request_dir,
        [
            {"prompt": "Describe it.", "images": ["images/square.png"], "max_new_tokens": 4},
            {"prompt": "Tell me a story about a cat.", "arrival_step": 1, "max_new_tokens": 3},
            {"prompt": "Compare.", "images": ["images/wide.png", "images/square.png"], "arrival_step": 2},
        ],
    )
    code, out, err = run(capsys, artifacts_dir, "--requests", path, "--max-new-tokens", 5, "--compare-hf")
    assert code == 0, err
    assert sorted(re.findall(r"^\[request (\d)\] ", out, re.M)) == ["0", "1", "2"]
    assert re.search(r"request\s+slot\s+arrive\s+admit\s+first\s+done\s+prompt\s+images\s+chunks", err)
    rows = {int(m[0]): m[1:] for m in re.findall(r"^\s+(\d)\s+(\d)\s+(\d)\s+(\d+)\s.*$", err, re.M)}
    assert set(rows) == {0, 1, 2}
    # The square image is encoded for request 0 and found in the shared cache by request 2.
    table = {int(line.split()[0]): line.split() for line in err.splitlines() if re.match(r"^\s+\d\s", line)}
    encoder_calls, cache_hits = table[2][10], table[2][11]
    assert (encoder_calls, cache_hits) == ("1", "1"), table[2]
    assert table[1][7] == "0" and table[1][15] == "3", "text-only request, its own max_new_tokens"
    assert "engine: full_batch_size 1" in err
    assert err.count("tokens identical to transformers generate") == 3


def test_requests_compare_hf_mismatch_exits_1(artifacts_dir, request_dir, capsys, monkeypatch):
    from qeff_vision import reference

    monkeypatch.setattr(reference, "reference_generate", lambda model, processed, n, eos: ([0] * n, []))
    path = write_requests(request_dir, [{"prompt": "Hi", "max_new_tokens": 2}], "one.jsonl")
    code, _, err = run(capsys, artifacts_dir, "--requests", path, "--compare-hf")
    assert code == 1
    assert "compare-hf: request 0: tokens DIFFER" in err


@pytest.mark.parametrize(
    "case, lines, pattern",
    [
        ("not json", ["{prompt: 1}"], r"requests.jsonl:1: not valid JSON"),
        ("not an object", ['["hi"]'], r":1: each line must be a JSON object"),
        ("unknown key", [{"prompt": "hi", "image": []}], r":1: unknown key\(s\) image"),
        ("no prompt", [{"images": []}], r":1: 'prompt' must be a non-empty string"),
        ("images not a list", [{"prompt": "hi", "images": "a.png"}], r"'images' must be a list"),
        ("missing image", ["", {"prompt": "hi", "images": ["gone.png"]}], r":2: image 'gone.png' not found"),
        ("bad arrival", [{"prompt": "hi", "arrival_step": -1}], r"'arrival_step' must be an integer >= 0"),
        (
            "bool tokens",
            [{"prompt": "hi", "max_new_tokens": True}],
            r"'max_new_tokens' must be an integer >= 1",
        ),
        ("empty", [""], r"no requests \(one JSON object per line\)"),
        ("too long", [{"prompt": "x" * 600}], r"request 0: prompt of \d+ tokens \+ 32 new tokens exceeds"),
    ],
)
def test_bad_request_file_is_one_line_and_exit_2(artifacts_dir, tmp_path, capsys, case, lines, pattern):
    path = write_requests(tmp_path, lines)
    code, out, err = run(capsys, artifacts_dir, "--requests", path)
    assert code == 2
    error = err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("qeff-vision: error: "), err
    assert re.search(pattern, error[0]), error[0]
    assert out == ""


def test_requests_exclude_prompt_and_missing_file(artifacts_dir, tmp_path, capsys):
    code, _, err = run(capsys, artifacts_dir, "--requests", tmp_path / "none.jsonl")
    assert code == 2 and "none.jsonl: no such request file" in err
    path = write_requests(tmp_path, [{"prompt": "hi"}])
    code, _, err = run(capsys, artifacts_dir, "--requests", path, "--prompt", "hi")
    assert code == 2 and "--requests takes prompts and images from the file" in err
    code, _, err = run(capsys, artifacts_dir)
    assert code == 2 and "give --prompt TEXT (or --requests FILE.jsonl)" in err


def test_five_staggered_requests_through_a_full_batch_size_4_artifact(
    tmp_path_factory, tiny_checkpoint, cb_exported, request_dir, capsys
):
    """Compiled with full_batch_size 4: one batched decode call per step, the fifth reuses a slot."""
    import yaml

    from qeff_vision import api

    root = tmp_path_factory.mktemp("cb-compiled")
    spec = {
        "name": "runtime-tiny-cb",
        "model": str(tiny_checkpoint("qwen2_5_vl")),
        "full_batch_size": 4,
        "ctx_len": 512,
        "prefill": {"seq_lens": [32, 128]},
        "vision": {
            "images": [{"height": 112, "width": 112}, {"height": 140, "width": 196}],
            "max_images": 2,
            "vision_size": "chunk",
        },
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = root / "out"
    api.compile(
        root / "spec.yaml",
        out,
        backend="onnxruntime",
        export_dir=cb_exported("qwen2_5_vl"),
        progress=None,
        status_stream=None,
    )
    path = write_requests(
        request_dir,
        [
            {"prompt": "Describe it.", "images": ["images/square.png"], "max_new_tokens": 8},
            {"prompt": "Tell me a story about a cat.", "max_new_tokens": 6},
            {"prompt": "Compare.", "images": ["images/wide.png", "images/square.png"], "arrival_step": 1},
            {"prompt": "What is it?", "images": ["images/wide.png"], "max_new_tokens": 3, "arrival_step": 2},
            {"prompt": "Once more, in detail.", "images": ["images/square.png"], "arrival_step": 3},
        ],
        "five.jsonl",
    )
    code, out_text, err = run(capsys, out, "--requests", path, "--max-new-tokens", 8, "--compare-hf")
    assert code == 0, err
    assert "engine: full_batch_size 4 (one batched call per decode step)" in err
    assert err.count("tokens identical to transformers generate") == 5
    table = {int(line.split()[0]): line.split() for line in err.splitlines() if re.match(r"^\s+\d\s", line)}
    slot, admitted = table[4][1], int(table[4][3])
    assert any(row[1] == slot and int(row[5]) < admitted for n, row in table.items() if n < 4), "slot reuse"


def test_requests_json_with_sampling_keys_and_seeds(artifacts_dir, request_dir, capsys):
    """``--json``: one document on stdout; a line's sampling keys override the command's; seeds repeat."""
    entries = [
        {"prompt": "Describe it.", "images": ["images/square.png"], "max_new_tokens": 4, "seed": 3},
        {"prompt": "Tell me a story.", "max_new_tokens": 4, "temperature": 0},
    ]
    path = write_requests(request_dir, entries, "sampled.jsonl")
    options = ("--json", "--temperature", 1.2, "--top-k", 8)
    documents = []
    for _ in range(2):
        code, out, err = run(capsys, artifacts_dir, "--requests", path, *options)
        assert code == 0, err
        documents.append(json.loads(out))
    first = documents[0]
    assert [r["request"] for r in first["requests"]] == [0, 1]
    assert all(len(r["token_ids"]) == 4 and isinstance(r["text"], str) for r in first["requests"])
    assert first["engine"]["full_batch_size"] == 1 and first["requests"][0]["images"] == 1
    assert documents[1]["requests"][0]["token_ids"] == first["requests"][0]["token_ids"], "seeded"
    # The second line's temperature 0 is greedy: the tokens --compare-hf checks without sampling.
    code, out, err = run(capsys, artifacts_dir, "--requests", path, "--json", "--compare-hf")
    assert code == 0, err
    assert json.loads(out)["requests"][1]["token_ids"] == first["requests"][1]["token_ids"]


def test_sampling_with_compare_hf_and_bad_sampling_values_are_refused(artifacts_dir, request_dir, capsys):
    path = write_requests(request_dir, [{"prompt": "Hi", "temperature": 0.8}], "warm.jsonl")
    code, _, err = run(capsys, artifacts_dir, "--requests", path, "--compare-hf")
    assert code == 2 and "--compare-hf compares greedy tokens" in err and "Traceback" not in err
    bad = write_requests(request_dir, [{"prompt": "Hi", "top_p": 1.5}], "bad.jsonl")
    code, _, err = run(capsys, artifacts_dir, "--requests", bad)
    assert code == 2 and "bad.jsonl:1: top_p must be in (0, 1]" in err
    code, _, err = run(capsys, artifacts_dir, "--requests", path, "--top-k", -3)
    assert code == 2 and "top_k must be an integer >= -1" in err
