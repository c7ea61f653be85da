"""``deployment: single`` for Llama 3.2 Vision (mllama, the cross-attention kind) vs transformers.

On the session's tiny mllama export: the composed graph against the dual pair (the encode
branch's retained cross K/V equal the vision program's, logits equal the language program's on
them; the keep branch returns the K/V unchanged); two images in 8-token chunks token-identical to
transformers generate with the encoder run once for the prompt; a three-turn conversation with a
text-only turn. An mllama image is one ``<|image|>`` token, so no image can straddle chunks: the
"image straddling chunks" case does not apply (the prompt below has a chunk with no image token
between the two images instead). Then the CLI: ``compile --backend onnxruntime`` of a single spec
(one program ``lang``, every specialization run), the stand-in compiler, ``run`` over two images
and three turns with ``--compare-hf`` and the encoder runs printed; ``full_batch_size`` refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from qeff_vision.cli import main
from qeff_vision.compile.single_program import write_single_program
from qeff_vision.export_record import read_export
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.runtime.single import batched_images, placeholder_feeds
from qeff_vision.runtime.single_cross import SingleCrossGenerator
from tests import helpers
from tests.compile_fixtures import REPO
from tests.family_runtime import CTX_LEN, NEW_TOKENS, FamilyRuntime

FAMILY = "mllama"
SLOTS = 2  # image slots of the retained cross K/V (max_images)
ROWS = 4 * 17  # one tiny image's cross states: 4 tiles x (4 x 4 patches + 1)
BETWEEN = "A long pause of plain words, nothing but text between the two pictures here. " * 2


@pytest.fixture(scope="module")
def single(exported, hf_model):
    """(runtime harness, composed program) of the tiny mllama export."""
    export_dir = exported(FAMILY)
    manifest = read_export(export_dir)
    path = write_single_program(
        export_dir,
        export_dir / manifest["programs"]["vision"]["path"],
        export_dir / manifest["programs"]["lang"]["path"],
    )
    return FamilyRuntime(FAMILY, export_dir, *hf_model(FAMILY)), OnnxProgram(path)


def _generator(runtime: FamilyRuntime, program: OnnxProgram, seq_len: int = 8) -> SingleCrossGenerator:
    shape = LanguageShape((PrefillBucket(seq_len, 1),), 1, CTX_LEN)
    return SingleCrossGenerator(runtime.checkpoint, program, shape, image_slots=SLOTS)


def test_composed_graph_equals_the_dual_pair(single):
    runtime, program = single
    images = [helpers.image(100, 150, 1), helpers.image(300, 120, 2)]
    processed = runtime.inputs(["<image>", "and", "<image>", "Compare."], images)
    generator = _generator(runtime, program)
    per_image = runtime.checkpoint.host.vision_inputs(processed)
    # The dual pair: the vision program once per image, its K/V concatenated in slot order.
    states = [runtime.vision.run(inputs) for inputs in per_image]
    cross = {name: np.concatenate([s[name] for s in states], axis=2) for name in generator.cross_names}
    assert all(value.shape[2] == SLOTS * ROWS for value in cross.values())
    input_ids = processed["input_ids"].reshape(-1)
    first = generator.plan(input_ids[:8], {}, "chunk").chunks[0]  # the prompt's first 8 tokens
    mask = generator._cross_mask(processed, len(input_ids))
    feeds = generator.chunk_feeds(first, mask, input_ids, runtime.checkpoint.host.prompt_positions(processed))
    past = generator.empty_cache()
    dual = runtime.language.run({**feeds, **past, **cross})
    pixels = batched_images(program, generator.image_inputs, per_image)
    assert pixels["pixel_values"].shape[:2] == (1, 2)
    slot = {"first_image_slot": np.zeros(1, np.int64)}
    encode = program.run({**feeds, **past, **pixels, **slot})  # the cross caches zero: the encoder fills them
    for name in generator.cross_names:
        assert np.abs(encode[f"{name}_RetainedState"] - cross[name]).max() < 1e-5, name
    assert np.abs(encode["logits"] - dual["logits"]).max() < 1e-5
    # A later turn's image goes to the next slot: slot 0 (an earlier turn's image) is kept. And an
    # encode from slot 0 clears the slots after the images it writes (no stale K/V stay behind).
    second = batched_images(program, generator.image_inputs, per_image[1:])
    held = {
        name: np.concatenate([cross[name][:, :, :ROWS], np.ones_like(cross[name][:, :, ROWS:])], 2)
        for name in cross
    }
    later = program.run({**feeds, **past, **held, **second, "first_image_slot": np.ones(1, np.int64)})
    first_only = program.run(
        {**feeds, **past, **cross, **batched_images(program, generator.image_inputs, per_image[:1]), **slot}
    )
    for name in generator.cross_names:
        assert np.abs(later[f"{name}_RetainedState"] - cross[name]).max() < 1e-5, name
        written = first_only[f"{name}_RetainedState"]
        assert np.abs(written[:, :, :ROWS] - cross[name][:, :, :ROWS]).max() < 1e-5, name
        assert not written[:, :, ROWS:].any(), name
    keep = program.run({**feeds, **past, **cross, **_placeholder(program, generator)})
    for name in generator.cross_names:
        assert np.array_equal(keep[f"{name}_RetainedState"], cross[name]), name
    assert np.array_equal(keep["logits"], dual["logits"])


def _placeholder(program: OnnxProgram, generator: SingleCrossGenerator) -> dict[str, np.ndarray]:
    """The keep entries' image inputs: side 1, one image, the aspect-ratio inputs int64."""
    feeds = placeholder_feeds(program, generator.image_inputs)
    assert feeds["pixel_values"].shape == (1, 1, 4, 3, 1, 1)
    assert feeds["aspect_ratio_ids"].dtype == feeds["aspect_ratio_mask"].dtype == np.int64
    return {**feeds, "first_image_slot": np.zeros(1, np.int64)}


def test_two_images_chunked_match_transformers_and_encode_once(single):
    runtime, program = single
    images = [helpers.image(100, 150, 3), helpers.image(300, 120, 4)]
    processed = runtime.inputs(["<image>", BETWEEN, "<image>", "What changed?"], images)
    # One <|image|> token per image: nothing to straddle a chunk boundary.
    assert runtime.checkpoint.host.placeholder_counts(processed) == [1, 1]
    generator = _generator(runtime, program)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, "mllama single, two images in chunks of 8")
    image_token = int(runtime.config["image_token_index"])
    chunk_of = np.flatnonzero(processed["input_ids"][0] == image_token) // 8
    assert chunk_of[1] - chunk_of[0] >= 2  # a chunk between them holds no image token
    assert (result.encoder_calls, result.images_encoded) == (1, 2)
    assert [chunk.images_encoded for chunk in result.chunks] == [2] + [0] * (len(result.chunks) - 1)
    sent = [chunk.vision_bytes for chunk in result.chunks]
    assert sent[0] > 0 and not any(sent[1:])  # the pixels cross once; later chunks send a placeholder
    assert result.vision_input == "pixel_values + aspect_ratio_ids + aspect_ratio_mask"
    # The next prompt, text only, on the same program: the retained K/V of the two images stay in
    # the caches, and neither its mask (every slot unused) nor its values let a token see them.
    text_only = runtime.inputs(["Tell me a story about a lighthouse."], [])
    result = generator.generate(text_only, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, text_only, "mllama single, text-only prompt after two images")
    assert (result.encoder_calls, result.images_encoded) == (0, 0)
    # Then one image: slot 0 rewritten, slot 1 keeps the stale second image, masked as unused.
    one = runtime.inputs(["<image>", "Describe it."], [helpers.image(60, 250, 9)])
    result = generator.generate(one, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, one, "mllama single, one image after two")
    assert (result.encoder_calls, result.images_encoded) == (1, 1)


def test_three_turn_conversation(single):
    runtime, program = single
    chat = Conversation(_generator(runtime, program, 16), runtime.processor, max_new_tokens=NEW_TOKENS)
    first, second = helpers.image(100, 150, 5), helpers.image(300, 120, 6)
    results = runtime.three_turns(chat, first, second, "mllama single")
    # Each turn renders the whole conversation (what transformers is given). The text-only turn
    # keeps the prefix the program holds; the third turn encodes only its new image, into slot 1,
    # while the first image's K/V stay in slot 0. Its text is prefilled again: in transformers the
    # tokens before the first image attend uniformly to every image of the prompt.
    assert [r.images_encoded for r in results] == [1, 0, 1]
    assert [r.encoder_calls for r in results] == [1, 0, 1]
    prefilled = [sum(chunk.tokens for chunk in r.chunks) for r in results]
    assert prefilled[0] == results[0].prompt_tokens and prefilled[2] == results[2].prompt_tokens
    assert prefilled[1] <= results[1].prompt_tokens - results[0].prompt_tokens
    held = results[1].prompt_tokens - prefilled[1]
    assert f"{held} of {results[1].prompt_tokens} prompt tokens already held" in results[1].notes[-1]
    assert "1 image(s) kept in their slots, not encoded again" in results[2].notes[-1]
    assert results[2].served == [
        "image 1: K/V held from an earlier turn",
        "image 2: encoded inside the single program",
    ]


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, exported, tmp_path_factory):
    """Tiny mllama compiled ``deployment: single`` on the onnxruntime backend, two images beside it."""
    root = tmp_path_factory.mktemp("single-mllama")
    spec = {
        "name": "mllama-single",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 256,
        "deployment": "single",
        "prefill": {"seq_lens": [8, 32]},
        "vision": {"images": [{"height": 100, "width": 150}], "max_images": SLOTS},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    args = ["compile", str(root / "spec.yaml"), "-o", str(root / "out"), "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported(FAMILY))]) == 0
    for name, (height, width) in {"a": (100, 150), "b": (300, 120)}.items():
        helpers.image(height, width, len(name)).save(root / f"{name}.png")
    return root


def test_compile_lists_one_program_and_runs_every_specialization(compiled):
    manifest = json.loads((compiled / "out" / "manifest.json").read_text())
    assert manifest["deployment"] == "single" and list(manifest["programs"]) == ["lang"]
    lang = manifest["programs"]["lang"]
    names = [entry["name"] for entry in lang["specializations"]]
    assert names == [
        "Encode-8-1x100x150", "Encode-8-2x100x150", "Prefill-8",
        "Encode-32-1x100x150", "Encode-32-2x100x150", "Prefill-32", "Decode",
    ]  # fmt: skip
    encode, keep = lang["specializations"][1]["symbols"], lang["specializations"][2]["symbols"]
    # The encoded image count is num_images; the mask's slots and the K/V rows stay the program's.
    assert (encode["num_images"], encode["pixel_side"], encode["max_num_images"]) == ("2", "56", str(SLOTS))
    assert (keep["num_images"], keep["pixel_side"], keep["cross_states"]) == ("1", "1", str(SLOTS * ROWS))
    assert len(lang["verification"]["runs"]) == len(names)  # each run on onnxruntime
    assert lang["onnx"].endswith("single.onnx")


def test_run_shows_the_encoder_runs_and_matches_transformers(compiled, capsys):
    out = str(compiled / "out")
    images = ["--image", str(compiled / "a.png"), "--image", str(compiled / "b.png")]
    turns = ["--prompt", "Compare.", "--prompt", "And the colours?", "--prompt", "Thanks."]
    assert main(["run", out, *images, *turns, "--max-new-tokens", "4", "--compare-hf"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 3
    # Turn one encodes both images in its first chunk; the follow-ups read the retained K/V.
    assert err.count("1 encoder call(s) encoding 2 image(s)") == 1
    assert err.count("0 encoder call(s) encoding 0 image(s)") == 2
    assert err.count("K/V held from an earlier turn") == 4
    # The follow-ups prefill only their new tokens (the run prints how many were held).
    assert err.count("prompt tokens already held by the program (earlier turns)") == 2
    assert "bytes of pixel_values + aspect_ratio_ids + aspect_ratio_mask sent" in err


def test_stand_in_compiler_takes_the_single_program(compiled, exported, tmp_path):
    """The stand-in compiler (which checks every specialization binds the graph's symbols) takes it."""
    from qeff_vision.compile.driver import compile_spec
    from tests.compile_fixtures import calls, stand_in

    compiler, record = stand_in(tmp_path)
    outcome = compile_spec(
        compiled / "spec.yaml",
        tmp_path / "out",
        compiler=compiler,
        export_dir=exported(FAMILY),
        progress=None,
        status_stream=None,
        env={},
    )
    (call,) = calls(record)
    assert list(outcome.manifest["programs"]) == ["lang"]
    assert any(arg.startswith("-m=") and arg.endswith("single.onnx") for arg in call["argv"])


def test_full_batch_size_is_refused_in_one_line(tmp_path, capsys):
    data = yaml.safe_load(
        (REPO / "specs" / "mllama" / "llama-3.2-11b-vision-instruct-single.yaml").read_text()
    )
    data["config"] = str(REPO / "specs" / "configs" / "Llama-3.2-11B-Vision-Instruct" / "config.json")
    data["full_batch_size"] = 4
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "full_batch_size: deployment single serves one sequence (batch 1); remove full_batch_size" in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "full_batch_size" in line]) == 1


def test_run_requests_is_refused_in_one_line(compiled, capsys):
    (compiled / "requests.jsonl").write_text(json.dumps({"prompt": "Hi.", "images": ["a.png"]}) + "\n")
    assert main(["run", str(compiled / "out"), "--requests", str(compiled / "requests.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "deployment single serves one sequence at a time" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
