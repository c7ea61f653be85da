"""Video token pruning (EVS) end to end: pruned clips generate what transformers generates from them.

transformers does not prune, so the reference is its own ``generate`` given the pruned prompt our
host built: its token embeddings and recomputed positions (``inputs_embeds``, ``position_ids`` [4,
1, L]) and its own vision tower's features cut by our retention masks
(:func:`~qeff_vision.reference.reference_generate_pruned`). Covered: a pruned clip whose
rows span several prefill chunks, a clip and an image in one prompt (and a second turn served from
the cached kept rows), several requests under continuous batching, and rate 0, which must leave
every logit bit-identical to a generator never given the option.

Tiny checkpoints: 8 frames of 112x140 are 4 temporal patches of 4x5 merged rows (80 rows on
Qwen2.5-VL); Qwen3-VL's 16-pixel patches make them 4 patches of 3x4 (48 rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision.contract.video_pruning import KEPT_ROWS, PRUNED_POSITIONS, RETENTION, kept_rows
from qeff_vision.errors import UserError
from qeff_vision.media import Clip
from qeff_vision.reference import reference_generate, reference_generate_pruned
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from tests import helpers
from tests.family_runtime import LOGIT_TOLERANCE, NEW_TOKENS, FamilyRuntime

FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def clip(frames: int = 8, height: int = 112, width: int = 140, seed: int = 0, static: bool = False) -> Clip:
    """Random frames, or one frame repeated (a static scene)."""
    images = [helpers.image(height, width, seed + (0 if static else i)) for i in range(frames)]
    return Clip(images, 2.0, f"{frames}-frame clip")


@pytest.fixture(scope="module")
def runtimes(exported, hf_model):
    built = {}

    def get(family):
        if family not in built:
            built[family] = FamilyRuntime(family, exported(family), *hf_model(family))
        return built[family]

    return get


def _processed(runtime, images, clips, text="What happens in the video?"):
    chat = Conversation(runtime.generator([64]), runtime.processor)
    return chat.prepare(images, text, clips).processed


def _pruning_generator(runtime, seq_lens, rate, cache=None):
    generator = runtime.generator(seq_lens, "chunk", cache)
    generator.set_video_pruning_rate(rate)
    return generator


def check_pruned(runtime, generator, processed, result, label: str, new_tokens: int = NEW_TOKENS) -> None:
    """Tokens identical to transformers on the same pruned prompt; every step's logits close."""
    pruned = generator.prepare_prompt(processed)  # the clips' kept rows are cached: no encoder call
    tokens, logits = reference_generate_pruned(runtime.model, runtime.family, processed, pruned, NEW_TOKENS)
    assert result.tokens == tokens[:new_tokens], f"{label}: tokens differ from transformers"
    worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(result.logits, logits))
    assert worst <= LOGIT_TOLERANCE, f"{label}: logits differ by {worst}"


def _clip_rows(runtime, processed) -> tuple[int, int]:
    """(rows, rows kept per temporal patch) of the prompt's one clip."""
    merge = runtime.family.vision(runtime.checkpoint.description).merge
    frames, height, width = (int(x) for x in processed["video_grid_thw"][0])
    per_frame = (height // merge) * (width // merge)
    return frames * per_frame, per_frame


SPLIT_CASES = [(family, rate) for family in FAMILIES for rate in (0.5, 0.75)]
# The other families that declare pruning run the same hosts: one rate each.
SPLIT_CASES += [("qwen3_5", 0.5), ("qwen3_vl_moe", 0.75)]


@pytest.mark.parametrize(("family", "rate"), SPLIT_CASES)
def test_pruned_clip_split_across_chunks_matches_transformers(runtimes, family, rate):
    runtime = runtimes(family)
    processed = _processed(runtime, [], [clip()])
    generator = _pruning_generator(runtime, [16, 32], rate)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    rows, per_frame = _clip_rows(runtime, processed)
    kept = kept_rows(rows // per_frame, per_frame, rate)
    assert kept < rows
    # Fewer rows and as many fewer prompt tokens; the kept rows still straddle chunks.
    assert result.image_rows == kept and sum(chunk.rows for chunk in result.chunks) == kept
    assert result.prompt_tokens == processed["input_ids"].shape[1] - (rows - kept)
    assert len([chunk for chunk in result.chunks if chunk.rows]) >= 2
    check_pruned(runtime, generator, processed, result, f"{family} rate {rate}")


@pytest.mark.parametrize("family", FAMILIES)
def test_clip_and_image_in_one_prompt_then_a_turn_from_the_cache(runtimes, family):
    """Image then pruned clip; the second turn keeps both in the language program's KV (none encoded)."""
    runtime = runtimes(family)
    generator = _pruning_generator(runtime, [32, 64], 0.5, EmbeddingCache(16 * 2**20))
    chat = Conversation(generator, runtime.processor, max_new_tokens=NEW_TOKENS)
    first = chat.ask(
        [helpers.image(100, 150, 9)],
        "Is the picture in the video?",
        videos=[clip(4, 96, 96, 3)],
        keep_logits=True,
    )
    check_pruned(runtime, generator, chat.last_inputs.processed, first, f"{family} turn 1")
    second = chat.ask([], "Describe the video again.", keep_logits=True)
    check_pruned(runtime, generator, chat.last_inputs.processed, second, f"{family} turn 2")
    assert (first.images, second.images) == (2, 2)
    # Turn 1 encoded the image and the clip once each; turn 2 holds both (kept prefix).
    assert (first.images_encoded, second.images_encoded, second.encoder_calls) == (2, 0, 0)


def test_a_static_scene_keeps_the_first_frame_and_generates_like_transformers(runtimes):
    """Every later temporal patch repeats the first: at rate 0.75 the kept rows are the first patch."""
    runtime = runtimes("qwen2_5_vl")
    processed = _processed(runtime, [], [clip(static=True)])
    generator = _pruning_generator(runtime, [32], 0.75)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    pruned = generator.prepare_prompt(processed)
    rows, per_frame = _clip_rows(runtime, processed)
    assert pruned[RETENTION][:per_frame].all() and int(pruned[KEPT_ROWS][0]) == per_frame == rows // 4
    check_pruned(runtime, generator, processed, result, "static clip")


@pytest.mark.parametrize("family", FAMILIES)
def test_rate_zero_is_bit_identical_to_no_option(runtimes, family):
    runtime = runtimes(family)
    processed = _processed(runtime, [helpers.image(100, 150, 9)], [clip(4, 96, 96, 3)])
    plain = runtime.generator([32, 64], "chunk").generate(
        processed, max_new_tokens=NEW_TOKENS, keep_logits=True
    )
    zero = _pruning_generator(runtime, [32, 64], 0)
    assert zero.prepare_prompt(processed) is processed
    result = zero.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    assert result.tokens == plain.tokens and result.prompt_tokens == plain.prompt_tokens
    assert all(np.array_equal(a, b) for a, b in zip(result.logits, plain.logits))
    assert len(result.logits) == len(plain.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_clips_under_continuous_batching_match_transformers(runtimes, cb_exported, family):
    """Three requests through two KV slots: a pruned clip, an image and a clip, text only."""
    base = runtimes(family)
    runtime = FamilyRuntime(family, cb_exported(family), base.model, base.processor)
    generator = _pruning_generator(runtime, [32, 64], 0.5, EmbeddingCache(16 * 2**20))
    requests = [
        (_processed(runtime, [], [clip(8, 112, 140, 5)]), NEW_TOKENS, 0),
        (_processed(runtime, [helpers.image(100, 150, 9)], [clip(4, 96, 96, 3)], "Compare."), NEW_TOKENS, 0),
        (_processed(runtime, [], [], "Write a poem."), NEW_TOKENS - 2, 1),
    ]
    report = BatchedEngine(generator, full_batch_size=2).run(
        [EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True
    )
    assert report.batched
    for (processed, new, _), done in zip(requests, report.requests):
        label = f"{family} request {done.number}"
        if "pixel_values_videos" in processed:
            check_pruned(runtime, generator, processed, done.result, label, new)
            assert done.result.prompt_tokens < processed["input_ids"].shape[1]
        else:
            tokens, _ = reference_generate(runtime.model, processed, NEW_TOKENS)
            assert done.result.tokens == tokens[:new], label


def test_pruned_prompt_entries_and_bad_rates(runtimes):
    runtime = runtimes("qwen2_5_vl")
    generator = _pruning_generator(runtime, [64], 0.5)
    processed = _processed(runtime, [], [clip(4, 96, 96, 3)])
    pruned = generator.prepare_prompt(processed)
    length = pruned["input_ids"].shape[1]
    assert pruned["attention_mask"].shape == (1, length) and pruned[PRUNED_POSITIONS].shape == (4, 1, length)
    assert generator.prepare_prompt(pruned) is pruned  # pruning twice changes nothing
    for bad in (1.0, -0.1, float("nan"), "half", True):
        with pytest.raises(UserError, match="video_pruning_rate") as error:
            generator.set_video_pruning_rate(bad)
        assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def pruning_artifacts(tiny_checkpoint, tmp_path_factory):
    """Tiny Qwen2.5-VL compiled on onnxruntime with an 8-frame 112x140 clip and video_pruning_rate 0.5."""
    import yaml

    from qeff_vision.cli import main
    from tests.compile_fixtures import write_spec

    root = tmp_path_factory.mktemp("pruning-artifacts")
    spec = write_spec(root / "tiny.yaml", model=str(tiny_checkpoint("qwen2_5_vl")), config=None, ctx_len=512)
    data = yaml.safe_load(spec.read_text())
    data["vision"]["videos"] = [{"height": 112, "width": 140, "frames": 8}]
    data["vision"]["video_pruning_rate"] = 0.5
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = root / "out"
    assert main(["compile", str(spec), "-o", str(out), "--backend", "onnxruntime"]) == 0
    frames = root / "frames"
    frames.mkdir()
    for index in range(8):
        helpers.image(112, 140, index).save(frames / f"frame{index:03d}.png")
    return out, frames


def _run(artifacts, frames, *extra):
    from qeff_vision.cli import main

    argv = ["run", str(artifacts), "--video", str(frames), "--prompt", "What?", "--max-new-tokens", "4"]
    return main([*argv, *extra])


def test_run_prunes_at_the_compiled_rate_and_compares_with_transformers(pruning_artifacts, capsys):
    import json

    artifacts, frames = pruning_artifacts
    assert json.loads((artifacts / "manifest.json").read_text())["shapes"]["video_pruning_rate"] == 0.5
    assert _run(artifacts, frames, "--compare-hf") == 0
    pruned = capsys.readouterr().err
    assert "compare-hf: tokens identical to transformers generate" in pruned
    assert "1 image(s) = 40 vision rows" in pruned  # 80 rows, half kept
    # The run option overrides the spec: 0 turns pruning off (the program takes the full clip too).
    assert _run(artifacts, frames, "--compare-hf", "--video-pruning-rate", "0") == 0
    full = capsys.readouterr().err
    assert "1 image(s) = 80 vision rows" in full and "tokens identical" in full


@pytest.mark.parametrize("rate", ["1", "-0.5", "nan"])
def test_run_refuses_a_bad_rate_in_one_line(pruning_artifacts, capsys, rate):
    artifacts, frames = pruning_artifacts
    assert _run(artifacts, frames, "--video-pruning-rate", rate) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "video_pruning_rate must be in [0, 1)" in err[0], err
