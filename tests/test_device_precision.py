"""Device numerics on a Gemma 3 tiny variant whose residual stream leaves fp16's range.

The checkpoint is the tiny Gemma 3 with layer 0's ``post_feedforward_layernorm`` weight set to
50,000: (1 + w) is still an fp16 number, but it scales the normalized MLP output past 65,504, so
the residual add and everything reading it overflow at device precision. transformers (fp32) is
the reference throughout.

* ``node_precision: none``: compile --backend onnxruntime and a device-precision run both fail
  with one line naming the first node beyond fp16's range.
* ``auto``: the plan keeps far fewer outputs than "every non-matmul output"; device precision has
  no inf/NaN and its logits stay within 1e-2 of the logit range at every step of the chunking
  edge cases, tokens identical wherever transformers' top-1/top-2 margin exceeds the deviation.
* The plan reaches the compiler (``-node-precision-info``), its hash is in the manifest, a changed
  plan recompiles, and ``--dry-run`` names the plan file.
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import yaml

from qeff_vision import symbols
from qeff_vision.cli import main
from qeff_vision.numerics.plan import read_plan, write_plan
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import DeviceOverflow
from tests import helpers
from tests.compile_fixtures import calls, stand_in
from tests.test_gemma3_runtime import BUCKETS, CTX_LEN, NEW_TOKENS, PROMPTS

SCALED_WEIGHT = "layers.0.post_feedforward_layernorm.weight"
SCALE = 5e4
OVERFLOWING_NODE = "/text_model/layers.0/post_feedforward_layernorm/CustomRMSNorm"
RELATIVE_TOLERANCE = 1e-2
CASES = [(name, buckets) for name in PROMPTS for buckets in ("s16", "s16+s24", "s48")]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """(checkpoint, export, transformers model, processor) of the scaled tiny Gemma 3."""
    import torch
    from safetensors.torch import load_file, save_file

    from qeff_vision.exporter import export_model

    directory = helpers.write_tiny("gemma3", tmp_path_factory.mktemp("scaled") / "checkpoint")
    weights = next(directory.glob("*.safetensors"))
    tensors = load_file(str(weights))
    (key,) = [k for k in tensors if k.endswith(SCALED_WEIGHT)]
    tensors[key] = torch.full_like(tensors[key], SCALE)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    export = tmp_path_factory.mktemp("scaled-export") / "export"
    export_model(directory, export, progress=None)
    model, processor = helpers.load_hf(directory)
    return directory, export, model, processor


def _spec(path, checkpoint, node_precision, language_plan=None):
    data = {
        "name": "scaled-gemma3",
        "model": str(checkpoint),
        "ctx_len": 128,
        "prefill": {"seq_lens": [16, 48]},
        "vision": {"images": [{"height": 112, "width": 112}], "vision_size": "chunk"},
        "compile": {"node_precision": node_precision},
    }
    if language_plan:  # a plan file names one graph's nodes: it belongs to one program
        data["compile"]["language"] = {"node_precision": language_plan}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _compile(scaled, tmp_path, node_precision, *extra):
    checkpoint, export, _, _ = scaled
    spec = _spec(tmp_path / "spec.yaml", checkpoint, node_precision)
    out = tmp_path / "out"
    return main(["compile", str(spec), "-o", str(out), "--export", str(export), *extra]), out


def _generator(export, buckets, plans):
    prefill = tuple(PrefillBucket(s, v) for s, v in BUCKETS[buckets])
    shape = LanguageShape(prefill, max(b.vision_size for b in prefill), CTX_LEN)
    common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: CTX_LEN}
    compiled = [{**common, symbols.SEQ_LEN: b.seq_len, symbols.VISION_SIZE: b.vision_size} for b in prefill]
    compiled.append({**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: shape.decode_vision_size})
    return generator_for_export(export, shape, language_specializations=compiled, fp32_values=plans)


def _inputs(processor, name):
    parts, sizes = PROMPTS[name]
    images = [helpers.image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    return helpers.process(processor, helpers.user_turn(*parts), images)


def test_residual_really_leaves_fp16_range(scaled):
    """The premise: transformers' own fp32 residual after layer 0 exceeds 65,504."""
    _, _, model, processor = scaled
    seen = []
    hook = model.model.language_model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        helpers.hf_generate(model, _inputs(processor, "one_image"), 1)
    finally:
        hook.remove()
    output = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
    assert float(output.abs().max()) > 65504


def test_none_fails_naming_the_overflowing_node(scaled, tmp_path, capsys):
    code, out = _compile(scaled, tmp_path, "none", "--backend", "onnxruntime")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (out / "manifest.json").exists()
    assert f"node {OVERFLOWING_NODE} output" in err[-1] and "65504" in err[-1]
    # The runtime at device precision without a plan fails the same way, on a real prompt.
    _, export, _, processor = scaled
    generator = _generator(export, "s48", {})
    with pytest.raises(DeviceOverflow, match=OVERFLOWING_NODE):
        generator.generate(helpers.as_numpy(_inputs(processor, "one_image")), max_new_tokens=2)


@pytest.fixture(scope="module")
def auto_plan(scaled, tmp_path_factory):
    """(compile OUT, manifest) of an onnxruntime compile with the automatic plan."""
    code, out = _compile(scaled, tmp_path_factory.mktemp("auto"), "auto", "--backend", "onnxruntime")
    assert code == 0
    return out, json.loads((out / "manifest.json").read_text())


def test_auto_plan_is_small_and_verified(auto_plan):
    out, manifest = auto_plan
    lang = manifest["programs"]["lang"]
    plan = lang["node_precision"]
    names = read_plan(out / plan["path"])
    assert 0 < plan["nodes"] == len(names) < plan["non_matmul_outputs"] / 4
    assert f"{OVERFLOWING_NODE}_output_0" in names
    assert manifest["programs"]["vision"]["node_precision"]["path"] is None  # nothing to keep
    for run in lang["verification"]["runs"] + manifest["programs"]["vision"]["verification"]["runs"]:
        device = run["device_precision"]
        assert device["finite"] and device["max_relative"] <= RELATIVE_TOLERANCE


@pytest.mark.parametrize(("name", "buckets"), CASES)
def test_auto_plan_matches_transformers_at_device_precision(name, buckets, scaled, auto_plan):
    """Every step within 1e-2 of the logit range; tokens identical where the margin is clear."""
    _, export, model, processor = scaled
    out, manifest = auto_plan
    plans = {
        program: read_plan(out / entry["node_precision"]["path"]) if entry["node_precision"]["path"] else []
        for program, entry in manifest["programs"].items()
    }
    inputs = _inputs(processor, name)
    hf_tokens, hf_logits = helpers.hf_generate(model, inputs, NEW_TOKENS)
    result = _generator(export, buckets, plans).generate(
        helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS, keep_logits=True
    )
    for step, (ours, ref) in enumerate(zip(result.logits, hf_logits)):
        assert np.isfinite(ours).all()
        deviation = np.abs(ours - ref).max()
        assert deviation <= RELATIVE_TOLERANCE * (ref.max() - ref.min()), (step, deviation)
        top = np.sort(ref)[-2:]
        if top[1] - top[0] > 2 * deviation:
            assert result.tokens[step] == hf_tokens[step], step
        if result.tokens[step] != hf_tokens[step]:
            break  # a near-tie went the other way: later steps see different prefixes


def test_plan_reaches_the_compiler_and_its_hash_recompiles(scaled, tmp_path, capsys):
    compiler, record = stand_in(tmp_path)
    code, out = _compile(scaled, tmp_path, "auto", "--compiler", str(compiler))
    assert code == 0, capsys.readouterr().err
    plan_file = out / "lang" / "node_precision.yaml"
    lang_argv = next(c["argv"] for c in calls(record) if "-retained-state" in c["argv"])
    # The compiler ran in OUT's staging directory (renamed to OUT when it succeeded).
    lang_argv = [re.sub(r"/\.out\.staging\.[^/]+/", "/out/", argument) for argument in lang_argv]
    assert f"-node-precision-info={plan_file}" in lang_argv
    manifest = json.loads((out / "manifest.json").read_text())
    digest = hashlib.sha256(plan_file.read_bytes()).hexdigest()
    assert manifest["programs"]["lang"]["node_precision"]["sha256"] == digest
    vision_argv = next(c["argv"] for c in calls(record) if "-retained-state" not in c["argv"])
    assert not any(a.startswith("-node-precision-info") for a in vision_argv)

    # The same compile again: the calibration is remembered, both programs come from the cache.
    capsys.readouterr()
    spec = tmp_path / "spec.yaml"
    again = ["compile", str(spec), "-o", str(out), "--export", str(scaled[1]), "--compiler", str(compiler)]
    before = len(calls(record))
    assert main(again) == 0
    assert "calibrating" not in capsys.readouterr().err and len(calls(record)) == before
    assert (
        f"-node-precision-info={plan_file}"
        in json.loads((out / "manifest.json").read_text())["programs"]["lang"]["argv"]
    )

    # --dry-run names the plan file; a user's plan (a subset) changes the language key only.
    assert main([*again, "--dry-run"]) == 0
    dry = capsys.readouterr()
    assert f"node precision plan {plan_file}" in dry.err and f"-node-precision-info={plan_file}" in dry.out
    write_plan(tmp_path / "mine.yaml", read_plan(plan_file)[:3])
    _spec(spec, scaled[0], "auto", language_plan="mine.yaml")
    before = len(calls(record))
    assert main(again) == 0
    recompiled = calls(record)[before:]
    assert [("-retained-state" in c["argv"]) for c in recompiled] == [True]  # vision stayed cached
    assert read_plan(plan_file) == read_plan(tmp_path / "mine.yaml")


def test_mx_formats_are_reported_on_top_of_fp16(scaled, tmp_path, capsys):
    """-mxfp6-matmul (language default) and an MXINT8 KV cache: their deviation is in the report."""
    checkpoint, export, _, _ = scaled
    spec = _spec(tmp_path / "spec.yaml", checkpoint, "auto")
    data = yaml.safe_load(spec.read_text())
    data["compile"]["language"] = {"kv_cache_dtype": "mxint8"}
    spec.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert (
        main(["compile", str(spec), "-o", str(out), "--export", str(export), "--backend", "onnxruntime"]) == 0
    )
    assert "fp16 + mxfp6 fp6_e2m3 + mxint8 KV" in capsys.readouterr().out
    runs = json.loads((out / "manifest.json").read_text())["programs"]["lang"]["verification"]["runs"]
    for run in runs:
        fp16, mx = run["device_precision"], run["device_precision_mx"]
        assert mx["finite"] and mx["max_abs"] > fp16["max_abs"]  # the formats do round


def test_run_at_device_precision_from_the_cli(auto_plan, tmp_path, capsys):
    """`run --precision device` uses the compiled plan and matches transformers' tokens here."""
    out, _ = auto_plan
    image = tmp_path / "image.png"
    helpers.image(100, 150).save(image)
    common = [
        "run",
        str(out),
        "--image",
        str(image),
        "--prompt",
        "Describe this image.",
        "--max-new-tokens",
        "4",
    ]
    assert main([*common, "--precision", "device", "--compare-hf"]) == 0
    assert "compare-hf: tokens identical" in capsys.readouterr().err
    assert main([*common, "--precision", "device-mx"]) == 0  # MXFP6 weights: runs, tokens may differ
