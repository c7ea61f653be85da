"""Video on Qwen2.5-VL and Qwen3-VL: token math equals the video processors' ``video_grid_thw``, and clips
(alone, straddling prefill chunks, next to an image, across conversation turns) generate tokens identical
to transformers generate; ``run --video`` refuses bad clips with one line and exit code 2.

Tiny checkpoints: Qwen2.5-VL has 14-pixel patches, Qwen3-VL 16-pixel patches; both put 2 frames in
a temporal patch, so an 8-frame clip is 4 temporal patches. Qwen3-VL writes each temporal patch as
its own placeholder run after a "<t seconds>" timestamp.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, describe_checkpoint
from qeff_vision.families.qwen2_5_vl import GRID_H, GRID_W, TIME
from qeff_vision.media import Clip
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from tests import helpers
from tests.compile_fixtures import write_spec
from tests.family_runtime import NEW_TOKENS, FamilyRuntime

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
FPS = 2.0


def clip(frames: int, height: int, width: int, seed: int = 0) -> Clip:
    return Clip([helpers.image(height, width, seed + i) for i in range(frames)], FPS, f"{frames}-frame clip")


@pytest.mark.parametrize("family", FAMILIES)
def test_video_symbols_equal_the_processors_video_grid_thw(family, tiny_checkpoint, hf_model):
    """10 random (frames, height, width): grid_t, grid_h, grid_w and the placeholder count."""
    _, processor = hf_model(family)
    description = describe_checkpoint(tiny_checkpoint(family))
    rng = random.Random(11)
    merge = 2
    for _ in range(10):
        frames, height, width = 2 * rng.randint(1, 8), rng.randint(20, 400), rng.randint(20, 400)
        video = [np.zeros((height, width, 3), np.uint8)] * frames
        grid = processor.video_processor(videos=[video], do_sample_frames=False, return_tensors="np")
        values = get_family(family).vision_symbols(description, ImageSize(height, width, frames, video=True))
        expected = tuple(int(x) for x in grid["video_grid_thw"][0])
        assert (values[TIME], values[GRID_H], values[GRID_W]) == expected, (frames, height, width)
        assert values[symbols.VISION_SIZE] == int(np.prod(expected)) // merge**2


@pytest.fixture(scope="module")
def runtimes(exported, hf_model):
    return {family: FamilyRuntime(family, exported(family), *hf_model(family)) for family in FAMILIES}


def _ask(runtime, seq_lens, turns, cache=None):
    chat = Conversation(
        runtime.generator(seq_lens, "chunk", cache), runtime.processor, max_new_tokens=NEW_TOKENS
    )
    results = []
    for images, videos, text in turns:
        result = chat.ask(images, text, videos=videos, keep_logits=True)
        runtime.check(result, chat.last_inputs.processed, f"{runtime.family.name} turn {len(results) + 1}")
        results.append(result)
    return chat, results


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("frames", "size"), [(8, (112, 140)), (16, (112, 140)), (8, (64, 96)), (16, (64, 96))]
)
def test_clip_straddling_chunks_matches_generate(runtimes, family, frames, size):
    runtime = runtimes[family]
    chat, (result,) = _ask(runtime, [32, 64], [([], [clip(frames, *size)], "What happens in the video?")])
    grid = chat.last_inputs.processed["video_grid_thw"][0]
    assert grid[0] == frames // 2
    spans = [chunk for chunk in result.chunks if chunk.rows]
    assert len(spans) >= 2 and sum(chunk.rows for chunk in result.chunks) == int(np.prod(grid)) // 4


@pytest.mark.parametrize("family", FAMILIES)
def test_image_and_clip_in_one_prompt_then_a_text_turn(runtimes, family):
    """Prompt order image, clip; the next turn keeps both in the language program's KV (none encoded)."""
    runtime = runtimes[family]
    cache = EmbeddingCache(16 * 2**20)
    turns = [
        ([helpers.image(100, 150, 9)], [clip(4, 96, 96, seed=3)], "Is the picture in the video?"),
        ([], [], "Describe the video again."),
    ]
    chat, results = _ask(runtime, [16, 64], turns, cache)
    assert [r.images for r in results] == [2, 2]
    assert [r.images_encoded for r in results] == [2, 0]  # the clip is cached like an image


@pytest.fixture(scope="module")
def video_artifacts(tiny_checkpoint, tmp_path_factory):
    """Tiny Qwen2.5-VL compiled on onnxruntime with an image and 4- and 8-frame 112x140 clips."""
    import yaml

    root = tmp_path_factory.mktemp("video-artifacts")
    spec = write_spec(root / "tiny.yaml", model=str(tiny_checkpoint("qwen2_5_vl")), config=None, ctx_len=512)
    data = yaml.safe_load(spec.read_text())
    data["vision"]["videos"] = [
        {"height": 112, "width": 140, "frames": 4},
        {"height": 112, "width": 140, "frames": 8},
    ]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = root / "out"
    assert main(["compile", str(spec), "-o", str(out), "--backend", "onnxruntime"]) == 0
    return out


def _frames(directory, count, height=112, width=140):
    directory.mkdir()
    for index in range(count):
        helpers.image(height, width, index).save(directory / f"frame{index:03d}.png")
    return directory


def test_run_video_from_a_frame_directory_matches_transformers(video_artifacts, tmp_path, capsys):
    frames = _frames(tmp_path / "frames", 8)
    code = main(
        [
            "run",
            str(video_artifacts),
            "--video",
            str(frames),
            "--fps",
            "2",
            "--prompt",
            "What?",
            "--max-new-tokens",
            "4",
            "--compare-hf",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "compare-hf: tokens identical to transformers generate" in captured.err


def test_a_clip_shown_in_turn_two_is_encoded_there(video_artifacts, tmp_path, capsys):
    frames = _frames(tmp_path / "frames", 8)
    args = ["run", str(video_artifacts), "--prompt", "Hi.", "--turn-video", "2", str(frames)]
    code = main([*args, "--prompt", "What?", "--fps", "2", "--max-new-tokens", "4", "--compare-hf"])
    err = capsys.readouterr().err
    assert code == 0, err
    first, second = err.split("[turn 2] ")
    assert "0 encoder call(s)" in first and "1 encoder call(s)" in second
    assert "prompt tokens already held by the program" in second
    assert err.count("compare-hf: tokens identical to transformers generate") == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: _frames(d / "odd", 5), "multiple of 2 frames"),
        (lambda d: _frames(d / "long", 10), "more than the compiled clips hold"),
        (
            lambda d: d.joinpath("broken.mp4").write_bytes(b"not a video") and d / "broken.mp4",
            "not a readable video",
        ),
        (lambda d: d / "missing", "no such video file or frame directory"),
    ],
)
def test_bad_clips_are_one_line_exit_2(video_artifacts, tmp_path, capsys, make, message):
    code = main(["run", str(video_artifacts), "--video", str(make(tmp_path)), "--prompt", "What?"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_spec_rejects_a_clip_with_an_odd_frame_count(tmp_path, capsys):
    import yaml

    spec = write_spec(tmp_path / "odd.yaml")
    data = yaml.safe_load(spec.read_text())
    data["vision"]["videos"] = [{"height": 360, "width": 640, "frames": 7}]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["validate", str(spec)]) == 2
    assert "multiple of 2 frames" in capsys.readouterr().err


def test_video_specializations_of_the_pinned_qwen2_5_vl_spec():
    from pathlib import Path

    from qeff_vision.spec import build_specializations, load_spec

    spec = (
        Path(__file__).resolve().parent.parent / "specs" / "qwen2_5_vl" / "qwen2_5_vl-7b-instruct-video.yaml"
    )
    result = build_specializations(load_spec(spec))
    rows = [(s.name, s.symbols[TIME], s.symbols[symbols.VISION_SIZE]) for s in result.vision.specializations]
    assert rows == [
        ("Vision-354x536", "1", "247"),
        ("Vision-360x640x8", "4", "1196"),
        ("Vision-360x640x16", "8", "2392"),
        ("Vision-720x1280x8", "4", "4784"),
    ]


def test_video_files_decode_with_pyav_and_sample_to_fps(tmp_path):
    """An 8-frame 4 fps file: every frame at its own rate, or every second frame at --fps 2."""
    import av

    from qeff_vision.media import load_video

    path = tmp_path / "clip.mp4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 160, 112, "yuv420p"
        for index in range(8):
            pixels = np.asarray(helpers.image(112, 160, index))
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    every = load_video(path)
    assert (len(every.frames), every.fps, every.frames[0].size) == (8, 4.0, (160, 112))
    sampled = load_video(path, fps=2)
    assert (len(sampled.frames), sampled.fps) == (4, 2)


def test_families_table_shows_video_and_deepstack_per_family_with_reasons():
    from qeff_vision import api
    from qeff_vision.families import all_families

    table = api.families_table()
    for family in all_families():
        rows = dict(family.features.rows())
        for feature in ("video", "deepstack"):
            support = rows[feature]
            assert support.supported or support.note, (family.name, feature)
            assert re.search(rf"\b{feature} +{re.escape(support.cell())}$", table, re.MULTILINE), feature
    supported = {
        family.name: (family.features.video.supported, family.features.deepstack.supported)
        for family in all_families()
    }
    assert supported["qwen2_5_vl"] == (True, False)
    assert supported["qwen3_vl"] == supported["qwen3_vl_moe"] == (True, True)
    assert supported["molmo2"] == (True, False)  # frames through its image program (tests/test_molmo2.py)
    assert not any(
        video for name, (video, _) in supported.items() if not name.startswith("qwen") and name != "molmo2"
    )
