"""Kimi-K2.5, Molmo2 and GLM-4.1V through the real vLLM 0.23.0 + vllm-qaic: why none is served.

vLLM 0.23 registers ``KimiK25ForConditionalGeneration`` and ``Molmo2ForConditionalGeneration``,
both written against the published checkpoints' remote-code configs and processors; the plugin
snapshot has no code for either (issue 41). It has none for GLM-4.1V either (issue 51): vLLM 0.23
registers ``Glm4vForConditionalGeneration``, but the plugin's M-RoPE positions come from a
registry of Qwen-VL model types only. Each case compiles the tiny checkpoint's one-image artifact as
test_vllm_serving.py does and serves it; the engine stops before any request reaches the device,
and the test asserts the exact reason, so the day vLLM (or its transformers) changes, this turns
red. Kimi-K2.5 is tried twice: with transformers' architecture name our config carries, and with the
published one (``KimiK25ForConditionalGeneration``) written into the artifact's config, as a real
checkpoint's would be.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.vllm_tier import prepare
from tests.vllm_tier.test_vllm_serving import _serve

CASES = {
    "kimi_k25": prepare.Case("kimi_k25", 8, (100, 150)),
    # Every Molmo2 image token attends to every other one: the bucket holds the whole image.
    "molmo2": prepare.Case("molmo2", 64, (60, 60), whole_images=True),
    # 4 x 5 merged 28-pixel cells: 20 image tokens over several 8-token chunks.
    "glm4v": prepare.Case("glm4v", 8, (100, 150)),
}
PUBLISHED_KIMI = "KimiK25ForConditionalGeneration"
# (family, architecture written into the artifact's config or None) -> (reason, the log's sign).
NOT_SERVED = {
    ("kimi_k25", None): (
        "vLLM 0.23 registers Kimi-K2.5 under the published name only: transformers' "
        "Kimi_K25ForConditionalGeneration (our config's) is not a vLLM architecture",
        "Model architectures ['Kimi_K25ForConditionalGeneration'] are not supported for now",
    ),
    ("kimi_k25", PUBLISHED_KIMI): (
        "under the published name vLLM's KimiK25ProcessingInfo loads the image processor with "
        "AutoImageProcessor; the vLLM venv's transformers (5.5.4) has no kimi_k25 image processor "
        "and the published checkpoint's is remote code (trust_remote_code), which the artifact does "
        "not carry: the engine stops while it starts",
        "Unrecognized image processor in",
    ),
    ("molmo2", None): (
        "the vLLM venv's transformers (5.5.4) does not know model_type molmo2 (transformers added it "
        "later; vLLM's Molmo2 reads allenai's remote-code config), so vLLM refuses the model config "
        "before the plugin loads anything; the plugin has no Molmo2 code either",
        "has model type `molmo2` but Transformers does not recognize this architecture",
    ),
    ("glm4v", None): (
        "vLLM 0.23 registers Glm4vForConditionalGeneration and the engine starts, but at the first "
        "request (the pooling instance's encode) vLLM's model runner asks the plugin for the "
        "prompt's M-RoPE positions, and the plugin takes them from a registry of Qwen-VL model "
        "types only (QaicMultiModal._MROPE_CLASS_REGISTRY): a ValueError before any call reaches "
        "the device",
        "Unsupported model type for MRoPE: 'glm4v'",
    ),
}


def _build(case: prepare.Case, root: Path, architecture: str | None) -> Path:
    """The one-image artifact's job (an image over several chunks and a text-only request)."""
    requests = prepare.Requests(case, root)
    image = requests.image(case.image, 1)
    batches = [
        [requests.request(["<image>", prepare.TEXT], [image])],
        [requests.request(["Hello, how are you today?"])],
    ]
    out = prepare.compile_case(case, root, requests.checkpoint, full_batch_size=None)
    job = requests.job("single", out, batches)
    if architecture is not None:
        for role in ("vision", "language"):
            config = Path(job["engine_args"][role]["model"]) / "config.json"
            data = json.loads(config.read_text())
            config.write_text(json.dumps({**data, "architectures": [architecture]}, indent=2))
    return root / "job-single.json"


@pytest.mark.parametrize(("family", "architecture"), sorted(NOT_SERVED, key=str))
def test_why_vllm_does_not_serve_the_family(tmp_path, family, architecture):
    """The engine stops for the documented reason (this turns red when vLLM, the plugin or we change)."""
    with pytest.raises(AssertionError, match="serve.py failed") as failure:
        _serve(_build(CASES[family], tmp_path, architecture))
    _, sign = NOT_SERVED[(family, architecture)]
    # The whole log (the failure message keeps only its tail; vLLM's architecture error lists
    # every architecture it has first).
    log = Path(re.search(r"log in (\S+):", str(failure.value)).group(1)).read_text()
    assert sign in log, log[-2000:]
