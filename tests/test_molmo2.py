"""Molmo2: token math equals transformers' crop tiling for any image, one vision graph for every crop
count, fused checkpoint tensors streamed slice by slice, and chunk-aware generation token-identical
to transformers generate.

The tiny checkpoint crops at 56 px (4x4 patches, 1-patch margins, up to 4 crops plus the low-res
view), pooled 2x2: an image is 4 low-res tokens plus 2x2 to 5x5 high-res ones, and its span
(``<low_res_im_start>`` ... ``<im_end><im_start>`` ... ``<im_end>``, a column token after every row)
is 16 to 42 tokens. Every image token attends to every other one both ways, so the planner keeps an
image's span in one chunk; the template lists every image first (``Image 1``, ``Image 2``, ...).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_vision import symbols
from qeff_vision.contract.segments import PlanError, Segment
from qeff_vision.export.weight_sources import JoinedSource, SlicedSource, checkpoint_keys_for
from qeff_vision.export.weights import Checkpoint as WeightFiles
from qeff_vision.exporter import load_adapter
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.molmo2 import BATCHED_NUM_PATCHES, POOLING_WINDOW
from qeff_vision.media import Clip
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.planner import ChunkEnd, plan_chunks
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime, chunks_of_image

FAMILY = "molmo2"
SPECS = Path(__file__).resolve().parent.parent / "specs"
MOLMO2_4B = describe_checkpoint(SPECS / "configs" / "Molmo2-4B")
SIZES = [(60, 60), (100, 150), (300, 120), (60, 250), (1, 900)]


def _processor(model: ModelDescription):
    from transformers import Molmo2ImageProcessor

    settings = {k: model.processor[k] for k in ("size", "max_crops", "overlap_margins", "pooling_size")}
    return Molmo2ImageProcessor(**settings, patch_size=model.processor["patch_size"])


# ---- torch-free token math on the pinned Molmo2-4B snapshot ----

_REFERENCE = _processor(MOLMO2_4B)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6000), st.integers(1, 6000))
def test_crops_and_tokens_equal_transformers_for_any_size(height, width):
    (low_h, low_w, high_h, high_w), crops = _REFERENCE.get_image_grid_and_crops(height, width)
    values = get_family(FAMILY).vision_symbols(MOLMO2_4B, ImageSize(height, width))
    tokens = low_h * low_w + high_h * high_w
    assert values == {BATCHED_NUM_PATCHES: crops, symbols.VISION_SIZE: tokens, POOLING_WINDOW: 4}
    assert values[symbols.VISION_SIZE] == _REFERENCE.get_number_of_image_patches(height, width)


def test_spec_has_one_vision_specialization_per_crop_count():
    result = build_specializations(load_spec(SPECS / "molmo2" / "molmo2-4b.yaml"))
    crops = [int(s.symbols[BATCHED_NUM_PATCHES]) for s in result.vision.specializations]
    assert crops == [2, 9]  # 378 px: the low-res view and one crop; 1080p: 2x4 crops and the view
    assert result.request_image_tokens == 2 * 1162


# ---- the tiny checkpoint ----


def test_processor_tokens_match_the_token_math_and_spans(hf_model):
    model, processor = hf_model(FAMILY)
    description = ModelDescription(model.config.to_dict(), processor.image_processor.to_dict())
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    inputs = helpers.as_numpy(
        helpers.process(processor, helpers.user_turn(*["<image>"] * len(SIZES), "Hi"), images)
    )
    family, host = get_family(FAMILY), helpers.host(model, FAMILY)
    sizes = [ImageSize(*size) for size in SIZES]
    assert host.placeholder_counts(inputs) == [family.image_tokens(description, size) for size in sizes]
    segments = host.segments(inputs)
    assert [s.stop - s.start for s in segments] == [family.image_extent(description, s) for s in sizes]
    # A segment spans the image's whole block (mm_token_type_ids 1) and is never split.
    block = inputs["mm_token_type_ids"].reshape(-1)
    for segment in segments:
        assert not segment.divisible
        assert block[segment.start : segment.stop].all()
        assert not block[segment.start - 1] and (segment.stop == len(block) or not block[segment.stop])


def test_one_vision_graph_serves_every_crop_count(hf_model, exported):
    """Several images in one processor call: each image's call sees its own crops and pooling rows."""
    model, processor = hf_model(FAMILY)
    adapter = load_adapter(get_family(FAMILY))
    program = OnnxProgram(exported(FAMILY) / "vision" / "model.onnx")
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    processed = processor.image_processor(images=images, return_tensors="pt")
    reference = [f.numpy() for f in adapter.hf_image_features(model, processed)]
    inputs = helpers.host(model, FAMILY).vision_inputs(helpers.as_numpy(processed))
    assert len({one[symbols.PIXEL_VALUES].shape[0] for one in inputs}) >= 3  # several crop counts
    for one, expected in zip(inputs, reference, strict=True):
        embeds = program.run(one)[symbols.VISION_EMBEDS]
        assert embeds.shape == (1, *expected.shape)
        assert np.abs(embeds[0] - expected).max() <= 1e-4


def test_fused_checkpoint_tensors_stream_slice_by_slice(tiny_checkpoint, hf_model):
    """att_proj -> q/k/v and ff_proj -> up/gate cut, wte's two tables joined, as transformers loads them."""
    model, _ = hf_model(FAMILY)
    files = WeightFiles(tiny_checkpoint(FAMILY))
    keys = checkpoint_keys_for(model, files)
    layer = "model.language_model.layers.0"
    assert isinstance(keys[f"{layer}.self_attn.k_proj.weight"], SlicedSource)
    assert isinstance(keys[f"{layer}.mlp.gate_proj.weight"], SlicedSource)
    assert isinstance(keys["model.language_model.embed_tokens.weight"], JoinedSource)
    wanted = model.state_dict()
    for name, source in keys.items():
        assert torch.equal(source.values(files.read, wanted[name].shape), wanted[name]), name


# ---- chunked generation vs transformers generate ----


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return FamilyRuntime(FAMILY, exported(FAMILY), *hf_model(FAMILY))


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_the_image_block_moves_whole_into_the_next_chunk(runtime, protocol):
    # <bos>"Image 1" (8 tokens), the block [8, 59): a 56-token chunk from 0 would end inside it, so
    # chunk 0 stops at its start and the next chunk carries both images and the "Image 2" between.
    processed = runtime.inputs(["<image>", "<image>", "Describe both."], [helpers.image(100, 150, 1)] * 2)
    plan, _ = runtime.run(processed, [56], protocol)
    (first,) = chunks_of_image(plan, 0)
    assert chunks_of_image(plan, 1) == [first]
    assert plan.chunks[first - 1].end is ChunkEnd.IMAGE_BOUNDARY
    assert plan.chunks[first].start == plan.segments[0].start


def test_joined_segments_share_a_chunk_or_fail_in_one_line():
    images = [Segment(4, 3, ((4, 6),)), Segment(14, 3, ((14, 6),), joined=True)]
    plan = plan_chunks(30, images, [(8, 8), (16, 8)], allow_image_split=False)
    assert [(c.start, c.stop) for c in plan.chunks] == [(0, 4), (4, 20), (20, 30)]
    with pytest.raises(PlanError, match=r"images at tokens \[4, 20\) attend to each other"):
        plan_chunks(30, images, [(8, 8), (12, 8)], allow_image_split=False)


def test_two_images_in_one_chunk_see_each_other(runtime):
    images = [helpers.image(300, 120, 1), helpers.image(60, 60, 2)]
    processed = runtime.inputs(["<image>", "<image>", "Which is brighter?"], images)
    plan, result = runtime.run(processed, [128])
    assert any(chunk.images == (0, 1) for chunk in plan)
    assert result.encoder_calls == 2  # one vision call per image


def test_text_after_the_images_spans_several_chunks(runtime):
    text = "A long question about the picture, asked in many words so that it fills chunks. " * 2
    processed = runtime.inputs(["<image>", text], [helpers.image(60, 250, 3)])
    plan, _ = runtime.run(processed, [16, 64])
    assert len(plan.chunks) >= 3 and len(chunks_of_image(plan, 0)) == 1


def test_an_image_longer_than_every_bucket_is_one_clear_error(runtime):
    processed = runtime.inputs(["<image>", "Hi"], [helpers.image(100, 150, 4)])
    generator = runtime.generator([16])
    with pytest.raises(PlanError, match="cannot split an image across chunks"):
        generator.plan(processed["input_ids"].reshape(-1), processed, "chunk")


def test_staggered_requests_with_compute_context_lengths(cb_exported, hf_model):
    """Continuous batching and CCL: five staggered requests (a freed slot reused), decode at batch 4;
    every request's tokens equal transformers generate alone (the image block's mask reads CCL slots)."""
    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from tests.test_batched_engine import SEQ_LENS, check_against_transformers, run_five

    runtime = FamilyRuntime(FAMILY, cb_exported(FAMILY, ccl=True), *hf_model(FAMILY))
    buckets = tuple(PrefillBucket(s, s) for s in SEQ_LENS)
    shape = LanguageShape(buckets, max(SEQ_LENS), 512, (64, 128, 512), (96, 112, 128, 512))
    generator = Generator(runtime.checkpoint, runtime.vision, runtime.language, shape)
    requests, report = run_five(runtime, generator)
    assert report.batched and max(report.decode_batches) >= 2
    check_against_transformers(runtime, requests, report)


# ---- video: frames through the same vision graph ----

FPS = 2.0


def _clip(frames: int, height: int, width: int, seed: int = 0) -> Clip:
    return Clip([helpers.image(height, width, seed + i) for i in range(frames)], FPS, f"{frames}-frame clip")


def _clip_inputs(processor, clip: Clip, text: str = "What happens?") -> dict:
    """What Conversation sends for one clip: its frames as sampled, timed at its rate."""
    from transformers.video_utils import VideoMetadata

    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    frames = len(clip.frames)
    metadata = VideoMetadata(total_num_frames=frames, fps=clip.fps, frames_indices=list(range(frames)))
    processed = processor(
        text=[rendered],
        videos=[clip.frames],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    return helpers.as_numpy(processed)


def test_clip_symbols_equal_the_video_processors_grid(hf_model):
    model, processor = hf_model(FAMILY)
    description = ModelDescription(
        model.config.to_dict(),
        processor.image_processor.to_dict(),
        video_processor=processor.video_processor.to_dict(),
    )
    family, host = get_family(FAMILY), helpers.host(model, FAMILY)
    for frames, height, width in ((1, 60, 80), (4, 100, 150), (7, 300, 120)):
        processed = _clip_inputs(processor, _clip(frames, height, width))
        size = ImageSize(height, width, frames, video=True)
        values = family.vision_symbols(description, size)
        assert values[BATCHED_NUM_PATCHES] == frames and values[POOLING_WINDOW] == 9
        assert [values[symbols.VISION_SIZE]] == host.placeholder_counts(processed)
        (segment,) = host.segments(processed)
        assert segment.modality == "video" and segment.stop - segment.start <= family.image_extent(
            description, size
        )


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_a_clip_stays_in_one_chunk_and_matches_transformers(runtime, protocol):
    processed = _clip_inputs(runtime.processor, _clip(4, 100, 150, seed=3))
    plan, result = runtime.run(processed, [16, 64], protocol)
    (chunk,) = chunks_of_image(plan, 0)
    assert plan.chunks[chunk].start <= plan.segments[0].start and result.encoder_calls == 1


def test_a_clip_in_a_conversation_then_a_text_turn(runtime):
    cache = EmbeddingCache(16 * 2**20)
    chat = Conversation(
        runtime.generator([16, 64], "chunk", cache), runtime.processor, max_new_tokens=NEW_TOKENS
    )
    for videos, text in (([_clip(3, 60, 80, seed=5)], "What happens?"), ([], "And then?")):
        result = chat.ask([], text, videos=videos, keep_logits=True)
        runtime.check(result, chat.last_inputs.processed, f"clip turn {text}")


def test_images_and_a_clip_in_one_prompt_are_refused_in_one_line(runtime):
    from qeff_vision.errors import UserError

    cache = EmbeddingCache(16 * 2**20)
    chat = Conversation(runtime.generator([64], "chunk", cache), runtime.processor, max_new_tokens=2)
    with pytest.raises(UserError, match="images or one video per prompt, not both"):
        chat.ask([helpers.image(60, 60)], "Both?", videos=[_clip(2, 60, 80)])


def test_a_second_clip_in_a_conversation_is_refused_in_one_line(runtime, exported, tmp_path, capsys):
    """Molmo2's processor takes one video per sample: a later turn's clip is one line (exit 2 from run)."""
    import yaml

    from qeff_vision.cli import main
    from qeff_vision.errors import UserError

    cache = EmbeddingCache(16 * 2**20)
    chat = Conversation(runtime.generator([64], "chunk", cache), runtime.processor, max_new_tokens=2)
    chat.ask([], "What happens?", videos=[_clip(2, 60, 80, seed=5)])
    with pytest.raises(UserError, match="At most one video is supported per sample"):
        chat.ask([], "And here?", videos=[_clip(2, 60, 80, seed=6)])
    assert len(chat.messages) == 2  # the refused turn left the conversation as it was
    clips = []
    for number in (1, 2):
        directory = tmp_path / f"clip{number}"
        directory.mkdir()
        for index in range(2):
            helpers.image(60, 80, 10 * number + index).save(directory / f"frame{index:03d}.png")
        clips.append(str(directory))
    spec = {
        "name": "molmo2-two-clips",
        "model": str(runtime.checkpoint.directory),
        "ctx_len": 256,
        "prefill": {"seq_lens": [64]},
        "vision": {
            "images": [{"height": 60, "width": 60}],
            "videos": [{"height": 60, "width": 80, "frames": 2}],
        },
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    compile_args = ["compile", str(tmp_path / "spec.yaml"), "-o", str(out), "--backend", "onnxruntime"]
    assert main([*compile_args, "--export", str(exported(FAMILY))]) == 0
    args = ["run", str(out), "--video", clips[0], "--prompt", "What?"]
    code = main([*args, "--turn-video", "2", clips[1], "--prompt", "And here?", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "At most one video is supported per sample" in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(("max_images", "fits"), [(3, True), (4, False)])
def test_spec_checks_that_a_prompts_joined_images_fit_one_bucket(tmp_path, capsys, max_images, fits):
    """3 x 1,203 + 2 x 7 tokens fit the 4096 bucket; 4 x 1,203 + 3 x 7 do not: one line naming max_images."""
    import yaml

    from qeff_vision.cli import main

    data = yaml.safe_load((SPECS / "molmo2" / "molmo2-4b.yaml").read_text())
    data["config"] = str(SPECS / "configs" / "Molmo2-4B" / "config.json")
    data["ctx_len"] = 16384
    data["vision"]["max_images"] = max_images
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    if fits:
        assert code == 0, err
        return
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "vision.max_images" in line]
    # Between two images the template writes "Image N": 7 bytes, its bound without a tokenizer.
    images = " + ".join(["1080x1920"] * 4)
    assert f"4 images ({images}) are one run of 4833 tokens (4648 image rows)" in line, line
    assert "add a bucket with seq_len >= 4833 and vision_size >= 4648" in line
