"""The vLLM hand-off: golden forms per spec, checked against each launcher's argument rules (issue 29).

``specs/golden/<spec>/vllm_serve.txt`` is what ``compile --print-serve`` prints for the spec (QPC
content keys written ``<hash>``); ``specialize --check`` regenerates it with the other golden files,
and tests/test_compile_driver.py checks that a real compile prints exactly that text. The opt-in
vLLM tier (tests/vllm_tier) parses the plugin forms with vLLM's own parser.
"""

from __future__ import annotations

import ast
import json

import yaml

from qeff_vision import api
from qeff_vision.compile.serve_fit import serving_warnings
from qeff_vision.compile.vllm_handoff import (
    BF16_NOT_BOUND,
    GOLDEN_FILE,
    QPC_PLACEHOLDER,
    SAMPLER_NOT_SERVED,
    golden_serve_text,
    plugin_prefill,
)
from qeff_vision.families import all_families
from qeff_vision.spec import build_specializations, find_specs, load_spec
from tests import serve_form_rules as rules
from tests.test_spec_helpers import SPECS

VISION_QPC, LANGUAGE_QPC = f"vision/{QPC_PLACEHOLDER}", f"lang/{QPC_PLACEHOLDER}"


def _script_llms(script: str) -> dict[str, dict]:
    """``name = LLM(**{...})`` assignments of a printed Python form (the here-document body)."""
    body = rules.heredoc_body(script)
    calls = {}
    for node in ast.walk(ast.parse(body)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") == "LLM"
        ):
            calls[node.targets[0].id] = ast.literal_eval(node.value.keywords[0].value)
    return calls


def test_every_golden_spec_prints_forms_its_launchers_accept():
    # The dual deployment's forms (a disaggregated spec's golden holds its compile commands).
    specs = [load_spec(path) for path in find_specs(SPECS)]
    specs = [spec for spec in specs if spec.deployment.mode == "dual"]
    assert {spec.family for spec in specs} == {family.name for family in all_families()}
    for spec in specs:
        if spec.task != "generate":  # one pooling instance (test_pooling_specs_print_...)
            continue
        golden = (SPECS / "golden" / spec.name / GOLDEN_FILE).read_text()
        assert golden == golden_serve_text(spec), f"{spec.name}: run specialize --update-golden"
        forms = rules.sections(golden)
        assert list(forms) == ["plugin_offline", "plugin_serve", "fork_offline", "epd"]
        language = [s.symbols for s in build_specializations(spec).language.specializations]
        seq_len, _ = plugin_prefill(language)
        decode_batch = spec.full_batch_size or spec.batch_size
        stills = [image for image in spec.vision.images if not image.video]

        # A sampler program: the plugin's forms say first that the plugin cannot serve it, as
        # validate warns (tests/vllm_tier asserts the refusal); the fork's forms are unchanged.
        sampler = spec.compile.language.sampler is not None
        ai200 = spec.compile.hardware == "ai200"
        for role, command in forms.items():
            noted = command.startswith(SAMPLER_NOT_SERVED + "\n")
            assert noted == (sampler and role.startswith("plugin_")), (spec.name, role)
            # ai200: every engine runs bf16 (its cache follows), the plugin's forms say it binds no bf16 IO.
            assert (BF16_NOT_BOUND in command) == (ai200 and role.startswith("plugin_")), (spec.name, role)
            assert ("bfloat16" in command) == ai200 and "kv_cache_dtype='bfloat16'" not in command
        warned = any("cannot serve" in w for w in serving_warnings(build_specializations(spec)))
        assert warned == sampler, spec.name

        # vLLM 0.23 + plugin: one QPC path, vision (pooling) first; the same engine args offline.
        rules.check_plugin_serve(forms["plugin_serve"], spec.prefill.seq_lens)
        offline = _script_llms(forms["plugin_offline"])
        assert f"'VLLM_QAIC_QPC_PATH'] = '{VISION_QPC}:{LANGUAGE_QPC}'" in forms["plugin_offline"]
        assert offline["vision"]["runner"] == "pooling" and offline["language"]["enable_mm_embeds"] is True
        for args in offline.values():
            assert args["long_prefill_token_threshold"] == seq_len and args["max_model_len"] == spec.ctx_len
            assert args["limit_mm_per_prompt"] == {"image": spec.vision.max_images}
            sizes = args["additional_config"]["override_qaic_config"]
            assert list(zip(sizes.get("height", []), sizes.get("width", []))) == [
                (i.height, i.width) for i in stills
            ]
        assert offline["language"]["max_num_seqs"] == decode_batch

        # 0.8.5 E-PD launcher: its argument rules, height/width of the first still on both sides.
        overrides = rules.check_epd(forms["epd"])
        size = {} if not stills else {"height": str(stills[0].height), "width": str(stills[0].width)}
        assert overrides["encode"] == {**size, "kv_offload": "True", "qpc_path": VISION_QPC}
        assert overrides["decode"] == {**size, "kv_offload": "True", "qpc_path": LANGUAGE_QPC}
        _, values, _ = rules.launcher_args(forms["epd"])
        assert values["--decode-max-num-seqs"] == str(decode_batch)
        assert values["--decode-max-seq-len-to-capture"] == str(max(spec.prefill.seq_lens))
        fork = _script_llms(forms["fork_offline"])
        if ai200:
            assert fork["encoder"]["dtype"] == fork["decoder"]["dtype"] == "bfloat16"
            assert offline["vision"]["dtype"] == offline["language"]["dtype"] == "bfloat16"
            assert values["--dtype"] == "bfloat16" and "--kv-cache-dtype" not in values
        assert fork["encoder"]["override_qaic_config"]["qpc_path"] == VISION_QPC
        assert fork["decoder"]["override_qaic_config"]["qpc_path"] == LANGUAGE_QPC


def test_the_plugin_prefill_length_shares_the_first_specializations_vision_size():
    """The plugin pads vision_embeds to the first specialization: only buckets of that size serve."""
    language = [
        {"seq_len": "128", "vision_size": "128"},
        {"seq_len": "512", "vision_size": "512"},
        {"seq_len": "256", "vision_size": "128"},
        {"seq_len": "1", "vision_size": "512"},
    ]
    assert plugin_prefill(language) == (256, 128)
    assert plugin_prefill([{"seq_len": "64"}, {"seq_len": "1"}]) == (64, None)


def _spec(tmp_path, tiny_checkpoint, family, seq_lens, vision_size, image=(336, 336)):
    path = tmp_path / f"{family}-{vision_size}.yaml"
    spec = {
        "name": "fit",
        "model": str(tiny_checkpoint(family)),
        "ctx_len": 512,
        "prefill": {"seq_lens": seq_lens},
        "vision": {"images": [{"height": image[0], "width": image[1]}], "vision_size": vision_size},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def test_validate_warns_when_a_spec_does_not_fit_its_server(tmp_path, tiny_checkpoint):
    # LLaVA's tiny image is 16 rows. chunk targets the plugin: first bucket 8 holds 8 rows = fits.
    problems, warnings = api.validate(_spec(tmp_path, tiny_checkpoint, "llava", [8, 32], "chunk"))
    assert problems == [] and not [w for w in warnings if "vllm-qaic" in w]
    # A fixed vision_size targets the 0.8.5 fork, which sends the image's 16 rows at once.
    problems, warnings = api.validate(_spec(tmp_path, tiny_checkpoint, "llava", [8, 32], 4))
    assert problems == [] and any("0.8.5" in w and "16 rows" in w for w in warnings), warnings
    problems, warnings = api.validate(_spec(tmp_path, tiny_checkpoint, "llava", [8, 32], "max"))
    assert problems == [] and not [w for w in warnings if "0.8.5" in w]
    # Gemma 3 keeps images whole: its text bucket first gives the plugin 1 row per chunk.
    problems, warnings = api.validate(
        _spec(tmp_path, tiny_checkpoint, "gemma3", [8, 64], "chunk", (896, 896))
    )
    assert problems == []
    assert any("vision_size 1 (bucket 8)" in w for w in warnings), warnings
    assert any("keeps an image's tokens in one chunk" in w for w in warnings), warnings


def test_pooling_specs_print_one_pooling_instance_marked_not_served():
    """Task embed/score: runner pooling (convert embed, or the reranker's overrides), NOT SERVED first."""
    from qeff_vision.compile.vllm_pooling import POOLING_NOT_SERVED
    from qeff_vision.families import get_family

    reranker_overrides = get_family("qwen3_vl").vllm_score_overrides

    specs = [load_spec(path) for path in find_specs(SPECS)]
    pooling = [spec for spec in specs if spec.task != "generate"]
    assert {spec.task for spec in pooling} == {"embed", "score"}
    for spec in pooling:
        golden = (SPECS / "golden" / spec.name / GOLDEN_FILE).read_text()
        assert golden == golden_serve_text(spec), f"{spec.name}: run specialize --update-golden"
        forms = rules.sections(golden)
        assert list(forms) == ["pooling_offline", "pooling_serve"]
        assert all(command.startswith(POOLING_NOT_SERVED + "\n") for command in forms.values())
        ((path, words),) = rules.plugin_serve_lines(forms["pooling_serve"])
        assert path == f"{VISION_QPC}:{LANGUAGE_QPC}" and words[:3] == ["vllm", "serve", "model"]
        assert words[words.index("--runner") + 1] == "pooling"
        assert int(words[words.index("--max-model-len") + 1]) == spec.ctx_len
        (offline,) = _script_llms(forms["pooling_offline"]).values()
        assert offline["runner"] == "pooling" and offline["max_model_len"] == spec.ctx_len
        if spec.task == "embed":
            assert offline["convert"] == "embed" and "llm.embed(" in forms["pooling_offline"]
        else:
            assert offline["hf_overrides"] == reranker_overrides and "llm.score(" in forms["pooling_offline"]
            assert json.loads(words[words.index("--hf-overrides") + 1]) == reranker_overrides
