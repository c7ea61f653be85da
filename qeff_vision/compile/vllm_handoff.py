"""How vLLM on Cloud AI 100 serves the two compiled programs: the manifest block and the commands.

Two servers, each form saying which one it is for:

* **vLLM 0.23.0 + the vllm-qaic plugin** (github.com/qualcomm/vllm-qaic; read from its
  ``model_loader/qaic.py``, ``qaic_multimodal.py``, ``qaic_session_np.py``, ``platform_base.py``
  and ``examples/qaic_vision_language.py``). One program per vLLM instance:
  ``VLLM_QAIC_QPC_PATH=<vision>:<language>`` gives index 0 to a pooling instance (``runner
  pooling``, it encodes images) and index 1 to a generate instance (``enable_mm_embeds``, it takes
  the embeddings). The plugin prefills in chunks of ``long_prefill_token_threshold`` tokens and pads
  each chunk's image rows to the ``vision_embeds`` binding of the program's first specialization,
  so that length is a compiled bucket whose ``vision_size`` is the first specialization's
  (:func:`plugin_prefill`). ``height``/``width`` in ``override_qaic_config`` are the compiled
  resolutions (the plugin's Qwen processor resizes every image to one of them). Printed as an
  offline Python script and as two ``vllm serve`` endpoints.
* **the Cloud AI guide's vLLM 0.8.5 container** ("Multimodality Support with vLLM",
  https://quic.github.io/cloud-ai-sdk-pages/latest/Getting-Started/Model-Serving/vLLM-Serving/Multimodality.html).
  Its fork sends a whole image's rows once and walks them with ``image_idx``. Printed as two
  ``LLM``s (encode, decode) and as the E-PD launcher ``qaic-disagg`` in a ``docker run`` that
  mounts OUT. The launcher parses an override config as space-separated ``key=value`` pairs
  (a list would split), passes ``height``/``width`` to both sides (it resizes every image to that
  one resolution), unsets ``VLLM_QAIC_QPC_PATH`` (``qpc_path`` goes in each override), starts one
  encode instance per ``--encode-port`` (none by default) and one decode instance on 8003, takes
  prefix caching for the text stage and needs ``HF_HOME`` / ``QEFF_HOME``.

Every path is relative to OUT (the commands run in OUT), and the model path is OUT's copy of the
checkpoint's runtime files when compile made one, so a moved OUT serves as it is.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from qeff_vision import symbols
from qeff_vision.compile.vllm_words import PLUGIN_VLLM, QPC_PATH_ENV, _python, serve_argv  # noqa: F401 - re-exported
from qeff_vision.errors import UserError

FORK_VLLM = "vLLM 0.8.5 (the Cloud AI guide's container)"
VISION_PORT, LANGUAGE_PORT = 8001, 8002  # the plugin's two endpoints
PROXY_PORT, ENCODE_PORT, DECODE_PORT = (
    8000,
    8001,
    8003,
)  # the launcher's proxy default, encode, decode default
# The guide's disagg image (entrypoint qaic-disagg); QAIC_DISAGG_IMAGE picks another tag.
DOCKER_IMAGE = "${QAIC_DISAGG_IMAGE:-ghcr.io/quic/cloud_ai_inference_vllm_disagg:1.21.2.0}"
TITLES = {
    "plugin_offline": f"# {PLUGIN_VLLM}, offline: a pooling LLM encodes on the vision QPC, a generate LLM "
    "decodes on the language QPC (python3 in OUT)",
    # ref: docs/guide/serving-online.md: the hops as vLLM 0.23 carries them (tests/vllm_tier runs them).
    "plugin_serve": f"# {PLUGIN_VLLM}, online: the same two instances as two endpoints; the client sends "
    f"images to :{VISION_PORT} (/v1/embeddings) and the embeddings it returns to :{LANGUAGE_PORT} as "
    "image_embeds chat content; qeff_vision.serving.client.EncodeThenChat does both in one call (run in OUT)",
    "fork_offline": f"# {FORK_VLLM}, offline dual QPC: an encode LLM and a decode LLM (python3 in OUT)",
    "epd": f"# {FORK_VLLM}, E-PD disaggregated: the qaic-disagg launcher in docker, OUT mounted (run in OUT)",
}
# The first line of the plugin's forms for a language program with the on-device sampler (the
# plugin feeds none of its inputs; tests/vllm_tier asserts its warm-up is refused).
SAMPLER_NOT_SERVED = (
    f"# NOT SERVED: the language program has the on-device sampler, whose inputs {PLUGIN_VLLM} never "
    "feeds (it samples on the host from logits), so these commands fail at warm-up; use qeff-vision run"
)


# The first line of the plugin's forms for ai200 programs: the pinned plugin's numpy session has no
# bfloat16 IO type (vllm_qaic/model_loader/qaic_session_np.py, aic_to_np_dtype_mapping: float32,
# float16 and integer types), and an ai200 program takes pixel_values and vision_embeds in bf16.
BF16_NOT_BOUND = (
    f"# NOT SERVED as pinned: {PLUGIN_VLLM}'s numpy session maps no bfloat16 IO type, and these ai200 "
    "programs take pixel_values and vision_embeds in bfloat16; the forms show what the engines need "
    "(dtype bfloat16, the KV cache following it) once it does; use qeff-vision run meanwhile"
)
AI200_DTYPE = "bfloat16"


def plugin_prefill(language_specializations: Sequence[Mapping[str, Any]]) -> tuple[int, int | None]:
    """(prefill length, vision_size) the plugin serves a language program with.

    The plugin pads ``vision_embeds`` to the first specialization's binding, so only buckets with
    that ``vision_size`` accept its chunks; of those it takes the longest (fewest chunks).
    ``vision_size`` is None for a program without one (cross-attention).
    """
    prefill = [s for s in language_specializations if int(s[symbols.SEQ_LEN]) > 1]
    first = prefill[0].get(symbols.VISION_SIZE)
    seq_len = max(int(s[symbols.SEQ_LEN]) for s in prefill if s.get(symbols.VISION_SIZE) == first)
    return seq_len, None if first is None else int(first)


def _pairs(config: Mapping[str, Any]) -> str:
    """``key=value`` pairs as the launcher's override-config parser splits them (no spaces inside)."""
    return " ".join(f"{key}={value}" for key, value in config.items())


def _group(devices: Sequence[int]) -> str:
    return ",".join(map(str, devices))


def vllm_handoff(
    *,
    model: str,
    vision_qpc: str,
    language_qpc: str,
    ctx_len: int,
    batch_size: int,
    plugin_seq_len: int,
    fork_seq_len: int,
    resolutions: Sequence[tuple[int, int]],
    max_images: int,
    vision_devices: int,
    language_devices: int,
    mxfp6_matmul: bool,
    kv_cache_dtype: str,
    sampler: bool = False,
    hardware: str = "ai100",
) -> dict[str, Any]:
    """The manifest's ``vllm`` block: both servers' arguments and the four printed forms.

    Args:
        model: What vLLM loads config, tokenizer and processor from (``model`` in OUT, or an id).
        vision_qpc: The vision QPC directory, relative to OUT.
        language_qpc: The language QPC directory, relative to OUT.
        ctx_len: Context length of the language program.
        batch_size: Decode batch size.
        plugin_seq_len: The prefill length the plugin sends (:func:`plugin_prefill`).
        fork_seq_len: The prefill length of the 0.8.5 forms (the largest bucket).
        resolutions: (height, width) of every compiled still image; the launcher takes the first.
        max_images: Images one request may carry.
        vision_devices: Devices the vision QPC was compiled for.
        language_devices: Devices the language QPC was compiled for.
        mxfp6_matmul: The language program has MXFP6 weights.
        kv_cache_dtype: ``mxint8`` or the default.
        sampler: The language program has the on-device sampler: the plugin's forms open with
            :data:`SAMPLER_NOT_SERVED` (the same fact ``validate`` warns of).
        hardware: ``ai100`` or ``ai200``. ai200 programs compute in bfloat16: every form passes
            ``dtype="bfloat16"`` and no ``kv_cache_dtype`` (vLLM's ``auto`` follows the model
            dtype, the programs' bf16 cache); the plugin's forms open with :data:`BF16_NOT_BOUND`.
    """
    qpc_path = f"{vision_qpc}:{language_qpc}"
    vision_group = list(range(vision_devices))
    language_group = list(range(vision_devices, vision_devices + language_devices))
    limit = {"image": max_images}
    sizes: dict[str, Any] = {}
    if resolutions:
        sizes = {"height": [h for h, _ in resolutions], "width": [w for _, w in resolutions]}
    quantized: dict[str, str] = {}
    if mxfp6_matmul:
        quantized["quantization"] = "mxfp6"
    if kv_cache_dtype == "mxint8":
        quantized["kv_cache_dtype"] = "mxint8"
    if hardware == "ai200":
        quantized["dtype"] = AI200_DTYPE
    not_served = f"{SAMPLER_NOT_SERVED}\n" if sampler else ""
    if hardware == "ai200":
        not_served += f"{BF16_NOT_BOUND}\n"
    # ref: vllm-qaic examples/qaic_vision_language.py main(): the two engines' arguments
    common = {
        "model": model,
        "max_model_len": ctx_len,
        "long_prefill_token_threshold": plugin_seq_len,
        "enable_prefix_caching": False,
        "limit_mm_per_prompt": limit,
    }
    plugin = {
        "vision": {
            **common,
            "runner": "pooling",
            "max_num_seqs": 1,
            "async_scheduling": False,
            **({"dtype": AI200_DTYPE} if hardware == "ai200" else {}),
            "additional_config": {"override_qaic_config": dict(sizes), "device_group": vision_group},
        },
        "language": {
            **common,
            "enable_mm_embeds": True,
            "max_num_seqs": batch_size,
            **quantized,
            "additional_config": {"override_qaic_config": dict(sizes), "device_group": language_group},
        },
    }
    first = {"height": resolutions[0][0], "width": resolutions[0][1]} if resolutions else {}
    encode = {**first, "kv_offload": True, "qpc_path": vision_qpc}
    decode = {**first, "kv_offload": True, "qpc_path": language_qpc}
    return {
        "available": True,
        "qpc_path": qpc_path,
        "env": {QPC_PATH_ENV: qpc_path},
        "model": model,
        "plugin": {"server": PLUGIN_VLLM, "engine_args": plugin},
        "override_qaic_config": {"encode": encode, "decode": decode},
        "commands": {
            "plugin_offline": not_served + _plugin_offline(qpc_path, plugin),
            "plugin_serve": not_served + _plugin_serve(qpc_path, plugin),
            "fork_offline": _fork_offline(
                model,
                ctx_len,
                fork_seq_len,
                batch_size,
                encode,
                decode,
                vision_group,
                language_group,
                quantized,
            ),
            "epd": _epd(
                model,
                ctx_len,
                fork_seq_len,
                batch_size,
                limit,
                encode,
                decode,
                vision_group,
                language_group,
                quantized,
            ),
        },
    }


def _plugin_offline(qpc_path: str, plugin: Mapping[str, Mapping[str, Any]]) -> str:
    """A Python script (one ``python3 -c`` argument): two LLMs, encode then generate."""
    lines = [
        "import os",
        f"os.environ[{QPC_PATH_ENV!r}] = {qpc_path!r}  # index 0: pooling instance, 1: generate instance",
        "from PIL import Image",
        "from vllm import LLM, SamplingParams",
        f"language = LLM(**{_python(plugin['language'])})",
        f"vision = LLM(**{_python(plugin['vision'])})",
        "prompt = {'prompt': 'USER PROMPT WITH THE IMAGE PLACEHOLDER', "
        "'multi_modal_data': {'image': Image.open('image.jpg').convert('RGB')}}",
        "embeds = vision.encode([prompt], pooling_task='embed')[0].outputs.data",
        "# Qwen2.5-VL takes {'image_embeds': embeds, 'image_grid_thw': grid} instead",
        "prompt['multi_modal_data'] = {'image': embeds}",
        "outputs = language.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))",
        "print(outputs[0].outputs[0].text)",
    ]
    return _heredoc(lines)


def _heredoc(lines: Sequence[str]) -> str:
    """``python3`` reading the script from a quoted here-document (no shell quoting inside)."""
    return "\n".join(["python3 - <<'PY'", *lines, "PY"])


def _plugin_serve(qpc_path: str, plugin: Mapping[str, Mapping[str, Any]]) -> str:
    env = f"{QPC_PATH_ENV}={shlex.quote(qpc_path)}"
    vision = shlex.join([*serve_argv(plugin["vision"]), "--port", str(VISION_PORT)])
    language = shlex.join([*serve_argv(plugin["language"]), "--port", str(LANGUAGE_PORT)])
    return f"{env} {vision} &\n{env} {language}"


def _fork_offline(
    model, ctx_len, seq_len, batch_size, encode, decode, vision_group, language_group, quantized
):
    """Two LLMs of the 0.8.5 fork, each told its QPC in ``override_qaic_config`` (as the launcher does)."""
    common = {"model": model, "device": "qaic", "max_model_len": ctx_len, "max_seq_len_to_capture": seq_len}
    dtype = {"dtype": quantized["dtype"]} if "dtype" in quantized else {}  # ai200: both engines bf16
    encode_args = {
        **common,
        "max_num_seqs": 1,
        "device_group": vision_group,
        **dtype,
        "override_qaic_config": encode,
    }
    decode_args = {
        **common,
        "max_num_seqs": batch_size,
        "device_group": language_group,
        **quantized,
        "override_qaic_config": decode,
    }
    lines = [
        "from vllm import LLM",
        f"encoder = LLM(**{_python(encode_args)})",
        f"decoder = LLM(**{_python(decode_args)})",
    ]
    return _heredoc(lines)


def _epd(model, ctx_len, seq_len, batch_size, limit, encode, decode, vision_group, language_group, quantized):
    """``docker run`` of the guide's disagg image (its entrypoint is the launcher) with OUT mounted."""
    # ref: the guide's Disaggregated-Serving page: --privileged, HF_HOME / QEFF_HOME inside the
    # container, the proxy port published.
    docker = [
        *("docker", "run", "--rm", "--privileged", "--shm-size=4gb", "-w", "/out"),
        *("-e", "HF_HOME=/out/.cache/huggingface", "-e", "QEFF_HOME=/out/.cache/qeff"),
        *("-p", f"{PROXY_PORT}:{PROXY_PORT}"),
    ]
    launcher = [
        *("--model", model, "--max-model-len", str(ctx_len)),
        *("--decode-max-seq-len-to-capture", str(seq_len), "--limit-mm-per-prompt", json.dumps(limit)),
        *("--port", str(PROXY_PORT), "--encode-port", str(ENCODE_PORT), "--decode-port", str(DECODE_PORT)),
        *("--encode-max-num-seqs", "1", "--decode-max-num-seqs", str(batch_size)),
        *("--encode-device-group", _group(vision_group), "--decode-device-group", _group(language_group)),
        "--enable-prefix-caching",
        *(word for key, value in quantized.items() for word in ("--" + key.replace("_", "-"), value)),
        *("--encode-override-qaic-config", _pairs(encode)),
        *("--decode-override-qaic-config", _pairs(decode)),
    ]
    # OUT ($PWD) and the image are left for the shell to expand.
    return f'{shlex.join(docker)} -v "$PWD":/out "{DOCKER_IMAGE}" {shlex.join(launcher)}'


def handoff_for_spec(spec: Any, vision_qpc: str, language_qpc: str, model: str | None) -> dict[str, Any]:
    """:func:`vllm_handoff` for a loaded spec and its QPC directories (relative to OUT).

    The servers are told the spec's still-image resolutions; the decode batch is the spec's
    ``full_batch_size`` when it has one (continuous batching), else its ``batch_size``. ``model``
    is OUT's copy of the runtime files (``"model"``); when None, the spec's model as written (a
    hub id or a directory on this machine).
    """
    from qeff_vision.compile.vllm_pooling import pooling_handoff
    from qeff_vision.contract.tasks import is_pooling
    from qeff_vision.families import get_family
    from qeff_vision.spec import build_specializations

    stills = [image for image in spec.vision.images if not getattr(image, "video", False)]
    if is_pooling(spec.task):  # one pooling instance, and why the plugin does not serve it
        return pooling_handoff(
            spec.task,
            model=model or spec.model,
            vision_qpc=vision_qpc,
            language_qpc=language_qpc,
            ctx_len=spec.ctx_len,
            max_images=spec.vision.max_images,
            resolutions=[(image.height, image.width) for image in stills],
            devices=spec.compile.vision.num_devices + spec.compile.language.num_devices,
            score_overrides=get_family(spec.family).vllm_score_overrides,
        )
    language = build_specializations(spec).language.specializations
    plugin_seq_len, _ = plugin_prefill([s.symbols for s in language])
    stills = [image for image in spec.vision.images if not getattr(image, "video", False)]
    return vllm_handoff(
        model=model or spec.model,
        vision_qpc=vision_qpc,
        language_qpc=language_qpc,
        ctx_len=spec.ctx_len,
        # A continuous-batching program decodes full_batch_size sequences at once: vLLM's
        # max-num-seqs (QEfficient compiles its CB decode specialization at that batch).
        batch_size=spec.full_batch_size or spec.batch_size,
        plugin_seq_len=plugin_seq_len,
        fork_seq_len=max(spec.prefill.seq_lens),
        resolutions=[(image.height, image.width) for image in stills],
        max_images=spec.vision.max_images,
        vision_devices=spec.compile.vision.num_devices,
        language_devices=spec.compile.language.num_devices,
        mxfp6_matmul=spec.compile.language.mxfp6_matmul,
        kv_cache_dtype=spec.compile.language.kv_cache_dtype,
        sampler=spec.compile.language.sampler is not None,
        hardware=spec.compile.hardware,
    )


def serve_text(manifest: Mapping[str, Any]) -> str:
    """The vLLM forms of a manifest, for ``--print-serve``: a title line, then the command."""
    vllm = manifest.get("vllm") or {}
    if not vllm.get("available"):
        raise UserError(f"no vLLM hand-off: {vllm.get('reason', 'the manifest has none')}")
    from qeff_vision.compile.vllm_pooling import POOLING_TITLES

    commands = vllm.get("commands") or {}
    titles = next((t for t in (TITLES, POOLING_TITLES) if set(commands) == set(t)), None)
    if titles is None:
        raise UserError(
            "the manifest's vLLM hand-off is from an older qeff-vision; compile again to refresh it"
        )
    return "\n\n".join(f"{titles[role]}\n{commands[role]}" for role in titles) + "\n"


def serve_sections(text: str) -> dict[str, str]:
    """The commands of a :func:`serve_text` (role -> command text), for checks and tests."""
    from qeff_vision.compile.vllm_pooling import POOLING_TITLES

    by_title = {title: role for role, title in (*TITLES.items(), *POOLING_TITLES.items())}
    sections = {}
    for block in text.strip("\n").split("\n\n# "):
        title, _, command = ("# " + block.removeprefix("# ")).partition("\n")
        sections[by_title[title]] = command
    return sections


GOLDEN_FILE = "vllm_serve.txt"
QPC_PLACEHOLDER = "qpc-<hash>"


def golden_serve_text(spec: Any) -> str:
    """The spec's golden ``vllm_serve.txt``: what ``compile --print-serve`` prints for it.

    Each QPC directory's content key is written ``<hash>`` (it is known only after export).
    """
    handoff = handoff_for_spec(spec, f"vision/{QPC_PLACEHOLDER}", f"lang/{QPC_PLACEHOLDER}", "model")
    return serve_text({"vllm": handoff})
