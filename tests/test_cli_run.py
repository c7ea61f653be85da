"""``qeff-vision run`` on a compiled tiny artifact directory: streaming, report, --compare-hf, bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from qeff_vision.cli import main
from qeff_vision.runtime.session import qaic_runtime_available
from tests import helpers
from tests.test_runtime_artifacts import compile_tiny


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory, tiny_checkpoint, exported):
    return compile_tiny(tmp_path_factory, tiny_checkpoint, exported)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-images")
    paths = {}
    sizes = {"square": (112, 112, 0), "wide": (140, 196, 1), "odd": (300, 420, 2)}
    for name, (height, width, seed) in sizes.items():
        paths[name] = root / f"{name}.png"
        helpers.image(height, width, seed).save(paths[name])
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    paths["broken"] = root / "broken.png"
    return paths


def run(capsys, *args):
    code = main(["run", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_streams_the_reply_and_reports_chunks_and_parity(artifacts_dir, image_files, capsys):
    code, out, err = run(
        capsys,
        artifacts_dir,
        "--image",
        image_files["square"],
        "--image",
        image_files["wide"],
        "--prompt",
        "Compare the two pictures.",
        "--max-new-tokens",
        6,
        "--compare-hf",
    )
    assert code == 0, err
    assert out.endswith("\n") and out.strip()
    assert "prompt " in err and "2 image(s) = 51 vision rows; protocol chunk" in err
    header = r"chunk\s+tokens/S\s+rows/V\s+vision bytes\s+images encoded\s+encode ms\s+prefill ms"
    assert re.search(header, err)
    # Chunk-local rows: the first chunk sends both images' first rows, padded to its V (64 x 64 floats).
    assert re.search(r"\n\s+0\s+64/64\s+\d+/64\s+16,384\s+2\s", err)
    assert "TTFT " in err and "tokens/s" in err
    assert "2 encoder call(s) encoding 2 image(s); 0 cache hit(s)" in err
    assert "compare-hf: tokens identical to transformers generate (6 tokens)" in err


def test_run_full_protocol_and_resize_note(artifacts_dir, image_files, capsys):
    code, out, err = run(
        capsys,
        artifacts_dir,
        "--image",
        image_files["odd"],
        "--prompt",
        "What is it?",
        "--max-new-tokens",
        4,
        "--vision-protocol",
        "full",
    )
    assert code == 0, err
    assert f"note: {image_files['odd']}: resized from 300x420 to 140x196" in err
    assert "protocol full" in err
    assert "compare-hf" not in err


def test_several_prompts_make_one_conversation_with_cached_images(artifacts_dir, image_files, capsys):
    code, out, err = run(
        capsys,
        artifacts_dir,
        "--image",
        image_files["square"],
        "--prompt",
        "Describe it.",
        "--prompt",
        "Again, shorter.",
        "--max-new-tokens",
        4,
        "--compare-hf",
    )
    assert code == 0, err
    assert "[turn 1] Describe it." in err and "[turn 2] Again, shorter." in err
    summaries = re.findall(r"(\d+) encoder call\(s\) encoding (\d+) image\(s\); (\d+) cache hit\(s\)", err)
    # Turn two keeps turn one's prompt and image in the language program's KV: nothing encoded,
    # nothing fetched, only the rest prefilled.
    assert summaries == [("1", "1", "0"), ("0", "0", "0")]
    assert "vision: image 1: KV held from an earlier turn" in err
    assert re.search(r"note: \d+ of \d+ prompt tokens already held by the program", err)
    assert err.count("compare-hf: tokens identical") == 2


def test_compare_hf_mismatch_exits_1(artifacts_dir, image_files, capsys, monkeypatch):
    from qeff_vision import reference

    monkeypatch.setattr(reference, "reference_generate", lambda model, processed, n, eos: ([0] * n, []))
    args = [artifacts_dir, "--image", image_files["square"], "--prompt", "Hi", "--max-new-tokens", 3]
    code, _, err = run(capsys, *args, "--compare-hf")
    assert code == 1
    assert "compare-hf: tokens DIFFER from transformers generate at step 0" in err


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("no manifest", r"no manifest.json; run `qeff-vision compile` into it first"),
        ("missing image", r"missing.png: no such image file"),
        ("unreadable image", r"broken.png: not a readable image"),
        ("prompt too long", r"prompt of \d+ tokens \+ 32 new tokens exceeds the compiled ctx_len 512"),
        ("too many new tokens", r"exceeds the compiled ctx_len 512 \(at most \d+ new tokens fit\)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(artifacts_dir, image_files, tmp_path, capsys, case, pattern):
    args = {
        "no manifest": [tmp_path, "--prompt", "hi"],
        "missing image": [artifacts_dir, "--image", tmp_path / "missing.png", "--prompt", "hi"],
        "unreadable image": [artifacts_dir, "--image", image_files["broken"], "--prompt", "hi"],
        "prompt too long": [artifacts_dir, "--image", image_files["square"], "--prompt", "x" * 600],
        "too many new tokens": [artifacts_dir, "--prompt", "hi", "--max-new-tokens", 600],
    }[case]
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qeff-vision: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert out == ""


def test_qaic_artifacts_without_the_sdk_runtime_exit_2(artifacts_dir, tmp_path, capsys):
    if qaic_runtime_available():
        pytest.skip("the SDK runtime is installed here")
    copy = tmp_path / "qaic-out"
    shutil.copytree(artifacts_dir, copy, ignore=shutil.ignore_patterns("export"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(backend="qaic", export={"dir": str((artifacts_dir / "export").resolve())})
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run(capsys, copy, "--prompt", "hi")
    assert code == 2
    assert err.count("\n") == 1 and "needs the Cloud AI 100 runtime (qaicrt" in err


def test_run_help_does_not_import_torch():
    code = (
        "import sys; from qeff_vision.cli import main; "
        "rc = main(['run', '--help']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--vision-protocol [chunk|full]" in done.stdout and "--compare-hf" in done.stdout


def test_an_image_shown_in_turn_three_is_encoded_there_and_held_after(artifacts_dir, image_files, capsys):
    code, out, err = run(
        capsys,
        artifacts_dir,
        "--image",
        image_files["square"],
        "--prompt",
        "Describe it.",
        "--prompt",
        "Shorter.",
        "--turn-image",
        3,
        image_files["wide"],
        "--prompt",
        "And this one?",
        "--prompt",
        "Which is wider?",
        "--max-new-tokens",
        4,
        "--compare-hf",
    )
    assert code == 0, err
    turns = re.split(r"\[turn \d\] ", err)[1:]
    assert len(turns) == 4
    summaries = [re.findall(r"(\d+) encoder call\(s\) encoding (\d+) image\(s\)", turn) for turn in turns]
    # Turn 3 encodes only its new image; turn 4 holds both in the language program's KV.
    assert summaries == [[("1", "1")], [("0", "0")], [("1", "1")], [("0", "0")]]
    assert "1 image(s) = 16 vision rows" in turns[0] and "2 image(s) = 51 vision rows" in turns[2]
    held = r"note: (\d+) of (\d+) prompt tokens already held by the program"
    assert [bool(re.search(held, turn)) for turn in turns] == [False, True, True, True]
    assert "vision: image 1: KV held from an earlier turn" in turns[2]
    assert "vision: image 2: KV held from an earlier turn" in turns[3]
    assert "image 2: KV held" not in turns[2]
    # Every turn against transformers on the whole rendered conversation.
    assert [turn.count("compare-hf: tokens identical") for turn in turns] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--prompt", "a", "--prompt", "b", "--turn-image", 3, "IMG"],
            "--turn-image 3: the conversation has 2 turn(s)",
        ),
        (["--prompt", "a", "--turn-video", 2, "CLIP"], "--turn-video 2: the conversation has 1 turn(s)"),
        (
            ["--requests", "REQ", "--turn-image", 1, "IMG"],
            "--requests takes prompts and images from the file",
        ),
        (["--prompt", "a", "--turn-image", 0, "IMG"], "Invalid value for '--turn-image'"),
        (["--prompt", "a", "--turn-image", 1], "requires 2 arguments"),
    ],
)
def test_bad_turn_media_is_one_line_and_exit_2(artifacts_dir, image_files, tmp_path, capsys, args, message):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "hi", "images": []}) + "\n")
    swap = {"IMG": image_files["square"], "CLIP": tmp_path, "REQ": requests}
    code, out, err = run(capsys, artifacts_dir, *[swap.get(arg, arg) for arg in args])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qeff-vision: error: "), err
    assert message in lines[0], lines[0]
    assert out == ""


def test_media_by_turn_keeps_command_line_order_and_refuses_a_turn_beyond_the_prompts():
    from qeff_vision.cli.run import by_turn
    from qeff_vision.errors import UserError
    from qeff_vision.inputs.prompt import media_by_turn

    grouped = by_turn([(3, "b"), (1, "x"), (3, "c")])
    assert grouped == {3: ["b", "c"], 1: ["x"]}
    assert media_by_turn(["a"], grouped, 3, "image") == [["a", "x"], [], ["b", "c"]]
    assert media_by_turn(["a"], None, 2, "image") == [["a"], []]  # the Python API's old meaning
    with pytest.raises(UserError, match="image for turn 3, but the conversation has 2 turn"):
        media_by_turn([], {3: ["b"]}, 2, "image")


def test_run_json_prints_one_document_and_seeded_sampling_repeats(artifacts_dir, image_files, capsys):
    """``--json``: the turns' text, token ids and counts as one JSON document (no streamed reply)."""
    args = (artifacts_dir, "--image", image_files["square"], "--prompt", "Describe it.", "--prompt", "More?")
    code, out, err = run(capsys, *args, "--max-new-tokens", 4, "--json", "--compare-hf")
    assert code == 0, err
    turns = json.loads(out)["turns"]
    assert [turn["turn"] for turn in turns] == [1, 2] and turns[1]["prompt"] == "More?"
    assert all(turn["compare_hf"]["identical"] for turn in turns)
    first = turns[0]
    assert first["images"] == 1 and len(first["token_ids"]) <= 4 and first["encoder_calls"] == 1
    assert len(first["chunks"]) >= 1 and first["prefilled_tokens"] == first["prompt_tokens"]
    assert turns[1]["prefilled_tokens"] < turns[1]["prompt_tokens"], "the second turn keeps the prefix"
    sampled = ("--temperature", 1.5, "--top-k", 20, "--seed", 5, "--max-new-tokens", 6, "--json")
    replies = []
    for _ in range(2):
        code, out, err = run(capsys, artifacts_dir, "--prompt", "Tell me a story.", *sampled)
        assert code == 0, err
        replies.append(json.loads(out)["turns"][0]["token_ids"])
    assert replies[0] == replies[1], "the same seed gives the same tokens"
    code, _, err = run(capsys, artifacts_dir, "--prompt", "Hi", "--temperature", 0.5, "--compare-hf")
    assert code == 2 and "--compare-hf compares greedy tokens" in err
