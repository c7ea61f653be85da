"""Spec key ``retain_full_kv``: ring layers keep a ``ctx_len`` cache, masked to their window.

Tiny Gemma 3 (window 8, 5 of 6 layers sliding) exported for continuous batching with the option:
the ONNX KV of every sliding layer is ``ctx_len`` long; five staggered requests through a
disaggregated pair (prefill at batch 1, decode at ``full_batch_size`` 4, each finished prefill's
KV copied into its decode slot) match transformers generate alone; a compile of the same export
serves a three-turn chat with images (every turn well past the window) and a decode of more
tokens than the window, token-identical to transformers. Tiny Gemma 4 (sliding layers and layers
that read an earlier layer's cache) and Llama 4 (chunked-attention layers: the block mask over a
full cache) do the same five requests. Spec checks run on pinned configs; the stand-in compiler
takes the Gemma 3 export's three programs. Cost: three tiny exports shared by the module.
"""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.compile.driver import compile_spec
from qeff_vision.contract.full_kv import full_length_caches, has_rings, keeps_full_kv
from qeff_vision.contract.language_io import KV_ROLES, SLIDING_ATTENTION
from qeff_vision.errors import UserError
from qeff_vision.families import describe_checkpoint, get_family
from qeff_vision.runtime.disaggregated import DisaggregatedSlots, phase_programs
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.generate import make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.spec import build_specializations, load_spec
from tests import helpers
from tests.compile_fixtures import REPO, calls, stand_in
from tests.family_runtime import CTX_LEN, FamilyRuntime
from tests.test_batched_engine import SLOTS, check_against_transformers, five_requests
from tests.test_spec_helpers import problems_of, spec_data
from tests.test_spec_helpers import write_spec as write_spec_data

SEQ_LENS = (32, 128)
GOLDEN_SPEC = REPO / "specs" / "gemma3" / "gemma-3-4b-it-disaggregated-full-kv.yaml"


@pytest.fixture(scope="module")
def full_kv_export(tiny_checkpoint, tmp_path_factory):
    """``full_kv_export(family) -> Path``: the tiny checkpoint's CB export with ``retain_full_kv``."""
    from qeff_vision.exporter import export_model

    built = {}

    def build(family: str):
        if family not in built:
            out = tmp_path_factory.mktemp(f"full-kv-{family}") / "export"
            export_model(
                tiny_checkpoint(family), out, continuous_batching=True, retain_full_kv=True, progress=None
            )
            built[family] = out
        return built[family]

    return build


def _sliding_layers(runtime: FamilyRuntime) -> list[int]:
    types = runtime.family.layer_types(runtime.checkpoint.description)
    return [layer for layer, kind in enumerate(types) if kind == SLIDING_ATTENTION]


def test_sliding_layers_keep_ctx_len_in_the_onnx(full_kv_export, hf_model):
    export = full_kv_export("gemma3")
    manifest = json.loads((export / "export.json").read_text())
    assert manifest["retain_full_kv"] is True
    graph = onnx.load(str(export / manifest["programs"]["lang"]["path"]), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    outputs = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.output
    }
    runtime = FamilyRuntime("gemma3", export, *hf_model("gemma3"))
    sliding = _sliding_layers(runtime)
    assert sliding and len(sliding) < len(runtime.family.layer_types(runtime.checkpoint.description))
    for layer in sliding:
        for name in (symbols.past_key(layer), symbols.past_value(layer)):
            assert dims[name][0] == symbols.FULL_BATCH_SIZE and dims[name][2] == symbols.CTX_LEN, name
            assert outputs[symbols.retained(name)][2] == symbols.CTX_LEN
    assert not any(symbols.SLIDING_WINDOW in shape for shape in dims.values())
    # The runtime reads the option off the graph: its table sizes every cache to ctx_len.
    generator = runtime.generator(SEQ_LENS)
    assert keeps_full_kv(runtime.family.language_table(runtime.checkpoint.description, False, True), dims)
    assert all(row.shape[2] == symbols.CTX_LEN for row in generator.io.rows(*KV_ROLES))


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "llama4"])
def test_five_staggered_requests_disaggregated_with_full_length_caches(family, full_kv_export, hf_model):
    model, processor = hf_model(family)
    runtime = FamilyRuntime(family, full_kv_export(family), model, processor)
    prefill = [
        {symbols.BATCH_SIZE: 1, symbols.FULL_BATCH_SIZE: 1, symbols.SEQ_LEN: s, symbols.VISION_SIZE: s}
        for s in SEQ_LENS
    ]
    decode = [{symbols.BATCH_SIZE: SLOTS, symbols.FULL_BATCH_SIZE: SLOTS, symbols.SEQ_LEN: 1}]
    router = phase_programs(runtime.language, prefill, decode)
    shape = LanguageShape(tuple(PrefillBucket(s, s) for s in SEQ_LENS), max(SEQ_LENS), CTX_LEN)
    generator = make_generator(runtime.checkpoint, runtime.vision, router, shape, EmbeddingCache(64 * 2**20))
    requests = five_requests(runtime)
    engine = BatchedEngine(generator)
    assert isinstance(engine.slots, DisaggregatedSlots) and engine.full_batch_size == SLOTS
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    check_against_transformers(runtime, requests, report)
    # Every prompt runs past the window (the block, Llama 4's chunked layers); each hand-off
    # carried ctx_len positions on every layer.
    text = runtime.family.text_geometry(runtime.checkpoint.description)
    assert min(done.result.prompt_tokens for done in report.requests) > (
        text.sliding_window or text.attention_chunk_size
    )
    assert router.handoffs == len(requests)
    cache = generator.empty_cache(1)
    assert all(array.shape[2] == CTX_LEN for array in cache.values())
    assert router.handoff_bytes == len(requests) * sum(array.nbytes for array in cache.values())
    fifth = report.requests[4]
    assert any(r.slot == fifth.slot and r.finished_step < fifth.admitted_step for r in report.requests[:4])


@pytest.fixture(scope="module", params=["continuous-batching", "batch-1"])
def compiled(request, full_kv_export, tiny_checkpoint, tmp_path_factory):
    """Tiny Gemma 3 compiled disaggregated with the option (onnxruntime backend), two images beside it.

    ``continuous-batching``: the module's export, decode at ``full_batch_size`` 4; ``batch-1``: a
    batch-1 decode program, exported by compile itself (it reads the option off the spec).
    """
    root = tmp_path_factory.mktemp("full-kv-compiled")
    spec = {
        "name": "gemma3-full-kv",
        "model": str(tiny_checkpoint("gemma3")),
        "ctx_len": CTX_LEN,
        "deployment": "disaggregated",
        "retain_full_kv": True,
        "prefill": {"seq_lens": list(SEQ_LENS)},
        "vision": {"images": [{"height": 336, "width": 336}], "max_images": 2},
    }
    args = ["compile", str(root / "spec.yaml"), "-o", str(root / "out"), "--backend", "onnxruntime"]
    if request.param == "continuous-batching":
        spec["full_batch_size"] = SLOTS
        args += ["--export", str(full_kv_export("gemma3"))]
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(args) == 0
    for name, (height, width) in {"a": (112, 112), "b": (140, 196)}.items():
        helpers.image(height, width, len(name)).save(root / f"{name}.png")
    return root


def test_three_turns_past_the_window_and_a_long_decode_match_transformers(compiled, capsys):
    out = str(compiled / "out")
    manifest = json.loads((compiled / "out" / "manifest.json").read_text())
    decode = manifest["programs"]["lang_decode"]["specializations"]
    assert all(symbols.SLIDING_WINDOW not in entry["symbols"] for entry in decode)
    own_export = compiled / "out" / "export" / "export.json"  # batch-1: compile exported it
    assert not own_export.is_file() or json.loads(own_export.read_text())["retain_full_kv"] is True
    # Three turns with images: every turn's prompt reaches past the 8-token window, and each
    # turn's prefill continues the cache the decode program wrote.
    turns = ["--prompt", "Describe it.", "--prompt", "And the colours?", "--prompt", "Thanks. Summarise."]
    args = ["run", out, "--image", str(compiled / "a.png"), *turns, "--max-new-tokens", "4", "--compare-hf"]
    assert main(args) == 0
    assert capsys.readouterr().err.count("tokens identical to transformers generate") == 3
    # A decode longer than the window: 12 new tokens on the decode program (window 8).
    args = ["run", out, "--prompt", "Write a poem.", "--max-new-tokens", "12", "--compare-hf"]
    assert main(args) == 0
    assert "tokens identical to transformers generate" in capsys.readouterr().err


def test_layer_caches_become_full_length_only_on_rings():
    description = describe_checkpoint(GOLDEN_SPEC.parent.parent / "configs" / "gemma-3-4b-it")
    family = get_family("gemma3")
    caches = family.layer_caches(description)
    full = full_length_caches(caches)
    assert has_rings(caches) and not has_rings(full)
    assert all(c.length == symbols.CTX_LEN for c in full)
    assert [c.kv_heads for c in full] == [c.kv_heads for c in caches]
    assert not has_rings(
        get_family("llava").layer_caches(describe_checkpoint(REPO / "specs" / "configs" / "llava-1.5-7b-hf"))
    )


def test_spec_key_needs_disaggregated_and_ring_layers_each_in_one_line(tmp_path):
    gemma = load_spec(GOLDEN_SPEC)
    data = yaml.safe_load(GOLDEN_SPEC.read_text())
    data["config"] = str((GOLDEN_SPEC.parent / data["config"]).resolve())
    data.pop("deployment")
    data.pop("full_batch_size", None)
    assert problems_of(write_spec_data(tmp_path, data)) == [
        "retain_full_kv: keeps full-length caches on ring layers so the KV a prefill program hands "
        "to a decode program holds every position; it needs deployment: disaggregated"
    ]
    assert gemma.deployment.retain_full_kv
    # Qwen2.5-VL (the helpers' spec): every layer is full attention, nothing to keep full length.
    problems = problems_of(
        write_spec_data(tmp_path, spec_data(deployment="disaggregated", retain_full_kv=True))
    )
    assert problems == [
        "retain_full_kv: Qwen2.5-VL's layers keep no ring (no sliding-window or chunked-attention layer "
        "in this config): every cache is already full length"
    ]
    problems = problems_of(
        write_spec_data(tmp_path, spec_data(deployment="disaggregated", retain_full_kv="yes"))
    )
    assert problems == ["retain_full_kv: must be true or false (got 'yes')"]


def test_validate_notes_the_kv_bytes_it_costs(capsys):
    assert main(["validate", str(GOLDEN_SPEC)]) == 0
    captured = capsys.readouterr()
    (note,) = [line for line in captured.err.splitlines() if "retain_full_kv" in line]
    assert "note:" in note and "MiB" in note and "ring" in note


def test_specializations_drop_the_window_symbol(tmp_path):
    result = build_specializations(load_spec(GOLDEN_SPEC))
    for files in result.programs[1:]:
        for entry in files.specializations:
            assert symbols.SLIDING_WINDOW not in entry.symbols and entry.symbols[symbols.CTX_LEN] == "8192"


def test_stand_in_compiler_takes_the_full_kv_programs(full_kv_export, tiny_checkpoint, tmp_path):
    spec = {
        "name": "gemma3-full-kv-stand-in",
        "model": str(tiny_checkpoint("gemma3")),
        "ctx_len": 256,
        "deployment": "disaggregated",
        "retain_full_kv": True,
        "full_batch_size": SLOTS,
        "prefill": {"seq_lens": [32]},
        "vision": {"images": [{"height": 336, "width": 336}]},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    compiler, record = stand_in(tmp_path)
    compile_spec(
        tmp_path / "spec.yaml",
        tmp_path / "out",
        compiler=compiler,
        export_dir=full_kv_export("gemma3"),
        progress=None,
        status_stream=None,
        env={},
    )
    programs = {call["argv"][-2].split("/")[-2] for call in calls(record)}
    assert programs == {"vision", "lang_prefill", "lang_decode"}
    # An export without the option (its record says so) is refused for this spec, in one line.
    plain = tmp_path / "plain-export"
    shutil.copytree(full_kv_export("gemma3"), plain)
    record_path = plain / "export.json"
    record_path.write_text(json.dumps({**json.loads(record_path.read_text()), "retain_full_kv": False}))
    with pytest.raises(UserError) as refused:
        compile_spec(
            tmp_path / "spec.yaml",
            tmp_path / "out2",
            compiler=compiler,
            export_dir=plain,
            progress=None,
            env={},
        )
    assert "full-length caches on ring layers" in str(refused.value) and "\n" not in str(refused.value)


def test_export_refuses_the_option_without_ring_layers(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(tiny_checkpoint("llava")), "-o", str(out), "--retain-full-kv", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no ring layer in this config, so no cache to keep full length") and "\n" not in err
    assert not out.exists()
