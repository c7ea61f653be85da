"""``deployment: single``: one program holding the encoder, each image encoded once, vs transformers.

Per enabled family of the token-merge kind (llava, gemma3, internvl, llava_next, llama4, mistral3,
qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, gemma4, glm4v), on the session's tiny export:
the composed graph (``compile/single_program.py``) against the dual pair (the encode branch's
retained rows equal the vision program's, logits equal the language program's on those rows; the
keep branch returns the buffer unchanged); chunked runs of two images token-identical to
transformers generate with the encoder run once for the prompt (an image straddling chunks wherever
the decoder is causal over image tokens: all but Gemma 3); a three-turn conversation. Then the CLI
on tiny LLaVA: ``compile --backend onnxruntime`` of a single spec (one program ``lang``, every
specialization run), ``run`` over two images and three turns with ``--compare-hf``, the encoder
runs printed; ``compile --backend onnxruntime`` of tiny LLaVA-NeXT, Llama 4, Mistral 3, the five
Qwen-VL families and Gemma 4; ``full_batch_size`` refused for every golden single spec. The patch-
sequence families (Qwen-VL, Gemma 4) gate the encoder on their declared patch axis; Qwen3-VL's
deepstack rows are a second retained buffer, checked beside ``vision_embeds``; the parity chunk
holds image placeholders so its logits read the rows.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml

from qeff_vision.cli import main
from qeff_vision.compile.single_program import write_single_program
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.export_record import read_export
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.runtime.artifacts import load_artifacts, open_programs
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.runtime.single import SingleGenerator, batched_images
from tests import helpers
from tests.compile_fixtures import REPO
from tests.family_runtime import CTX_LEN, NEW_TOKENS, FamilyRuntime

QWEN = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
FAMILIES = ["llava", "gemma3", "internvl", "llava_next", "llama4", "mistral3", *QWEN, "gemma4", "glm4v"]
# 8- and 16-token chunks cut an image (Gemma 3's bidirectional images never are).
SEQ_LENS = {
    "llava": (8,),
    "gemma3": (24,),
    "internvl": (16,),
    "llava_next": (16,),
    "llama4": (16,),
    "mistral3": (8,),
    **dict.fromkeys([*QWEN, "gemma4", "glm4v"], (16,)),
}
MAX_IMAGES = 2
# One encode call takes images of one size: LLaVA-NeXT's images share the tile and feature grids,
# Mistral 3's the pixel grid (their shapes are graph symbols). Two images of different sizes are
# then two encode calls in the first chunk, each writing its rows from its image_idx. So are the
# patch sequences': Qwen-VL's grid graph reads one grid from image_grid_thw's shape, Gemma 4's
# [n, max_patches, patch_dim] batch shares one patch count. GLM-4.1V's grid rides as Qwen-VL's.
ONE_SIZE_PER_CALL = {"llava_next", "mistral3", *QWEN, "gemma4", "glm4v"}


def _pair(runtime: FamilyRuntime, one_call: bool = False) -> tuple[tuple[int, int], tuple[int, int]]:
    """The sizes of a prompt's two test images: the family's first and last (``one_call``: the
    first twice where one encode call takes images of one size)."""
    sizes = load_adapter(runtime.family).test_image_sizes
    same = one_call and runtime.family.name in ONE_SIZE_PER_CALL
    return (sizes[0], sizes[0] if same else sizes[-1])


def _calls(family: str) -> int:
    """Encode calls for the two test images of :func:`_pair` (different sizes)."""
    return 2 if family in ONE_SIZE_PER_CALL else 1


@pytest.fixture(scope="module", params=FAMILIES)
def single(request, exported, hf_model):
    """(runtime harness, composed program) of one family."""
    family = request.param
    export_dir = exported(family)
    manifest = read_export(export_dir)
    path = write_single_program(
        export_dir,
        export_dir / manifest["programs"]["vision"]["path"],
        export_dir / manifest["programs"]["lang"]["path"],
    )
    return FamilyRuntime(family, export_dir, *hf_model(family)), OnnxProgram(path)


def _generator(runtime: FamilyRuntime, program: OnnxProgram) -> SingleGenerator:
    rows = MAX_IMAGES * _tokens(runtime)  # the retained buffer: the most rows one request carries
    buckets = tuple(PrefillBucket(s, rows) for s in SEQ_LENS[runtime.family.name])
    return SingleGenerator(runtime.checkpoint, program, LanguageShape(buckets, rows, CTX_LEN))


def _tokens(runtime: FamilyRuntime) -> int:
    """Rows of the largest test image of the tiny checkpoint (the processor's placeholder count)."""
    rows = []
    for size in load_adapter(runtime.family).test_image_sizes:  # InternVL: tile counts differ
        processed = runtime.inputs(["<image>", "x"], [helpers.image(*size, 1)])
        rows.append(int(sum(runtime.checkpoint.host.placeholder_counts(processed))))
    return max(rows)


def test_composed_graph_equals_the_dual_pair(single):
    runtime, program = single
    first, second = _pair(runtime, one_call=True)
    processed = runtime.inputs(
        ["<image>", "<image>", "Compare."], [helpers.image(*first, 1), helpers.image(*second, 2)]
    )
    generator = _generator(runtime, program)
    # Both images in one batch of every vision input (LLaVA-NeXT's grid carriers too), as the
    # runtime sends them; the dual vision program takes the same names.
    pixels = batched_images(program, generator.image_inputs, runtime.checkpoint.host.vision_inputs(processed))
    outputs = runtime.vision.run(pixels)
    buffers = {}  # every retained row buffer (vision_embeds, Qwen3-VL's deepstack_features) + 3 rows
    for row in generator.io.rows(Role.VISION_ROWS):
        out = outputs[row.name]  # [n, T, H], or [depth, n, T, H] for stacked rows
        flat = out.reshape(*out.shape[:-3], 1, -1, out.shape[-1])
        buffer = np.zeros((*flat.shape[:-2], flat.shape[-2] + 3, out.shape[-1]), np.float32)
        buffer[..., : flat.shape[-2], :] = flat
        buffers[row.name] = buffer
    # Image placeholders in the chunk, so the logits read the rows.
    tokens = np.arange(8, dtype=np.int64)[None] % 50
    tokens[0, 2:6] = runtime.config[runtime.family.image_token_key]
    positions = np.arange(8, dtype=np.int64)[None]
    if runtime.family.position_id_rows:
        positions = np.repeat(positions[None], runtime.family.position_id_rows, axis=0)
    by_role = {
        Role.TOKEN_IDS: tokens,
        Role.POSITIONS: positions,
        Role.VISION_CURSOR: np.zeros((1, 1), np.int64),
    }
    # The KV alone (the cache also holds the row buffers): each call below feeds its own rows.
    past = {name: cache for name, cache in generator.empty_cache().items() if name not in buffers}
    zeros = {name: np.zeros_like(buffer) for name, buffer in buffers.items()}
    dual = runtime.language.run({**generator.io.feeds({**by_role, Role.VISION_ROWS: buffers}), **past})
    encode = program.run({**generator.io.feeds({**by_role, Role.VISION_ROWS: zeros}), **past, **pixels})
    # float32 rounding relative to the values' scale (onnxruntime fuses the composed graph's
    # kernels differently: LLaVA-NeXT's rows reach ~12, and differ by ~1e-5 there).
    for name, buffer in buffers.items():
        scale = max(1.0, float(np.abs(buffer).max()))
        assert np.abs(encode[f"{name}_RetainedState"] - buffer).max() < 1e-5 * scale, name
    # The chunk reads the rows: their float noise reaches the logits.
    logits_scale = max(1.0, float(np.abs(dual["logits"]).max()))
    assert np.abs(encode["logits"] - dual["logits"]).max() <= 1e-4 * logits_scale
    keep = program.run(
        {**generator.io.feeds({**by_role, Role.VISION_ROWS: buffers}), **past, **generator._placeholder()}
    )
    for name, buffer in buffers.items():
        assert np.array_equal(keep[f"{name}_RetainedState"], buffer), name
    assert np.array_equal(keep["logits"], dual["logits"])


def test_two_images_chunked_match_transformers_and_encode_once(single):
    runtime, program = single
    first, second = _pair(runtime)
    images = [helpers.image(*first, 3), helpers.image(*second, 4)]
    processed = runtime.inputs(
        ["<image>", "A first picture, then a second one.", "<image>", "What changed?"], images
    )
    if runtime.family.name == "internvl":  # one encode call over images of different tile counts
        assert len(set(runtime.checkpoint.host.tiles_per_image(processed))) == 2
    generator = _generator(runtime, program)
    plan = generator.plan(processed["input_ids"].reshape(-1), processed, "chunk")
    assert len(plan.chunks) >= 3
    if runtime.family.features.chunk_split.supported:  # an image straddles chunks
        cuts = [c.start for c in plan.chunks]
        assert any(seg.start < cut < seg.stop for seg in plan.segments for cut in cuts)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, f"{runtime.family.name} single")
    assert (result.encoder_calls, result.images_encoded) == (_calls(runtime.family.name), 2)
    assert len(set(map(str, [first, second]))) == 2  # two resolutions in one prompt
    assert [chunk.images_encoded for chunk in result.chunks] == [2] + [0] * (len(result.chunks) - 1)


def test_three_turn_conversation(single):
    runtime, program = single
    sizes = load_adapter(runtime.family).test_image_sizes
    chat = Conversation(_generator(runtime, program), runtime.processor, max_new_tokens=NEW_TOKENS)
    first, second = helpers.image(*sizes[0], 5), helpers.image(*sizes[-1], 6)
    results = runtime.three_turns(chat, first, second, runtime.family.name)
    # Each turn renders the whole conversation (what transformers is given), but the program keeps
    # the prefix it holds: only the rest is prefilled, and only the third turn's new image encoded.
    assert [r.images_encoded for r in results] == [1, 0, 1]
    assert [r.encoder_calls for r in results] == [1, 0, 1]
    assert results[2].served == [
        "image 1: KV held from an earlier turn",
        "image 2: encoded inside the single program",
    ]
    with pytest.raises(UserError, match="pass no history"):  # the program continues what it holds
        chat.generator.generate(chat.last_inputs.processed, history=results[2].continuation)
    prefilled = [sum(chunk.tokens for chunk in r.chunks) for r in results]
    assert prefilled[0] == results[0].prompt_tokens
    for before, after, tokens in zip(results, results[1:], prefilled[1:]):
        # At most the last reply (as the template renders it) and the new turn are prefilled.
        assert tokens <= after.prompt_tokens - before.prompt_tokens, (tokens, after.prompt_tokens)
        assert (
            f"{after.prompt_tokens - tokens} of {after.prompt_tokens} prompt tokens already held"
            in after.notes[-1]
        )


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, exported, tmp_path_factory):
    """Tiny LLaVA compiled ``deployment: single`` on the onnxruntime backend, two images beside it."""
    root = tmp_path_factory.mktemp("single-llava")
    spec = {
        "name": "llava-single",
        "model": str(tiny_checkpoint("llava")),
        "ctx_len": 256,
        "deployment": "single",
        "prefill": {"seq_lens": [8, 32]},
        "vision": {"images": [{"height": 336, "width": 336}], "max_images": 2},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    args = ["compile", str(root / "spec.yaml"), "-o", str(root / "out"), "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported("llava"))]) == 0
    for name, (height, width) in {"a": (112, 112), "b": (140, 196)}.items():
        helpers.image(height, width, len(name)).save(root / f"{name}.png")
    return root


def test_compile_lists_one_program_and_runs_every_specialization(compiled):
    manifest = json.loads((compiled / "out" / "manifest.json").read_text())
    assert manifest["deployment"] == "single" and list(manifest["programs"]) == ["lang"]
    lang = manifest["programs"]["lang"]
    names = [entry["name"] for entry in lang["specializations"]]
    assert names == [
        "Encode-8-1x336x336", "Encode-8-2x336x336", "Prefill-8",
        "Encode-32-1x336x336", "Encode-32-2x336x336", "Prefill-32", "Decode",
    ]  # fmt: skip
    assert len(lang["verification"]["runs"]) == len(names)  # each run on onnxruntime
    assert lang["onnx"].endswith("single.onnx")


def test_the_single_artifact_opens_one_session(compiled):
    """The encoder runs inside the one program: no second session over single.onnx."""
    vision, language = open_programs(load_artifacts(compiled / "out"))
    assert vision is language and language.path.name == "single.onnx"


def test_run_shows_the_encoder_runs_and_matches_transformers(compiled, capsys):
    out = str(compiled / "out")
    images = ["--image", str(compiled / "a.png"), "--image", str(compiled / "b.png")]
    turns = ["--prompt", "Compare.", "--prompt", "And the colours?", "--prompt", "Thanks."]
    assert main(["run", out, *images, *turns, "--max-new-tokens", "4", "--compare-hf"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 3
    # Turn one encodes both images in its first chunk; the follow-ups prefill only their new tokens.
    assert err.count("1 encoder call(s) encoding 2 image(s)") == 1
    assert err.count("0 encoder call(s) encoding 0 image(s)") == 2
    assert err.count("prompt tokens already held by the program (earlier turns)") == 2
    assert err.count("image 2: KV held from an earlier turn") == 2


def test_run_encodes_an_image_shown_in_turn_three_there(compiled, capsys):
    """``--turn-image 3``: the one program encodes the new image in turn 3 and keeps turns 1-2."""
    out = str(compiled / "out")
    args = ["--image", str(compiled / "a.png"), "--prompt", "Describe.", "--prompt", "Shorter."]
    args += ["--turn-image", "3", str(compiled / "b.png"), "--prompt", "And this one?"]
    assert main(["run", out, *args, "--max-new-tokens", "4", "--compare-hf"]) == 0
    turns = re.split(r"\[turn \d\] ", capsys.readouterr().err)[1:]
    summaries = [re.findall(r"(\d+) encoder call\(s\) encoding (\d+) image\(s\)", turn) for turn in turns]
    assert summaries == [[("1", "1")], [("0", "0")], [("1", "1")]]
    held = "prompt tokens already held by the program (earlier turns)"
    assert [held in turn for turn in turns] == [False, True, True]
    assert "image 1: KV held from an earlier turn" in turns[2]
    assert all("tokens identical to transformers generate" in turn for turn in turns)


def test_stand_in_compiler_takes_the_single_program(compiled, exported, tmp_path):
    """The stand-in compiler (which checks every specialization binds the graph's symbols) takes it."""
    from qeff_vision.compile.driver import compile_spec
    from tests.compile_fixtures import calls, stand_in

    compiler, record = stand_in(tmp_path)
    outcome = compile_spec(
        compiled / "spec.yaml",
        tmp_path / "out",
        compiler=compiler,
        export_dir=exported("llava"),
        progress=None,
        status_stream=None,
        env={},
    )
    (call,) = calls(record)
    assert list(outcome.manifest["programs"]) == ["lang"]
    assert any(arg.startswith("-m=") and arg.endswith("single.onnx") for arg in call["argv"])


def test_run_requests_is_refused_in_one_line(compiled, capsys):
    (compiled / "requests.jsonl").write_text(json.dumps({"prompt": "Hi.", "images": ["a.png"]}) + "\n")
    assert main(["run", str(compiled / "out"), "--requests", str(compiled / "requests.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "deployment single serves one sequence at a time" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_internvl_compiles_and_runs_images_of_different_tile_counts(
    tiny_checkpoint, exported, tmp_path, capsys
):
    """Tiny InternVL (112 px tiles): one encode entry per tile total binds the composed graph's symbols
    (``pixel_side`` among them, no ``num_images``); a 1-tile and a 5-tile image share one call."""
    spec = {
        "name": "internvl-single",
        "model": str(tiny_checkpoint("internvl")),
        "ctx_len": 256,
        "deployment": "single",
        "prefill": {"seq_lens": [16, 32]},
        "vision": {"images": [{"height": 100, "width": 100}, {"height": 60, "width": 250}], "max_images": 2},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = str(tmp_path / "out")
    args = ["compile", str(tmp_path / "spec.yaml"), "-o", out, "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported("internvl"))]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    entries = manifest["programs"]["lang"]["specializations"]
    encode = [entry for entry in entries if entry["name"].startswith("Encode")]
    assert len(encode) == 2 * 5  # per bucket: tile totals 1, 5 (one image), 2, 6, 10 (two images)
    assert all("num_images" not in entry["symbols"] for entry in entries)
    assert len(manifest["programs"]["lang"]["verification"]["runs"]) == len(entries)
    for name, (height, width) in {"a": (100, 100), "b": (60, 250)}.items():
        helpers.image(height, width, len(name)).save(tmp_path / f"{name}.png")
    images = ["--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.png")]
    turns = ["--prompt", "Compare.", "--prompt", "And the colours?", "--prompt", "Thanks."]
    assert main(["run", out, *images, *turns, "--max-new-tokens", "4", "--compare-hf"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 3
    assert err.count("1 encoder call(s) encoding 2 image(s)") == 1
    assert err.count("0 encoder call(s) encoding 0 image(s)") == 2


@pytest.mark.parametrize("family", ["llava_next", "llama4", "mistral3", *QWEN, "gemma4"])
def test_compile_runs_every_specialization_on_onnxruntime(
    family, tiny_checkpoint, exported, tmp_path, capsys
):
    """A single spec of two resolutions, up to two images: every encode, keep and decode entry runs;
    ``run`` over two images and three turns matches transformers with the encoder counts printed."""
    sizes = load_adapter(get_family(family)).test_image_sizes[:2]
    spec = {
        "name": f"{family}-single",
        "model": str(tiny_checkpoint(family)),
        "ctx_len": 512,
        "deployment": "single",
        "prefill": {"seq_lens": [16, 32]},
        "vision": {"images": [{"height": h, "width": w} for h, w in sizes], "max_images": MAX_IMAGES},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    args = ["compile", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out"), "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported(family))]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert list(manifest["programs"]) == ["lang"]
    lang = manifest["programs"]["lang"]
    names = [entry["name"] for entry in lang["specializations"]]
    encode = [name for name in names if name.startswith("Encode")]
    assert len(encode) >= 2 * len(sizes) and names[-1] == "Decode"  # per bucket: each size, 1 and 2 images
    assert len(lang["verification"]["runs"]) == len(names)  # each run on onnxruntime
    assert lang["onnx"].endswith("single.onnx")
    if family in QWEN or family == "gemma4":  # patch sequences: the gate axis is the patch count
        _check_patch_entries(lang["specializations"])
    for name, (height, width) in zip("ab", sizes):
        helpers.image(height, width, ord(name)).save(tmp_path / f"{name}.png")
    images = ["--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.png")]
    turns = ["--prompt", "Compare.", "--prompt", "And the colours?", "--prompt", "Thanks."]
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["run", out, *images, *turns, "--max-new-tokens", "4", "--compare-hf"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens identical to transformers generate") == 3
    # Two sizes: one call where a call takes both (Llama 4's tiles), else one call per size.
    assert err.count(f"{_calls(family)} encoder call(s) encoding 2 image(s)") == 1
    assert err.count("0 encoder call(s) encoding 0 image(s)") == 2


@pytest.mark.parametrize(
    "path", sorted((REPO / "specs").glob("*/*-single.yaml")), ids=lambda path: path.parent.name
)
def test_full_batch_size_is_refused_in_one_line(path, tmp_path, capsys):
    data = yaml.safe_load(path.read_text())
    data["config"] = str((path.parent / data["config"]).resolve())
    data["full_batch_size"] = 4
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    assert main(["validate", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err
    assert "full_batch_size: deployment single serves one sequence (batch 1); remove full_batch_size" in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "full_batch_size" in line]) == 1


def _check_patch_entries(entries: list[dict]) -> None:
    """Qwen-VL's encode entries bind grid_height to n images x one image's patches (QEfficient's
    single-QPC form), Gemma 4's max_patches beside the image count; keep entries bind 1 patch."""
    patches = "grid_height" if "grid_height" in entries[0]["symbols"] else "max_patches"
    for entry in entries:
        bound = entry["symbols"]
        if not entry["name"].startswith("Encode"):
            assert bound[patches] == "1" and bound["num_images"] == "1", entry["name"]
            continue
        if patches == "grid_height":
            images = int(bound["num_images"]) * int(bound["grid_h"]) * int(bound["grid_w"])
            assert int(bound["grid_height"]) == images, entry["name"]
        assert int(bound[patches]) > 1, entry["name"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma4"])
def test_patch_sequence_program_takes_the_stand_in_and_refuses_clips(
    family, tiny_checkpoint, exported, tmp_path, capsys
):
    """The stand-in compiler (every specialization binds the composed graph's symbols) takes a
    patch-sequence single program; clips are refused in one line by the spec and by ``run``."""
    from qeff_vision.compile.driver import compile_spec
    from tests.compile_fixtures import calls, stand_in

    spec = {
        "name": f"{family}-single",
        "model": str(tiny_checkpoint(family)),
        "ctx_len": 256,
        "deployment": "single",
        "prefill": {"seq_lens": [16, 32]},
        "vision": {"images": [{"height": 100, "width": 150}, {"height": 300, "width": 120}], "max_images": 2},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    compiler, record = stand_in(tmp_path)
    outcome = compile_spec(
        tmp_path / "spec.yaml",
        tmp_path / "out",
        compiler=compiler,
        export_dir=exported(family),
        progress=None,
        status_stream=None,
        env={},
    )
    (call,) = calls(record)
    assert list(outcome.manifest["programs"]) == ["lang"]
    assert any(arg.startswith("-m=") and arg.endswith("single.onnx") for arg in call["argv"])
    clips = {**spec, "vision": {"videos": [{"height": 100, "width": 150, "frames": 4}]}}
    (tmp_path / "clips.yaml").write_text(yaml.safe_dump(clips))
    capsys.readouterr()
    assert main(["validate", str(tmp_path / "clips.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err  # (Gemma 4 also says it takes no video at all)
    assert len([line for line in err.splitlines() if "encodes images only" in line]) == 1, err
    # run on a compiled single artifact refuses a clip in one line too.
    args = ["compile", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "ort"), "--backend", "onnxruntime"]
    assert main([*args, "--export", str(exported(family))]) == 0
    clip = tmp_path / "clip"
    clip.mkdir()
    for frame in range(4):
        helpers.image(100, 150, frame).save(clip / f"{frame}.png")
    capsys.readouterr()
    prompt = ["--prompt", "What happens?", "--max-new-tokens", "2"]
    assert main(["run", str(tmp_path / "ort"), "--video", str(clip), *prompt]) == 2
    err = capsys.readouterr().err
    assert ("encodes images only" in err or "does not take video" in err) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
