"""Our compiled artifacts served by the real vLLM 0.23.0 + vllm-qaic over the stand-in runtime (issue 29).

Per family: tiny checkpoint, ``compile --backend onnxruntime``, the printed plugin form's engine
arguments (two instances: pooling on the vision program, generate with ``enable_mm_embeds`` on
the language program), requests served in the vLLM venv (``serve.py``), greedy tokens compared with
transformers' own ``generate`` on the same processor outputs. The stand-in runtime
(tests/device_double) computes with onnxruntime and rejects any buffer shape no specialization
allows, so a token match also proves every call the plugin made fit the compiled contract.

Run with ``make test-vllm`` (see docs/guide/serving-vllm.md); it sets QEFF_VLLM_TIER, VLLM_VENV and
VLLM_QAIC_SRC.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from qeff_vision.compile.vllm_handoff import serve_sections
from qeff_vision.spec import find_specs, load_spec
from tests import serve_form_rules as rules
from tests.test_spec_helpers import SPECS
from tests.vllm_tier import prepare

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
PLUGIN = os.environ.get("VLLM_QAIC_SRC", "")
SERVED = (
    "llava",
    "qwen2_5_vl",
    "internvl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_next",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma4",
)
# Families the plugin does not serve from our artifacts, and why (docs/guide/serving-vllm.md lists them too).
NOT_SERVED = {
    "gemma3": "the plugin's Gemma 3 processor calls Gemma3ProcessingInfo._resolve_image_kwargs, "
    "which vLLM 0.23.0 does not have (AttributeError before any request reaches the device)",
    "mistral3": "vLLM 0.23's Mistral 3 prompt update accepts only pixel images, not the image "
    "embeddings the generate instance (enable_mm_embeds) receives",
    "llama4": "vLLM 0.23's Llama 4 prompt update reads each image's processor output "
    "(aspect_ratios), which the image embeddings the generate instance (enable_mm_embeds) "
    "receives do not carry (KeyError before any request reaches the device)",
    "mllama": "vLLM removed MllamaForConditionalGeneration in 0.10.2 (encoder-decoder models went "
    "with the V0 engine); 0.23 falls back to its Transformers backend, which asks MllamaProcessor "
    "for _get_num_multimodal_tokens (AttributeError while the engine starts); the plugin marks "
    "mllama unsupported too",
}
NOT_SERVED_SIGN = {
    "gemma3": "_resolve_image_kwargs",
    "mistral3": "ImageEmbeddingItems",
    "llama4": "Modality 'image' not found",
    "mllama": "'MllamaProcessor' object has no attribute '_get_num_multimodal_tokens'",
}
# Two images of different sizes in one prompt (both compiled; each encoded alone by the pooling
# instance, both embeddings sent to the generate instance), like the plugin's
# examples/qaic_vision_language_multi_image.py. LLaVA-NeXT's and InternVL's two sizes share a tile
# count, and Gemma 4's every size binds its patch budget, so one vision specialization serves both:
# the plugin assumes one for every non-Qwen vision program (parse_and_validate_multimodal_raw_input).
TWO_IMAGES = ("internvl", "llava", "llava_next", "gemma4")
QWEN_ONE_SIZE = (
    "the plugin's Qwen image-embedding parser (qaic_custom_mm_processor._parse_image_data) takes a "
    "prompt's images to share one size: rows per image = all rows // images (20 here, between the "
    "compiled 16 and 24), which matches no compiled resolution",
    "does not match any of the resolutions compiled into the QPC",
)
TWO_IMAGES_NOT = dict.fromkeys(
    ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), QWEN_ONE_SIZE
)
# The plugin's single-QPC mode (kv_offload False; its guide lists LLaVA-1.5, Llama 3.2 Vision and
# Llama 4 as loading one program) on our deployment-single artifact, and why it does not serve it.
SINGLE_PROGRAM_NOT = {
    "llava": (
        "the plugin sends no pixel_values on calls without an image (its warm-up decode, text-only "
        "prefill, every decode step), as QEfficient's single QPC binds one fixed pixel buffer in "
        "every specialization; our single program selects its keep specializations by a "
        "[1, 3, 1, 1] placeholder the host sends, so the device refuses the call",
        "pixel_values: not retained state, must be sent",
    ),
}
# The plugin asks every program for a logits binding, the vision encoder too (which has none,
# as QEfficient's vision QPCs have none): the one binding warning that is not ours to fix.
VISION_LOGITS_PROBE = "Unable to find binding: logits"
BINDING_WARNINGS = ("binding", "not found", "missing from session input names", "Partial buffer")

# The tier is collected only when asked for (conftest.py); then a missing venv or plugin is a
# failure, not a skip: CI runs it on every change, and a skipped tier would pass unseen.
if not (VENV / "bin" / "python").exists() or not Path(PLUGIN, "vllm_qaic").is_dir():
    pytest.fail(
        "needs VLLM_VENV with vLLM 0.23.0 and VLLM_QAIC_SRC (a vllm-qaic checkout): make test-vllm",
        pytrace=False,
    )


def _vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "device_double"), str(HERE / "stand_ins")])
    env["VLLM_QAIC_SRC"] = PLUGIN
    return env


def _serve(job_file: Path) -> dict:
    result_file = job_file.with_name(job_file.name.replace("job-", "result-"))
    run = subprocess.run(
        [str(VENV / "bin" / "python"), str(HERE / "serve.py"), str(job_file), str(result_file)],
        env=_vllm_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    job_file.with_suffix(".log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        rejected = [line for line in run.stderr.splitlines() if "[qaicrt stand-in]" in line]
        log = job_file.with_suffix(".log")
        raise AssertionError(
            f"serve.py failed; log in {log}:\n" + "\n".join(rejected[:3]) + run.stderr[-3000:]
        )
    return json.loads(result_file.read_text())


@pytest.fixture(scope="module")
def served(built):
    """``served(family) -> {label: (job, result)}``: each family compiled once per session, served once."""
    done: dict[str, dict] = {}

    def run(family: str) -> dict:
        if family not in done:
            root, jobs = built(family)
            done[family] = {label: (job, _serve(root / f"job-{label}.json")) for label, job in jobs.items()}
        return done[family]

    return run


def _check_tokens(job: dict, result: dict) -> None:
    for requests, outputs in zip(job["batches"], result["batches"], strict=True):
        for request, output in zip(requests, outputs, strict=True):
            assert output["prompt_token_ids"] == request["input_ids"], (
                "vLLM's prompt differs from the processor's"
            )
            assert output["token_ids"] == request["reference"], "greedy tokens differ from transformers"
    assert result["device_errors"] == []
    binding = [w for w in result["warnings"] if any(key in w for key in BINDING_WARNINGS)]
    assert [w for w in binding if not w.endswith(VISION_LOGITS_PROBE)] == [], binding
    assert len(binding) <= 1, binding  # the vision instance's probe, once


@pytest.mark.parametrize("family", SERVED)
def test_image_over_several_chunks_and_text_only_match_transformers(served, family):
    job, result = served(family)["single"]
    _check_tokens(job, result)
    image_calls, text_calls = result["device_calls"]
    seq_len = job["engine_args"]["language"]["long_prefill_token_threshold"]
    # The image's rows rode in at least two prefill chunks, each padded to the compiled vision_size.
    with_rows = [c for c in image_calls if c.get("input_ids", [0, 0])[1] == seq_len and "vision_embeds" in c]
    assert len(with_rows) >= 2, image_calls
    assert all(c["vision_embeds"][1] == seq_len for c in with_rows)
    assert not [c for c in text_calls if "vision_embeds" in c or "pixel_values" in c]


@pytest.mark.parametrize("family", SERVED)
def test_three_concurrent_requests_on_a_continuous_batching_artifact(served, family):
    job, result = served(family)["cb"]
    _check_tokens(job, result)
    (calls,) = result["device_calls"]
    decode = [c for c in calls if c.get("input_ids", [0, 0])[1] == 1]
    assert decode and all(c["input_ids"] == [3, 1] and c["batch_index"] == [3, 1] for c in decode)
    assert all(c["batch_index"] == [1, 1] for c in calls if c.get("input_ids", [0, 1])[1] > 1)


def _serve_built(build, family: str, root: Path, label: str) -> tuple[dict, dict]:
    job = build(prepare.CASES[family], root)
    return job, _serve(root / f"job-{label}.json")


@pytest.mark.parametrize("family", TWO_IMAGES)
def test_two_images_of_different_sizes_in_one_prompt_match_transformers(tmp_path, family):
    job, result = _serve_built(prepare.build_two_images, family, tmp_path, "two")
    _check_tokens(job, result)
    case = prepare.CASES[family]
    assert case.image != case.second
    (calls,) = result["device_calls"]
    assert sum("vision_embeds" in c for c in calls) >= 2  # both images' rows reached the language program


@pytest.mark.parametrize("family", sorted(TWO_IMAGES_NOT))
def test_two_images_the_plugin_does_not_serve(tmp_path, family):
    with pytest.raises(AssertionError, match="serve.py failed") as failure:
        _serve_built(prepare.build_two_images, family, tmp_path, "two")
    assert TWO_IMAGES_NOT[family][1] in str(failure.value), str(failure.value)[-2000:]


@pytest.mark.parametrize("family", sorted(SINGLE_PROGRAM_NOT))
def test_the_single_program_path_and_why_the_plugin_does_not_serve_it(tmp_path, family):
    """``deployment: single`` served with the plugin's kv_offload False: the documented reason."""
    with pytest.raises(AssertionError, match="serve.py failed") as failure:
        _serve_built(prepare.build_single_program, family, tmp_path, "one")
    assert SINGLE_PROGRAM_NOT[family][1] in str(failure.value), str(failure.value)[-2000:]


@pytest.mark.parametrize("family", sorted(NOT_SERVED))
def test_families_the_plugin_does_not_serve(served, family):
    """They fail for the documented reason (this turns red when the plugin or we change)."""
    with pytest.raises(AssertionError, match="serve.py failed") as failure:
        served(family)
    assert NOT_SERVED_SIGN[family] in str(failure.value), str(failure.value)[-2000:]


def test_printed_forms_of_every_golden_spec_parse_with_vllm(tmp_path):
    entries = []
    for path in find_specs(SPECS):
        spec = load_spec(path)
        if spec.deployment.mode != "dual":
            continue  # vLLM forms are generated for the dual deployment only
        forms = serve_sections((SPECS / "golden" / spec.name / "vllm_serve.txt").read_text())
        # A pooling spec (task embed/score) prints one pooling instance instead of the two.
        role = "pooling" if "pooling_serve" in forms else "plugin"
        serve = [words for _, words in rules.plugin_serve_lines(forms[f"{role}_serve"])]
        offline = list(_offline_kwargs(forms[f"{role}_offline"]))
        entries.append({"spec": spec.name, "serve": serve, "offline": offline})
    (tmp_path / "forms.json").write_text(json.dumps(entries))
    run = subprocess.run(
        [str(VENV / "bin" / "python"), str(HERE / "parse_forms.py"), str(tmp_path / "forms.json")],
        env=_vllm_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _offline_kwargs(script: str):
    import ast

    body = rules.heredoc_body(script)
    for node in ast.walk(ast.parse(body)):
        call = getattr(node, "value", None)
        if (
            isinstance(node, ast.Assign)
            and isinstance(call, ast.Call)
            and getattr(call.func, "id", "") == "LLM"
        ):
            yield ast.literal_eval(call.keywords[0].value)


# An artifact with the on-device sampler (compile.language.sampler) served with the plugin's
# aic_include_sampler: what stops it (docs/guide/serving-vllm.md names it too).
SAMPLER_NOT = (
    "the plugin parses aic_include_sampler (and max_top_k_ids) into its compile config but never "
    "feeds the sampler's inputs (last_accepted_output_tokens, the sampling parameters, "
    "random_numbers): its warm-up's first prefill call lacks them, and it samples on the host from "
    "a logits output the program no longer has",
    "last_accepted_output_tokens: not retained state, must be sent",
)
# Sampler inputs that no module of the plugin names (it feeds none of them).
SAMPLER_INPUTS_UNFED = ("last_accepted_output_tokens", "random_numbers", "top_ks", "min_ps")


def test_the_on_device_sampler_artifact_and_what_stops_the_plugin(tmp_path):
    """``compile.language.sampler`` served with ``aic_include_sampler``: the documented reason."""
    with pytest.raises(AssertionError, match="serve.py failed") as failure:
        _serve_built(prepare.build_sampler, "llava", tmp_path, "sampler")
    assert SAMPLER_NOT[1] in str(failure.value), str(failure.value)[-3000:]
    source = "\n".join(path.read_text() for path in Path(PLUGIN, "vllm_qaic").rglob("*.py"))
    assert "aic_include_sampler" in source
    assert [name for name in SAMPLER_INPUTS_UNFED if name in source] == []


# Pooling programs (spec task embed/score): the plugin's pooling runner on a multimodal model is its
# vision-encoder instance; the lines of the plugin that make it so (the reason the printed forms
# give, qeff_vision/compile/vllm_pooling.py POOLING_NOT_SERVED).
POOLING_NOT = {
    "vllm_qaic/model_loader/qaic_multimodal.py": (
        "        if self.is_pooling_model:\n"
        '            self.is_vision_encoder = "skip_vision" not in override_qaic_config\n',
        "            self._pooler = VisionEncoderPooler()\n",
        '    def get_supported_tasks(self) -> Set[PoolingTask]:\n        return {"embed"}\n',
    ),
    "vllm_qaic/model_loader/qaic.py": (
        "        if self.is_pooling_model and not self.is_multimodal_model:\n"
        "            output = self._run_encode(prefill_cum_sum, input_ids, positions)\n",
        '                skip_lang = vllm_config.model_config.runner_type == "pooling"\n',
    ),
}


def test_the_plugin_serves_no_pooling_language_program():
    """The printed pooling forms say NOT SERVED because of these plugin lines (red when they change)."""
    from qeff_vision.compile.vllm_pooling import POOLING_NOT_SERVED

    assert "VisionEncoderPooler" in POOLING_NOT_SERVED and "_run_encode" in POOLING_NOT_SERVED
    for relative, lines in POOLING_NOT.items():
        source = (Path(PLUGIN) / relative).read_text()
        for line in lines:
            assert line in source, (relative, line)


def test_the_plugin_maps_no_bfloat16_io_for_ai200_programs():
    """The printed ai200 forms say NOT SERVED because the plugin's numpy session maps no bfloat16
    IO type (red when the pinned plugin gains one: then the forms should be served)."""
    import re

    from qeff_vision.compile.vllm_handoff import BF16_NOT_BOUND

    assert "numpy session maps no bfloat16 IO type" in BF16_NOT_BOUND
    source = (Path(PLUGIN) / "vllm_qaic/model_loader/qaic_session_np.py").read_text()
    mapping = re.search(r"aic_to_np_dtype_mapping = \{(.*?)\}", source, re.S)
    assert mapping is not None, "the plugin's IO dtype table moved"
    assert "FLOAT_16_TYPE" in mapping.group(1) and "FLOAT_TYPE" in mapping.group(1)
    assert "bf16" not in mapping.group(1).lower() and "bfloat" not in mapping.group(1).lower()
