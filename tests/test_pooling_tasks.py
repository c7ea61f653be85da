"""Spec ``task: embed | score``: the pooling programs against transformers on the same processed inputs.

Tiny Qwen3-VL checkpoints (the family that declares the pooling tasks); the reranker is the tiny
checkpoint with ``yes`` and ``no`` added as tokens (random rows), as the published reranker's
tokenizer has them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qeff_vision.cli import main
from qeff_vision.contract.language_io import Role
from qeff_vision.contract.tasks import EMBED, SCORE, pooled_io
from qeff_vision.errors import UserError
from qeff_vision.families import all_families, get_family
from qeff_vision.runtime.pooling import Pooler, matryoshka, reference_pool
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

FAMILY = "qwen3_vl"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    embedder = tiny_checkpoint(FAMILY)
    reranker = helpers.with_score_tokens(embedder, tmp_path_factory.mktemp("reranker") / "ckpt")
    return {EMBED: embedder, SCORE: reranker}


@pytest.fixture(scope="module")
def pooled_exports(checkpoints, tmp_path_factory):
    from qeff_vision.exporter import export_model

    built = {}
    for task, checkpoint in checkpoints.items():
        out = tmp_path_factory.mktemp(f"pooled-{task}") / "export"
        export_model(checkpoint, out, task=task, progress=None)
        built[task] = out
    return built


def _pooler(export_dir: Path, task: str, specializations=None) -> Pooler:
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.exporter import read_export

    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
    language = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"], specializations)
    return Pooler(checkpoint, vision, language, task)


PROMPTS = {
    "text": ((), ["A woman playing with her dog on a beach at sunset."]),
    "image": (((112, 112, 0),), ["<image>", "Represent this picture."]),
    "two_images": (((112, 140, 1), (84, 196, 2)), ["<image>", "between", "<image>", "both."]),
}


def _processed(checkpoint_dir: Path, prompt: str):
    model, processor = helpers.load_hf(checkpoint_dir)
    sizes, parts = PROMPTS[prompt]
    images = [helpers.image(h, w, seed) for h, w, seed in sizes]
    return model, helpers.process(processor, helpers.user_turn(*parts), images)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_embedding_matches_transformers(pooled_exports, checkpoints, prompt):
    model, processed = _processed(checkpoints[EMBED], prompt)
    reference = reference_pool(model, processed, EMBED)
    ours = _pooler(pooled_exports[EMBED], EMBED).pool(helpers.as_numpy(processed))
    cosine = float(np.dot(ours, reference) / (np.linalg.norm(ours) * np.linalg.norm(reference)))
    assert ours.shape == (model.config.text_config.hidden_size,)
    assert abs(np.linalg.norm(ours) - 1) < 1e-5
    assert cosine >= 0.9999, cosine


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_score_matches_transformers(pooled_exports, checkpoints, prompt):
    from qeff_vision.exporter import read_export

    ids = read_export(pooled_exports[SCORE])["score_token_ids"]
    model, processed = _processed(checkpoints[SCORE], prompt)
    reference = reference_pool(model, processed, SCORE, ids)
    ours = _pooler(pooled_exports[SCORE], SCORE).pool(helpers.as_numpy(processed))
    assert ours.shape == (1,)
    assert 0.0 < ours[0] < 1.0
    assert abs(float(ours[0]) - float(reference[0])) <= 1e-4, (ours, reference)


def test_a_prompt_runs_in_the_smallest_bucket_that_holds_it(pooled_exports, checkpoints):
    """Padding to a larger bucket (position -1, zero rows) changes nothing; too long is refused."""
    _, processed = _processed(checkpoints[EMBED], "image")
    inputs = helpers.as_numpy(processed)
    length = inputs["input_ids"].shape[-1]
    whole = _pooler(pooled_exports[EMBED], EMBED).pool(inputs)
    buckets = [
        {"batch_size": 1, "seq_len": s, "vision_batch_size": 1, "vision_size": v}
        for s, v in ((length // 2, 8), (length + 37, 64), (length + 100, 128))
    ]
    pooler = _pooler(pooled_exports[EMBED], EMBED, buckets)
    feeds = pooler.feeds(inputs)
    assert feeds["input_ids"].shape == (1, length + 37)  # the smallest bucket that holds the prompt
    assert (feeds["position_ids"][:, :, length:] == -1).all()
    assert feeds["vision_embeds"].shape[1] == 64
    padded = pooler.pool(inputs)
    assert float(np.dot(padded, whole)) >= 0.9999
    short = _pooler(pooled_exports[EMBED], EMBED, buckets[:1])
    with pytest.raises(UserError, match="runs a prompt in one call"):
        short.pool(inputs)


def test_matryoshka_prefix_is_renormalized():
    rng = np.random.default_rng(0)
    full = rng.standard_normal(64).astype(np.float32)
    full /= np.linalg.norm(full)
    cut = matryoshka(full, 16)
    assert cut.shape == (16,) and abs(np.linalg.norm(cut) - 1) < 1e-6
    assert np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    assert matryoshka(full, None) is full
    for bad in (0, 65):
        with pytest.raises(UserError, match="--dimensions must be in 1..64"):
            matryoshka(full, bad)


@pytest.mark.parametrize("task", [EMBED, SCORE])
def test_pooled_table_has_no_state_and_one_output(task):
    family = get_family(FAMILY)
    io = pooled_io(family.language_io(4), task)
    assert not io.layers and not io.retained_outputs()
    assert [row.role for row in io.outputs] == [Role.EMBEDDING if task == EMBED else Role.SCORE]
    assert {row.role for row in io.inputs} == {
        Role.TOKEN_IDS,
        Role.POSITIONS,
        Role.VISION_ROWS,
        Role.VISION_CURSOR,
    }


@pytest.mark.parametrize("family", [f.name for f in all_families()])
def test_every_family_declares_generate_and_only_known_tasks(family):
    tasks = get_family(family).tasks
    assert "generate" in tasks and set(tasks) <= {"generate", EMBED, SCORE}


def _spec(tmp_path, task, config="Qwen3-VL-Embedding-8B", **extra):
    lines = [
        "model: Qwen/Qwen3-VL-Embedding-8B",
        f"config: {ROOT / 'specs/configs' / config / 'config.json'}",
        f"task: {task}",
        "ctx_len: 2048",
        "prefill: {seq_lens: [256, 2048]}",
        "vision: {images: [{height: 224, width: 224}]}",
        *(f"{key}: {value}" for key, value in extra.items()),
    ]
    path = tmp_path / "spec.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("task", "config", "extra", "message"),
    [
        ("pool", "Qwen3-VL-Embedding-8B", {}, "task: must be one of generate, embed, score (got 'pool')"),
        ("embed", "Qwen3-VL-30B-A3B-Instruct", {}, "task: Qwen3-VL-MoE does not declare task 'embed'"),
        ("score", "Qwen2.5-VL-3B-Instruct", {}, "task: Qwen2.5-VL does not declare task 'score'"),
        (
            "embed",
            "Qwen3-VL-Embedding-8B",
            {"full_batch_size": 4},
            "full_batch_size: task embed has no KV cache",
        ),
    ],
)
def test_bad_or_undeclared_task_is_one_line_exit_2(tmp_path, capsys, task, config, extra, message):
    code = main(["validate", str(_spec(tmp_path, task, config, **extra))])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "note:" not in line]
    assert code == 2
    assert len(lines) == 1 and message in lines[0], err


def test_pooling_specs_have_no_decode(tmp_path):
    import re

    from qeff_vision.spec import build_specializations, load_spec
    from qeff_vision.spec.table import specialization_table

    for task in (EMBED, SCORE):
        generated = build_specializations(load_spec(_spec(tmp_path, task)))
        names = [s.name for s in generated.language.specializations]
        assert names == ["Prefill-256", "Prefill-2048"]
        assert all("ctx_len" not in s.symbols for s in generated.language.specializations)
        assert not generated.language.custom_io  # nothing retained
        table = specialization_table(generated)
        assert "fits@256  fits@2048" in table and "chunks@" not in table
        assert re.search(r"224x224\s+64\s+Vision-224x224\s+yes\s+yes", table), table


# ---- compile + run --embed / --score on the onnxruntime backend ----

TINY_BUCKETS = {EMBED: (128, 512), SCORE: (128, 512)}


@pytest.fixture(scope="module")
def compiled(pooled_exports, checkpoints, tmp_path_factory):
    import yaml

    from qeff_vision import api

    built = {}
    for task in (EMBED, SCORE):
        root = tmp_path_factory.mktemp(f"compiled-{task}")
        spec = {
            "name": f"tiny-{task}",
            "model": str(checkpoints[task]),
            "task": task,
            "ctx_len": max(TINY_BUCKETS[task]),
            "prefill": {"seq_lens": list(TINY_BUCKETS[task])},
            "vision": {"images": [{"height": 112, "width": 112}], "max_images": 2},
        }
        (root / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        api.compile(
            root / "spec.yaml",
            root / "out",
            backend="onnxruntime",
            export_dir=pooled_exports[task],
            progress=None,
            status_stream=None,
        )
        built[task] = root / "out"
    return built


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("pool-files")
    helpers.image(112, 112, 0).save(root / "a.png")
    helpers.image(96, 128, 3).save(root / "b.png")
    lines = [
        {"prompt": "a dog running", "images": ["a.png"]},
        {"prompt": "tax law"},
        {"prompt": "", "images": ["b.png"]},
    ]
    lines[2]["prompt"] = "picture"
    (root / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def run_cli(capsys, *args):
    code = main(["run", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _lines(out: str) -> list[dict]:
    import json

    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("precision", ["fp32", "device"])
def test_run_embed_matches_transformers(compiled, files, capsys, precision):
    code, out, err = run_cli(
        capsys,
        compiled[EMBED],
        "--embed",
        "--requests",
        files / "docs.jsonl",
        "--compare-hf",
        "--precision",
        precision,
    )
    assert code == 0, err
    results = _lines(out)
    assert [r["index"] for r in results] == [0, 1, 2]
    for result in results:
        assert abs(np.linalg.norm(result["embedding"]) - 1) < 1e-3
    verdicts = [line for line in err.splitlines() if "compare-hf: cosine" in line]
    bound = "device" if precision == "device" else "fp32"
    assert len(verdicts) == 3 and all(f"within the {bound} tolerance" in line for line in verdicts), err


@pytest.mark.parametrize("precision", ["fp32", "device"])
def test_run_score_matches_transformers(compiled, files, capsys, precision):
    code, out, err = run_cli(
        capsys,
        compiled[SCORE],
        "--score",
        "a dog",
        "--query-image",
        files / "a.png",
        "--requests",
        files / "docs.jsonl",
        "--compare-hf",
        "--precision",
        precision,
    )
    assert code == 0, err
    scores = [r["score"] for r in _lines(out)]
    assert len(scores) == 3 and all(0 < s < 1 for s in scores)
    verdicts = [line for line in err.splitlines() if "compare-hf: |score - transformers|" in line]
    bound = "device" if precision == "device" else "fp32"
    assert len(verdicts) == 3 and all(f"within the {bound} tolerance" in line for line in verdicts), err


def test_run_embed_matryoshka_prefix(compiled, files, capsys):
    code, out, _ = run_cli(capsys, compiled[EMBED], "--embed", "--prompt", "dog", "--image", files / "a.png")
    full = np.array(_lines(out)[0]["embedding"])
    code, out, _ = run_cli(
        capsys, compiled[EMBED], "--embed", "--prompt", "dog", "--image", files / "a.png", "--dimensions", 16
    )
    cut = np.array(_lines(out)[0]["embedding"])
    assert code == 0 and cut.shape == (16,)
    assert np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)


@pytest.mark.parametrize(
    ("task", "args", "message"),
    [
        (EMBED, ["--score", "q", "--prompt", "x"], "built for task embed; run them with --embed"),
        (SCORE, ["--embed", "--prompt", "x"], "built for task score; run them with --score QUERY"),
        (EMBED, ["--embed", "--prompt", "word " * 400], "a pooling program runs a prompt in one call"),
        (EMBED, ["--embed", "--prompt", "x", "--dimensions", 100000], "--dimensions must be in 1..64"),
        (EMBED, ["--embed", "--prompt", "x", "--prompt", "y"], "give one --prompt TEXT"),
        (SCORE, ["--score", "q", "--prompt", "x", "--dimensions", 4], "applies to --embed only"),
    ],
)
def test_run_pooling_bad_input_is_one_line_exit_2(compiled, capsys, task, args, message):
    code, out, err = run_cli(capsys, compiled[task], *args)
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_generation_artifacts_refuse_embed(tmp_path_factory, tiny_checkpoint, exported, capsys):
    from tests.test_runtime_artifacts import compile_tiny

    out = compile_tiny(tmp_path_factory, tiny_checkpoint, exported)
    code, _, err = run_cli(capsys, out, "--embed", "--prompt", "x")
    assert code == 2 and "built for task generate; run them with --prompt (generation)" in err


def test_export_refuses_an_undeclared_task_and_a_reranker_without_yes_no(
    tiny_checkpoint, checkpoints, tmp_path
):
    from qeff_vision.exporter import export_model

    with pytest.raises(UserError, match="Qwen2.5-VL does not declare task 'embed'"):
        export_model(tiny_checkpoint("qwen2_5_vl"), tmp_path / "a", task=EMBED, progress=None)
    with pytest.raises(UserError, match="the tokenizer has no single token 'yes'"):
        export_model(checkpoints[EMBED], tmp_path / "b", task=SCORE, progress=None)
    with pytest.raises(UserError, match="task embed has no KV cache"):
        export_model(checkpoints[EMBED], tmp_path / "c", task=EMBED, continuous_batching=True, progress=None)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_families_table_lists_each_family_s_tasks():
    from qeff_vision import api

    table = api.families_table()
    for family in all_families():
        block = table.split(f"{family.name} [{family.title}]")[1]
        line = next(line for line in block.splitlines() if line.split()[:1] == ["tasks"])
        assert line.split(None, 1)[1] == ", ".join(family.tasks)
    assert get_family(FAMILY).tasks == ("generate", EMBED, SCORE)


@pytest.mark.parametrize("tasks", [(EMBED,), ("generate", "classify")])
def test_registration_refuses_tasks_without_generate_or_unknown(tasks):
    from qeff_vision.families import register
    from qeff_vision.families.qwen3_vl import Qwen3_VL

    family = get_family(FAMILY)
    odd = type("OddTasks", (Qwen3_VL,), {"name": "odd_tasks_family", "tasks": tasks})
    with pytest.raises(TypeError, match="tasks must include generate and name only generate, embed, score"):
        register(odd, host=lambda: family.parts.host, adapter=family.parts.adapter, tiny=family.parts.tiny)
    assert "odd_tasks_family" not in {f.name for f in all_families()}


@pytest.mark.parametrize("task", [EMBED, SCORE])
def test_stand_in_compile_and_device_runtime_run_the_pooling_program(
    task, pooled_exports, checkpoints, files, tmp_path, monkeypatch
):
    """Backend qaic: the stand-in compiler takes the argv (no -retained-state: nothing is retained);
    the SDK-runtime double runs the QPCs, within the device bounds of transformers."""
    import importlib
    import json
    import sys

    import yaml

    from qeff_vision import api
    from qeff_vision.runtime.pooling_run import PoolInput, pool_inputs
    from tests.compile_fixtures import calls, stand_in

    compiler, record = stand_in(tmp_path)
    spec = {
        "name": f"qaic-{task}",
        "model": str(checkpoints[task]),
        "task": task,
        "ctx_len": 512,
        "prefill": {"seq_lens": [128, 512]},
        "vision": {"images": [{"height": 112, "width": 112}], "max_images": 2},
        "compile": {"node_precision": "none"},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(
        tmp_path / "spec.yaml",
        tmp_path / "out",
        compiler=str(compiler),
        export_dir=pooled_exports[task],
        progress=None,
        status_stream=None,
    )
    argvs = {Path(call["argv"][1].removeprefix("-m=")).parent.name: call["argv"] for call in calls(record)}
    assert "-retained-state" not in argvs["lang"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["backend"] == "qaic" and manifest["vllm"]["served"] is False
    double = Path(__file__).with_name("device_double")
    monkeypatch.syspath_prepend(str(double))
    for name in ("qaicrt", "QAicApi_pb2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("qaicrt")
    query = PoolInput("a dog", (files / "a.png",)) if task == SCORE else None
    items = [PoolInput("a dog running", (files / "a.png",)), PoolInput("tax law")]
    results = pool_inputs(tmp_path / "out", items, task, query=query, compare_hf=True)
    for result in results:
        figure, ok = result.agreement(task)
        assert result.device and ok, figure
    for name in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(name, None)
