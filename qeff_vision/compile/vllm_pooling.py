"""vLLM forms of a pooling program (spec ``task: embed | score``), and why the plugin does not serve them.

vLLM 0.23 serves embedding and reranking models with its pooling runner: ``runner="pooling"`` with
``convert="embed"`` turns a ``*ForConditionalGeneration`` into a last-token, normalized embedding
model (``LLM.embed``, ``/v1/embeddings``); a reranker is loaded with the family's
``Family.vllm_score_overrides`` (Qwen3-VL's: ``hf_overrides`` naming
``Qwen3VLForSequenceClassification`` with ``classifier_from_token ["no", "yes"]`` and
``is_original_qwen3_reranker`` (vllm/model_executor/models/config.py,
``Qwen3VLForSequenceClassificationConfig``: method ``from_2_way_softmax``, i.e.
``sigmoid(logit yes - logit no)``; ``LLM.score``, ``/score``)). Those are the forms printed here,
pointed at OUT's two programs the way the plugin takes them (``VLLM_QAIC_QPC_PATH``).

The vllm-qaic plugin does not run them on our pooling program: for a multimodal model a pooling
instance is its vision-encoder instance (``qaic_multimodal.py``: ``QaicMultiModal`` sets
``VisionEncoderPooler``, whose only task is ``embed`` of images; ``qaic.py`` loads QPC index 0
with ``skip_lang``), and its language-side pooling path (``_run_encode``) is taken only for a
model that is not multimodal. So the forms open with :data:`POOLING_NOT_SERVED`;
tests/vllm_tier asserts those lines of the plugin.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from qeff_vision.compile.vllm_words import PLUGIN_VLLM, QPC_PATH_ENV, _python, serve_argv
from qeff_vision.contract.tasks import EMBED

PORT = 8000
POOLING_TITLES = {
    "pooling_offline": f"# {PLUGIN_VLLM}, offline: one pooling LLM (runner pooling) on the two programs "
    "(python3 in OUT)",
    "pooling_serve": f"# {PLUGIN_VLLM}, online: the same instance as an endpoint (/v1/embeddings, /score; "
    "run in OUT)",
}
POOLING_NOT_SERVED = (
    f"# NOT SERVED: {PLUGIN_VLLM} runs --runner pooling on a multimodal model as its vision-encoder "
    "instance only (VisionEncoderPooler on QPC index 0, skip_lang), never a pooling language program "
    "(its _run_encode path is for text-only models), so these commands return no prompt embedding or "
    "score; use qeff-vision run --embed / --score"
)


def pooling_engine_args(
    task: str,
    model: str,
    ctx_len: int,
    max_images: int,
    resolutions: Sequence[tuple[int, int]],
    devices: int,
    score_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The pooling LLM's engine arguments for ``task``.

    ``score_overrides`` is the family's ``Family.vllm_score_overrides``: how vLLM loads its
    reranker as a yes/no classifier.
    """
    sizes: dict[str, Any] = {}
    if resolutions:
        sizes = {"height": [h for h, _ in resolutions], "width": [w for _, w in resolutions]}
    kind = {"convert": "embed"} if task == EMBED else {"hf_overrides": dict(score_overrides or {})}
    return {
        "model": model,
        "runner": "pooling",
        **kind,
        "max_model_len": ctx_len,
        "max_num_seqs": 1,
        "enable_prefix_caching": False,
        "limit_mm_per_prompt": {"image": max_images},
        "additional_config": {"override_qaic_config": sizes, "device_group": list(range(devices))},
    }


def pooling_commands(task: str, qpc_path: str, engine_args: Mapping[str, Any]) -> dict[str, str]:
    """Role -> command text of the two pooling forms (each opening with the NOT SERVED line)."""
    if task == EMBED:
        call = [
            "embedding = llm.embed([prompt])[0].outputs.embedding",
            "print(len(embedding), embedding[:4])",
        ]
    else:
        call = [
            "document = {'prompt': 'DOCUMENT TEXT', 'multi_modal_data': prompt['multi_modal_data']}",
            "print(llm.score('QUERY TEXT', [document])[0].outputs.score)",
        ]
    script = [
        "import os",
        f"os.environ[{QPC_PATH_ENV!r}] = {qpc_path!r}",
        "from PIL import Image",
        "from vllm import LLM",
        f"llm = LLM(**{_python(engine_args)})",
        "prompt = {'prompt': 'USER PROMPT WITH THE IMAGE PLACEHOLDER', "
        "'multi_modal_data': {'image': Image.open('image.jpg').convert('RGB')}}",
        *call,
    ]
    offline = "\n".join(["python3 - <<'PY'", *script, "PY"])
    env = f"{QPC_PATH_ENV}={shlex.quote(qpc_path)}"
    serve = f"{env} {shlex.join([*serve_argv(engine_args), '--port', str(PORT)])}"
    return {
        "pooling_offline": f"{POOLING_NOT_SERVED}\n{offline}",
        "pooling_serve": f"{POOLING_NOT_SERVED}\n{serve}",
    }


def pooling_handoff(
    task: str,
    *,
    model: str,
    vision_qpc: str,
    language_qpc: str,
    ctx_len: int,
    max_images: int,
    resolutions: Sequence[tuple[int, int]],
    devices: int,
    score_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest's ``vllm`` block of a pooling program (see the module docstring)."""
    qpc_path = f"{vision_qpc}:{language_qpc}"
    args = pooling_engine_args(task, model, ctx_len, max_images, resolutions, devices, score_overrides)
    return {
        "available": True,
        "served": False,
        "reason": POOLING_NOT_SERVED.removeprefix("# NOT SERVED: "),
        "qpc_path": qpc_path,
        "env": {QPC_PATH_ENV: qpc_path},
        "model": model,
        "plugin": {"server": PLUGIN_VLLM, "engine_args": {"pooling": args}},
        "commands": pooling_commands(task, qpc_path, args),
    }
