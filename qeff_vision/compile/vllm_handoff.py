"""How vLLM on Cloud AI 100 serves the two compiled programs: the manifest block and the commands.

The forms follow the Cloud AI "Multimodality Support with vLLM" guide
(https://quic.github.io/cloud-ai-sdk-pages/latest/Getting-Started/Model-Serving/vLLM-Serving/Multimodality.html):

* **dual QPC**, one endpoint: ``VLLM_QAIC_QPC_PATH=<vision_qpc>:<language_qpc>`` (vision first)
  with ``override_qaic_config`` ``{"kv_offload": true}``. The other flags are the qaic vLLM
  arguments of the guide's argument table (vLLM-Serving/input-args-env-variables.html):
  ``--max-model-len`` (context length), ``--max-num-seqs`` (decode batch size),
  ``--max-seq-len-to-capture`` (prefill sequence length), ``--device-group``, ``--quantization
  mxfp6``, ``--kv-cache-dtype mxint8``.
* **E-PD disaggregation** with the qaic-disagg container's launcher: ``--encode-override-qaic-config
  "height=.. width=.. kv_offload=True qpc_path=.."``, ``--decode-override-qaic-config``,
  ``--encode-device-group``, ``--decode-device-group``, ``--encode-max-num-seqs``,
  ``--decode-max-num-seqs``, ``--limit-mm-per-prompt``. The launcher parses an override config as
  space-separated ``key=value`` pairs; it starts one encode instance per ``--encode-port`` (none by
  default) and one decode instance on port 8003 unless ``--decode-port`` says otherwise, so the
  encode port is given.

Every path is relative to OUT (the commands run in OUT), and the model path is OUT's copy of the
checkpoint's runtime files when compile made one, so a moved OUT serves as it is.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from qeff_vision.errors import UserError

QPC_PATH_ENV = "VLLM_QAIC_QPC_PATH"
ENCODE_PORT = 8001
DECODE_PORT = 8003  # the launcher's default decode port
TITLES = {
    "dual_qpc": "# dual QPC: one endpoint serving the vision and language QPCs (run in OUT)",
    "epd": "# E-PD disaggregated: encode and prefill-decode instances (qaic-disagg container, run in OUT)",
}


def _pairs(config: Mapping[str, Any]) -> str:
    """``key=value`` pairs as the launcher's override-config parser splits them (no spaces inside)."""
    return " ".join(f"{key}={value}" for key, value in config.items())


def vllm_handoff(
    *,
    model: str,
    vision_qpc: str,
    language_qpc: str,
    ctx_len: int,
    batch_size: int,
    prefill_seq_len: int,
    resolution: tuple[int, int] | None,
    max_images: int,
    vision_devices: int,
    language_devices: int,
    mxfp6_matmul: bool,
    kv_cache_dtype: str,
) -> dict[str, Any]:
    """The manifest's ``vllm`` block: QPC path, override configs and the two commands.

    Args:
        model: What vLLM loads config, tokenizer and processor from (``model`` in OUT, or an id).
        vision_qpc: The vision QPC directory, relative to OUT.
        language_qpc: The language QPC directory, relative to OUT.
        ctx_len: Context length of the language program.
        batch_size: Decode batch size.
        prefill_seq_len: The largest prefill bucket.
        resolution: (height, width) of the first compiled image, which the encoder is told (the
            guide's ``height``/``width``); None leaves them out.
        max_images: Images one request may carry.
        vision_devices: Devices the vision QPC was compiled for.
        language_devices: Devices the language QPC was compiled for.
        mxfp6_matmul: The language program has MXFP6 weights.
        kv_cache_dtype: ``mxint8`` or the default.
    """
    qpc_path = f"{vision_qpc}:{language_qpc}"
    encode: dict[str, Any] = {}
    if resolution is not None:
        encode.update(height=resolution[0], width=resolution[1])
    encode.update(kv_offload=True, qpc_path=vision_qpc)
    decode = {"kv_offload": True, "qpc_path": language_qpc}
    overrides = {"dual_qpc": {"kv_offload": True}, "encode": encode, "decode": decode}
    quantized = []
    if mxfp6_matmul:
        quantized += ["--quantization", "mxfp6"]
    if kv_cache_dtype == "mxint8":
        quantized += ["--kv-cache-dtype", "mxint8"]
    limit = json.dumps({"image": max_images})
    vision_group = list(range(vision_devices))
    language_group = list(range(vision_devices, vision_devices + language_devices))
    dual = [
        *("vllm", "serve", model, "--max-model-len", str(ctx_len), "--max-num-seqs", str(batch_size)),
        *("--max-seq-len-to-capture", str(prefill_seq_len), "--limit-mm-per-prompt", limit),
        *("--device-group", ",".join(map(str, range(max(vision_devices, language_devices))))),
        *quantized,
        *("--override-qaic-config", json.dumps(overrides["dual_qpc"])),
    ]
    epd = [
        *("qaic-disagg", "--model", model, "--max-model-len", str(ctx_len)),
        *("--decode-max-seq-len-to-capture", str(prefill_seq_len), "--limit-mm-per-prompt", limit),
        *("--encode-port", str(ENCODE_PORT), "--decode-port", str(DECODE_PORT)),
        *("--encode-max-num-seqs", "1", "--decode-max-num-seqs", str(batch_size)),
        *("--encode-device-group", _group(vision_group), "--decode-device-group", _group(language_group)),
        *quantized,
        *("--encode-override-qaic-config", _pairs(encode)),
        *("--decode-override-qaic-config", _pairs(decode)),
    ]
    return {
        "available": True,
        "qpc_path": qpc_path,
        "env": {QPC_PATH_ENV: qpc_path},
        "model": model,
        "override_qaic_config": overrides,
        "commands": {
            "dual_qpc": f"{QPC_PATH_ENV}={shlex.quote(qpc_path)} {shlex.join(dual)}",
            "epd": shlex.join(epd),
        },
    }


def _group(devices: Sequence[int]) -> str:
    return ",".join(map(str, devices))


def handoff_for_spec(spec: Any, vision_qpc: str, language_qpc: str, model: str | None) -> dict[str, Any]:
    """:func:`vllm_handoff` for a loaded spec and its QPC directories (relative to OUT).

    The encoder is told the spec's first still-image resolution; the decode batch is the spec's
    ``full_batch_size`` when it has one (continuous batching), else its ``batch_size``. ``model``
    is OUT's copy of the runtime files (``"model"``); when None, the spec's model as written (a
    hub id or a directory on this machine).
    """
    stills = [image for image in spec.vision.images if not getattr(image, "video", False)]
    first = stills[0] if stills else None
    return vllm_handoff(
        model=model or spec.model,
        vision_qpc=vision_qpc,
        language_qpc=language_qpc,
        ctx_len=spec.ctx_len,
        # A continuous-batching program decodes full_batch_size sequences at once: vLLM's
        # max-num-seqs (QEfficient compiles its CB decode specialization at that batch).
        batch_size=spec.full_batch_size or spec.batch_size,
        prefill_seq_len=max(spec.prefill.seq_lens),
        resolution=(first.height, first.width) if first is not None else None,
        max_images=spec.vision.max_images,
        vision_devices=spec.compile.vision.num_devices,
        language_devices=spec.compile.language.num_devices,
        mxfp6_matmul=spec.compile.language.mxfp6_matmul,
        kv_cache_dtype=spec.compile.language.kv_cache_dtype,
    )


def serve_text(manifest: Mapping[str, Any]) -> str:
    """The vLLM command lines of a manifest, for ``--print-serve``."""
    vllm = manifest.get("vllm") or {}
    if not vllm.get("available"):
        raise UserError(f"no vLLM hand-off: {vllm.get('reason', 'the manifest has none')}")
    commands = vllm.get("commands") or {}
    if set(commands) != set(TITLES):
        raise UserError(
            "the manifest's vLLM hand-off is from an older qeff-vision; compile again to refresh it"
        )
    return "\n".join(f"{TITLES[role]}\n{commands[role]}" for role in TITLES) + "\n"


GOLDEN_FILE = "vllm_serve.txt"
QPC_PLACEHOLDER = "qpc-<hash>"


def golden_serve_text(spec: Any) -> str:
    """The spec's golden ``vllm_serve.txt``: what ``compile --print-serve`` prints for it.

    Each QPC directory's content key is written ``<hash>`` (it is known only after export).
    """
    handoff = handoff_for_spec(spec, f"vision/{QPC_PLACEHOLDER}", f"lang/{QPC_PLACEHOLDER}", "model")
    return serve_text({"vllm": handoff})
