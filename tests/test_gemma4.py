"""Gemma 4 in its three tiny layouts against transformers generate (greedy, tokens identical).

* ``e`` (E2B/E4B, the family's default tiny, also run by the registry suites): PLE, two shared-KV
  layers without cache rows, causal image attention, so the planner splits an image.
* ``moe`` (26B-A4B): experts routed, ``attention_k_eq_v`` full layers with one KV head,
  ``"vision"`` attention: images bidirectional on sliding layers, so the planner moves them whole.
* ``dense`` (31B): the same without experts.

Every layout has a sliding window of 8 (prompts and decode run far past it) and full layers twice
as wide as the sliding ones. One export per layout per session (built here for moe and dense).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.families import get_family
from qeff_vision.families.base import ModelDescription, describe_checkpoint
from qeff_vision.families.gemma4.tiny import SLIDING_WINDOW, write_tiny_checkpoint
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from tests import helpers
from tests.family_runtime import NEW_TOKENS, FamilyRuntime, chunks_of_image

FAMILY = "gemma4"
LAYOUTS = ("e", "moe", "dense")
LONG_TEXT = "A paragraph of plain text that fills at least one whole prefill chunk between two images."
# Prompt name -> (chat parts, image sizes). The 100x150 image is 60 placeholders, 90x120 63.
PROMPTS = {
    "one_image": (("<image>", "Describe this image."), [(100, 150)]),
    "two_images": (("<image>", "<image>", "Compare."), [(90, 120), (120, 90)]),
    "image_text_image": (("<image>", LONG_TEXT, "<image>", "Which?"), [(90, 120), (100, 150)]),
}


@pytest.fixture(scope="module")
def layout(tiny_checkpoint, exported, cb_exported, hf_model, tmp_path_factory):
    """``layout(name, batching=False) -> FamilyRuntime`` of the tiny checkpoint in that layout.

    ``batching``: the continuous-batching export with ``comp_ctx_lengths``. Built once each; the E
    layout is the registry's tiny checkpoint (and its session exports).
    """
    built: dict[tuple[str, bool], FamilyRuntime] = {}
    checkpoints: dict[str, object] = {}

    def build(name: str, batching: bool = False) -> FamilyRuntime:
        if (name, batching) in built:
            return built[name, batching]
        if name == "e":
            export = cb_exported(FAMILY, ccl=True) if batching else exported(FAMILY)
            built[name, batching] = FamilyRuntime(FAMILY, export, *hf_model(FAMILY))
            return built[name, batching]
        from qeff_vision.exporter import export_model

        if name not in checkpoints:
            checkpoints[name] = write_tiny_checkpoint(
                tmp_path_factory.mktemp(f"gemma4-{name}") / "model", 0, name
            )
        checkpoint = checkpoints[name]
        export = tmp_path_factory.mktemp(f"gemma4-{name}-export") / "export"
        export_model(
            checkpoint, export, continuous_batching=batching, comp_ctx_lengths=batching, progress=None
        )
        plain = built.get((name, not batching))
        loaded = (plain.model, plain.processor) if plain else helpers.load_hf(checkpoint)
        built[name, batching] = FamilyRuntime(FAMILY, export, *loaded)
        return built[name, batching]

    return build


def _run(runtime: FamilyRuntime, prompt: str, seq_lens, protocol: str = "chunk"):
    parts, sizes = PROMPTS[prompt]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    return runtime.run(runtime.inputs(parts, images), seq_lens, protocol)


def test_shared_kv_layers_have_no_cache_rows(layout):
    """E layout: layers 3 and 4 read layers 2 and 1; the graph has KV rows for layers 0-2 only."""
    runtime = layout("e")
    graph = onnx.load(str(runtime.language.path), load_external_data=False).graph
    names = [value.name for value in (*graph.input, *graph.output)]
    kv = sorted(name for name in names if name.startswith("past_"))
    assert kv == sorted(
        f"past_{kind}.{layer}{suffix}"
        for kind in ("key", "value")
        for layer in (0, 1, 2)
        for suffix in ("", "_RetainedState")
    )
    shapes = {
        value.name: [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]
        for value in graph.input
    }
    assert shapes["past_key.0"] == [symbols.BATCH_SIZE, 2, symbols.SLIDING_WINDOW, 16]  # sliding
    assert shapes["past_key.1"] == [symbols.BATCH_SIZE, 2, symbols.CTX_LEN, 32]  # full: global_head_dim
    table = get_family(FAMILY).language_table(runtime.checkpoint.description)
    assert table.shared_layers() == {3: 2, 4: 1}


@pytest.mark.parametrize("name", LAYOUTS)
def test_full_layers_have_their_own_heads_and_width(name, layout):
    """k_eq_v layouts: full layers keep 1 KV head of 32 (sliding: 2 of 16)."""
    runtime = layout(name)
    graph = onnx.load(str(runtime.language.path), load_external_data=False).graph
    shapes = {
        value.name: [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]
        for value in graph.input
    }
    view = get_family(FAMILY).config(runtime.checkpoint.description)
    for layer in range(view.num_layers):
        if view.reads(layer) is None:
            heads, width = shapes[symbols.past_key(layer)][1], shapes[symbols.past_key(layer)][3]
            assert (heads, width) == (view.kv_heads[layer], view.head_dims[layer]), layer
    full_heads = {view.kv_heads[i] for i, kind in enumerate(view.layer_types) if kind == "full_attention"}
    assert full_heads == ({2} if name == "e" else {1})


@pytest.mark.parametrize("name", LAYOUTS)
def test_image_straddling_a_chunk_boundary(name, layout):
    """The 60-row image at [8, 68) crosses a 64-token cut: E splits it, 26B/31B move it whole."""
    runtime = layout(name)
    plan, _ = _run(runtime, "one_image", [32, 64])
    span, chunks = plan.segments[0], chunks_of_image(plan, 0)
    if name == "e":
        assert len(chunks) == 2  # split, and still identical to transformers
    else:
        assert len(chunks) == 1 and plan.chunks[0].stop == span.start  # the first chunk stops before it
        chunk = plan.chunks[chunks[0]]
        assert chunk.start <= span.start and span.stop <= chunk.stop
    assert runtime.family.splits_images(runtime.checkpoint.description) is (name == "e")


@pytest.mark.parametrize("name", LAYOUTS)
def test_two_images_in_one_chunk(name, layout):
    """Both images (2 x 63 rows and their markers) in one 160-token chunk."""
    plan, _ = _run(layout(name), "two_images", [160])
    assert plan.chunks[0].images == (0, 1)


@pytest.mark.parametrize("name", LAYOUTS)
def test_image_then_text_only_chunk_then_image(name, layout):
    """Image A, a chunk without placeholders, image B: B reads its own rows."""
    # E splits images, so 32-token chunks leave whole chunks of text; 26B/31B need 64 for an image.
    plan, _ = _run(layout(name), "image_text_image", [16, 32] if name == "e" else [16, 64])
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    between = plan.chunks[first[-1] + 1 : second[0]]
    assert between and all(chunk.placeholders == 0 for chunk in between)


@pytest.mark.parametrize("name", LAYOUTS)
def test_decode_runs_past_the_sliding_window(name, layout):
    """Text-only prompt, then decode: every step past the window of 8 matches transformers."""
    runtime = layout(name)
    processed = runtime.inputs(("Tell me a long story about a lighthouse keeper.",), [])
    assert processed["input_ids"].shape[1] > 4 * SLIDING_WINDOW
    result = runtime.generator([16]).generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, f"{name} decode past the window")


@pytest.mark.parametrize("name", ("moe", "dense"))
def test_three_turn_conversation(name, layout):
    """The registry suite runs the E layout's; here the 26B and 31B layouts (images moved whole)."""
    runtime = layout(name)
    generator = runtime.generator([16, 96], "chunk", EmbeddingCache(2**24))
    chat = Conversation(generator, runtime.processor, max_new_tokens=NEW_TOKENS)
    turns = [
        ([helpers.image(100, 150, 5)], "Describe."),
        ([], "And the colours?"),
        ([helpers.image(90, 120, 6)], "Compare."),
    ]
    for number, (images, text) in enumerate(turns, 1):
        result = chat.ask(images, text, keep_logits=True)
        runtime.check(result, chat.last_inputs.processed, f"{name} turn {number}")


def test_audio_and_video_inputs_are_refused_in_one_line(layout):
    """The host refuses audio features (and video frames): only images and text are exported."""
    runtime = layout("e")
    processed = runtime.inputs(("Describe.",), [])
    host = runtime.family.host(runtime.checkpoint.description)
    for key in ("input_features", "pixel_values_videos"):
        with pytest.raises(UserError, match="not supported") as error:
            host.segments({**processed, key: np.zeros((1, 4, 4), np.float32)})
        assert "\n" not in str(error.value)


def test_published_config_keys_give_the_same_caches(layout):
    """A published config (global_head_dim, num_global_key_value_heads) reads like transformers' saved one."""
    saved = layout("moe").checkpoint.description
    text = {k: v for k, v in saved.config["text_config"].items() if k != "per_layer_config"}
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    published = ModelDescription({**saved.config, "text_config": text}, saved.processor)
    family = get_family(FAMILY)
    assert family.layer_caches(published) == family.layer_caches(saved)
    assert family.language_symbols(published) == family.language_symbols(saved)


def test_planner_reads_image_attention_from_the_checkpoint(layout, tmp_path):
    """Same family, two checkpoints: the E config splits images, the 'vision' one keeps them whole."""
    family = get_family(FAMILY)
    assert family.splits_images(describe_checkpoint(layout("e").checkpoint.directory))
    assert not family.splits_images(describe_checkpoint(layout("dense").checkpoint.directory))


def test_e2b_kv_bytes_at_32k_at_most_half_of_qefficients_layout():
    """benchmarks/kv_memory.py on the pinned gemma-4-E2B-it: 15 of 35 layers keep a cache (0.43x)."""
    kv_memory = helpers.load_benchmark("kv_memory")
    config = kv_memory.ROOT / "specs" / "configs" / "gemma-4-E2B-it" / "config.json"
    description = describe_checkpoint(config.parent, config)
    sizes = kv_memory.layout_bytes(get_family(FAMILY), description, 32768, kv_bytes=2, batch=1)
    assert sizes["ours"] <= 0.5 * sizes["QEfficient"]
    # Layers 0-14 keep caches: 12 sliding rings of 512 slots (1 head x 256), 3 full (1 head x 512)
    assert sizes["ours"] == 2 * 2 * (12 * 512 * 256 + 3 * 32768 * 512)  # x 2 (K, V) x 2 bytes


@pytest.mark.parametrize("name", LAYOUTS)
def test_five_staggered_requests_with_compute_context_lengths(name, layout):
    """Continuous batching and CCL together: five requests through four slots (the fifth reuses a
    freed slot), decode calls at batch 4 reading the smallest compiled CCL past the furthest
    position; every request's tokens equal transformers generate alone."""
    from qeff_vision.runtime.generate import Generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from tests.test_batched_engine import SEQ_LENS, SLOTS, check_against_transformers, run_five

    runtime = layout(name, batching=True)
    buckets = tuple(PrefillBucket(s, s) for s in SEQ_LENS)
    decode_ccls = (96, 112, 128, 512)
    shape = LanguageShape(buckets, max(SEQ_LENS), 512, (64, 128, 512), decode_ccls)
    generator = Generator(runtime.checkpoint, runtime.vision, runtime.language, shape)
    requests, report = run_five(runtime, generator)
    assert report.batched and report.full_batch_size == SLOTS and max(report.decode_batches) >= 2
    check_against_transformers(runtime, requests, report)
    fifth = report.requests[4]
    assert any(r.slot == fifth.slot and r.finished_step < fifth.admitted_step for r in report.requests[:4])
    # Calls used prefill CCLs (64, 128, 512) and decode-only ones (96, 112): the decode CCL grew.
    used = {ccl for request in report.requests for ccl in request.result.ccl_history}
    assert used <= {64, 96, 112, 128, 512} and len(used & {96, 112}) >= 1, used


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """(export, transformers model, processor) of benchmarks/device_numerics.py's gemma4-scaled."""
    from qeff_vision.exporter import export_model

    device_numerics = helpers.load_benchmark("device_numerics")
    root = tmp_path_factory.mktemp("gemma4-scaled")
    checkpoint = device_numerics.write_checkpoint("gemma4-scaled", root / "checkpoint")
    export_model(checkpoint, root / "export", progress=None)
    return root / "export", *helpers.load_hf(checkpoint)


def test_scaled_variant_pooler_and_residual_need_the_automatic_plan(scaled):
    """The pooler's sqrt(hidden) scaling and layer 0's residual leave fp16's range (transformers
    agrees in fp32); without a plan device precision overflows, the automatic plan keeps outputs of
    both programs (far fewer than QEfficient's Gemma 4 rule) and the logits stay within 1e-2 of the
    logit range."""
    from qeff_vision.runtime.generate import generator_for_export
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import DeviceOverflow
    from tests.test_device_precision_families import _plans

    export, model, processor = scaled
    seen = {}
    hooks = [
        model.model.vision_tower.pooler.register_forward_hook(lambda m, i, o: seen.update(pool=o[0])),
        model.model.vision_tower.encoder.register_forward_hook(
            lambda m, i, o: seen.update(tower=o.last_hidden_state)
        ),
    ]
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Describe this image."), [helpers.image(100, 150)]
    )
    try:
        hf_tokens, hf_logits = helpers.hf_generate(model, inputs, max_new_tokens=4)
    finally:
        for hook in hooks:
            hook.remove()
    assert float(seen["tower"].abs().max()) < 65504 < float(seen["pool"].abs().max())
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    shape = LanguageShape((bucket,), bucket.vision_size, length + 64)
    with pytest.raises(DeviceOverflow):
        generator_for_export(export, shape, fp32_values={}).generate(
            helpers.as_numpy(inputs), max_new_tokens=2
        )
    plans, _ = _plans(export, length + 3)  # (plans, angle chains)
    assert plans["vision"] and plans["lang"]
    rule = helpers.load_benchmark("device_numerics").qefficient_gemma4_rule(export)
    assert len(plans["vision"]) + len(plans["lang"]) < rule / 4
    result = generator_for_export(export, shape, fp32_values=plans).generate(
        helpers.as_numpy(inputs), max_new_tokens=4, keep_logits=True
    )
    for ours, ref in zip(result.logits, hf_logits):
        assert np.isfinite(ours).all()
        assert np.abs(ours - ref).max() <= 1e-2 * (ref.max() - ref.min())
    assert result.tokens[0] == hf_tokens[0]


def test_all_bidirectional_attention_is_refused_in_one_line(layout):
    """use_bidirectional_attention 'all' (not a causal decoder) is refused by the config view."""
    saved = layout("e").checkpoint.description
    text = {**saved.config["text_config"], "use_bidirectional_attention": "all"}
    with pytest.raises(UserError, match="'all'") as error:
        get_family(FAMILY).layer_caches(ModelDescription({**saved.config, "text_config": text}))
    assert "\n" not in str(error.value)


def test_patch_axis_is_named_max_patches_like_qefficient(exported):
    """QEfficient names Gemma 4's patch-list axis ``max_patches`` (ref: quic/efficient-transformers
    QEffGemma4ForConditionalGeneration.get_onnx_dynamic_axes / get_specializations): the exported
    vision graph, export.json and every spec's specializations (dual, batching, single) use it."""
    from qeff_vision.export_record import read_export
    from qeff_vision.spec import build_specializations, load_spec

    axes = [symbols.BATCH_SIZE, "max_patches"]
    vision = read_export(exported(FAMILY))["programs"]["vision"]
    graph = onnx.load(str(exported(FAMILY) / vision["path"]), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims[symbols.PIXEL_VALUES][:2] == axes and dims["image_position_ids"] == [*axes, 2]
    for name in (symbols.PIXEL_VALUES, "image_position_ids"):
        assert vision["inputs"][name]["axes"] == {"0": axes[0], "1": axes[1]}
    specs = Path(__file__).resolve().parents[1] / "specs" / "gemma4"
    for spec_file in ("gemma-4-e2b-it.yaml", "gemma-4-e2b-it-cb.yaml", "gemma-4-26b-a4b-it.yaml"):
        entries = build_specializations(load_spec(specs / spec_file)).vision.specializations
        expected = sorted([*axes, symbols.VISION_SIZE])
        assert [sorted(entry.symbols) for entry in entries] == [expected] * len(entries), spec_file
    (single,) = build_specializations(load_spec(specs / "gemma-4-e2b-it-single.yaml")).programs
    assert all("max_patches" in entry.symbols for entry in single.specializations)  # encode and keep
    assert not any("num_patches" in entry.symbols for entry in single.specializations)


def test_exports_and_compiles_that_name_num_patches_are_refused_in_one_line(layout, tmp_path, capsys):
    """Before max_patches the axis was num_patches: ``compile --export`` of such an export and
    ``run`` of such a compile stop in one line naming the new symbol; an old OUT/export is stale."""
    import shutil

    import yaml

    from qeff_vision.cli import main
    from qeff_vision.export_record import EXPORT_FILE

    runtime = layout("e")
    export = runtime.language.path.parents[1]
    spec = {
        "name": "tiny-gemma4",
        "model": str(runtime.checkpoint.directory),
        "ctx_len": 512,
        "prefill": {"seq_lens": [64]},
        "vision": {"images": [{"height": 100, "width": 150}]},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    old = tmp_path / "out" / "export"
    old.mkdir(parents=True)
    text = (export / EXPORT_FILE).read_text()
    assert '"max_patches"' in text
    (old / EXPORT_FILE).write_text(text.replace('"max_patches"', '"num_patches"'))
    for name in ("vision", "lang"):
        shutil.copytree(export / name, old / name)

    def one_line(command):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    err = one_line(["compile", str(path), "-o", str(tmp_path / "o2"), "--dry-run", "--export", str(old)])
    assert "former symbol 'num_patches' (now 'max_patches')" in err and "export it again" in err
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert f"{old} is stale" in captured.out + captured.err
    compiled = helpers.write_vision_manifest(
        tmp_path / "compiled", FAMILY, {"batch_size": "1", "num_patches": "54", "vision_size": "6"}
    )
    err = one_line(["run", str(compiled), "--prompt", "Hi"])
    assert "former symbol 'num_patches' (now 'max_patches')" in err and "compile it again" in err


def test_max_soft_tokens_is_a_spec_option_that_reaches_the_runtime(layout, tmp_path, capsys):
    """vision.image_processor.max_soft_tokens sets the image budget: the vision specialization
    binds it, compile writes it into OUT's processor config, and the processor ``run`` loads from
    OUT pads that resolution's patch list to exactly the compiled patch count."""
    import json

    import yaml

    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.cli import main
    from qeff_vision.spec import load_spec

    runtime = layout("e")
    spec = {
        "name": "tiny-gemma4-140",
        "model": str(runtime.checkpoint.directory),
        "ctx_len": 512,
        "prefill": {"seq_lens": [64, 160]},
        "vision": {"images": [{"height": 100, "width": 150}], "image_processor": {"max_soft_tokens": 140}},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    family, checkpoint = get_family(FAMILY), runtime.checkpoint.description
    image = load_spec(path).vision.images[0]
    tokens = {70: family.image_tokens(checkpoint, image)}
    tokens[140] = family.image_tokens(load_spec(path).model_description, image)
    assert tokens == {70: 60, 140: 126}  # the tiny's own budget is 70
    assert family.vision_symbols(load_spec(path).model_description, image)[symbols.VISION_SIZE] == 140
    out = tmp_path / "out"
    command = [
        "compile",
        str(path),
        "-o",
        str(out),
        "--backend",
        "onnxruntime",
        "--export",
        str(runtime.language.path.parents[1]),
    ]
    assert main(command) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    compiled = manifest["programs"]["vision"]["specializations"]
    processor = Checkpoint.open(out / manifest["runtime_model"]).processor  # what `run` loads
    processed = processor.image_processor(images=[helpers.image(100, 150)], return_tensors="np")
    # The program binds the budget the processor pads every list to; the image's own patches lead.
    padded, patches = (
        processed["image_position_ids"].shape[1],
        int((processed["image_position_ids"][0] >= 0).all(-1).sum()),
    )
    assert [int(entry["symbols"]["max_patches"]) for entry in compiled] == [padded] == [140 * 9]
    assert patches == 126 * 9
    bad = {**spec, "vision": {**spec["vision"], "image_processor": {"max_soft_tokens": 100}}}
    path.write_text(yaml.safe_dump(bad))
    assert main(["validate", str(path)]) == 2
    assert "must be one of 70, 140, 280, 560, 1120" in capsys.readouterr().err


@pytest.mark.parametrize("name", ("moe", "dense"))
def test_three_stage_parity_of_the_26b_and_31b_layouts(name, layout):
    """transformers vs export-patched torch vs onnxruntime (the registry suite does the E layout):
    the vision program at three aspect ratios, and the patched decoder's last logits on a prompt
    whose image attends both ways on sliding layers (transformers given mm_token_type_ids)."""
    import torch

    from qeff_vision.contract.language_io import KV_ROLES
    from qeff_vision.export.decoder import LanguageDecoder
    from qeff_vision.exporter import example_values, load_adapter

    runtime = layout(name)
    model, processor, family = runtime.model, runtime.processor, get_family(FAMILY)
    adapter = load_adapter(family)
    encoder = adapter.vision_encoder(model)
    host = family.host(runtime.checkpoint.description)
    for seed, (height, width) in enumerate(adapter.test_image_sizes):
        processed = processor.image_processor(
            images=[helpers.image(height, width, seed)], return_tensors="pt"
        )
        reference = adapter.hf_image_features(model, processed)[0].numpy()
        inputs = host.vision_inputs(helpers.as_numpy(processed))[0]
        with torch.no_grad():
            patched = encoder(*[torch.as_tensor(v) for v in inputs.values()])[0].numpy()
        onnx = runtime.vision.run(inputs)[symbols.VISION_EMBEDS][0]
        # The padded list's budget of rows, the image's own first (transformers strips the rest).
        own = host.own_rows(inputs)
        assert (
            patched.shape
            == onnx.shape
            == (family.config(runtime.checkpoint.description).max_soft_tokens, reference.shape[1])
        )
        assert own == reference.shape[0] and not onnx[own:].any() and not patched[own:].any()
        patched, onnx = patched[:own], onnx[:own]
        assert max(np.abs(patched - reference).max(), np.abs(onnx - reference).max()) <= 1e-4, (height, width)
    inputs = helpers.process(processor, helpers.user_turn("<image>", "Hi"), [helpers.image(90, 120, 3)])
    assert "mm_token_type_ids" in inputs
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    description = runtime.checkpoint.description
    io = family.language_table(description)
    decoder = LanguageDecoder(adapter.decoder_parts(model), io).eval()
    length = inputs["input_ids"].shape[1]
    values = {**example_values(family, description), symbols.CTX_LEN: length + 8, symbols.SLIDING_WINDOW: 8}
    past = [torch.zeros(row.concrete_shape(values)) for row in io.rows(*KV_ROLES)]
    features = torch.cat(adapter.hf_image_features(model, inputs)).unsqueeze(0)
    positions = torch.arange(length).view(1, -1)
    with torch.no_grad():
        logits = decoder(
            inputs["input_ids"], positions, features, torch.zeros(1, 1, dtype=torch.int64), *past
        )[0]
    assert np.abs(logits[0, -1].numpy() - reference).max() <= 1e-3
    # The image's two-way links matter: the same decoder with causal image attention differs.
    causal_parts = adapter.decoder_parts(model)
    causal_parts.bidirectional_images = False
    with torch.no_grad():
        causal = LanguageDecoder(causal_parts, io).eval()(
            inputs["input_ids"], positions, features, torch.zeros(1, 1, dtype=torch.int64), *past
        )[0]
    assert np.abs(causal[0, -1].numpy() - reference).max() > 1e-3


def test_single_program_moves_bidirectional_images_whole(layout):
    """``deployment: single`` on the 31B layout ("vision" attention: images move whole): a three-turn
    chat token-identical to transformers, the encoder run on 1, 0 and 1 images."""
    from qeff_vision.compile.single_program import write_single_program
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import OnnxProgram
    from qeff_vision.runtime.single import SingleGenerator
    from tests.family_runtime import CTX_LEN

    runtime = layout("dense")
    vision, language = runtime.vision.path, runtime.language.path
    program = OnnxProgram(write_single_program(vision.parent.parent, vision, language))
    rows = 160  # two tiny images' soft tokens at most (about 60 each)
    buckets = tuple(PrefillBucket(seq_len, rows) for seq_len in (16, 96))
    generator = SingleGenerator(runtime.checkpoint, program, LanguageShape(buckets, rows, CTX_LEN))
    chat = Conversation(generator, runtime.processor, max_new_tokens=NEW_TOKENS)
    turns = [
        ([helpers.image(100, 150, 5)], "Describe."),
        ([], "And the colours?"),
        ([helpers.image(90, 120, 6)], "Compare."),
    ]
    encoded = []
    for number, (images, text) in enumerate(turns, 1):
        result = chat.ask(images, text, keep_logits=True)
        runtime.check(result, chat.last_inputs.processed, f"dense single turn {number}")
        encoded.append((result.encoder_calls, result.images_encoded))
        if images:  # the image's placeholders sit in one chunk (bidirectional on sliding layers)
            plan = generator.plan(
                chat.last_inputs.processed["input_ids"].reshape(-1), chat.last_inputs.processed, "chunk"
            )
            assert all(len(chunks_of_image(plan, i)) == 1 for i in range(len(plan.segments)))
    assert encoded == [(1, 1), (0, 0), (1, 1)]


def test_the_vision_program_takes_the_padded_patch_list_vllm_sends(layout):
    """vLLM sends the processor's patch list padded to the max_soft_tokens budget (630 patches on the
    tiny, 70 x 3 x 3): the host sends it unchanged, every resolution binds that one max_patches, and
    the program's output holds the image's own rows first (those transformers keeps), zeros after."""
    from qeff_vision.families.base import ImageSize

    runtime = layout("e")
    family, description = get_family(FAMILY), runtime.checkpoint.description
    host = family.host(description)
    budget = family.config(description).max_soft_tokens * family.config(description).pooling_kernel_size ** 2
    assert budget == 630
    for seed, (height, width) in enumerate(((100, 150), (150, 100), (64, 64))):
        processed = runtime.processor.image_processor(
            images=[helpers.image(height, width, seed)], return_tensors="pt"
        )
        numpy = helpers.as_numpy(processed)
        (inputs,) = host.vision_inputs(numpy)
        assert all(np.array_equal(inputs[name], numpy[name]) for name in inputs)  # as vLLM sends it
        assert inputs[symbols.PIXEL_VALUES].shape[1] == budget
        assert family.vision_symbols(description, ImageSize(height, width))["max_patches"] == budget
        reference = load_reference(runtime, processed)
        output = runtime.vision.run(inputs)[symbols.VISION_EMBEDS][0]
        own = host.own_rows(inputs)
        assert own == len(reference) == family.image_tokens(description, ImageSize(height, width)) < 70
        assert np.abs(output[:own] - reference).max() <= 1e-4 and not output[own:].any()


def load_reference(runtime: FamilyRuntime, processed) -> np.ndarray:
    """transformers' image features of one processed image (padding stripped by its pooler mask)."""
    from qeff_vision.exporter import load_adapter

    return load_adapter(get_family(FAMILY)).hf_image_features(runtime.model, processed)[0].numpy()


def test_declared_data_gives_the_last_full_layer_and_per_layer_shapes():
    """No override reads them: ``last_layer_type`` forces the last layer full, the states carry shapes.

    The pinned E2B config with its last layer listed as sliding reads as transformers'
    ``Gemma4TextConfig`` does (last layer full); every own-cache state has its layer's KV heads and
    head dim, so the full layers' wider head needs no symbol of the family's own.
    """
    config_path = Path(__file__).resolve().parents[1] / "specs" / "configs" / "gemma-4-E2B-it" / "config.json"
    pinned = describe_checkpoint(config_path.parent, config_path)
    text = dict(pinned.config["text_config"])
    text["layer_types"] = [*text["layer_types"][:-1], "sliding_attention"]
    edited = ModelDescription({**pinned.config, "text_config": text}, pinned.processor)
    family = get_family(FAMILY)
    for model in (pinned, edited):
        types = family.layer_types(model)
        assert types[-1] == "full_attention" and types == list(family.config(model).layer_types)
        view, states = family.config(model), family.layer_caches(model)
        for layer, state in enumerate(states):
            if state.reads is None:
                assert (state.kv_heads, state.head_dim) == (view.kv_heads[layer], view.head_dims[layer])
        widths = {state.head_dim for state in states if state.reads is None}
        assert len(widths) == 2, widths  # sliding and full layers differ (head_dim 256, global 512)
        assert family.language_symbols(model) == {}
