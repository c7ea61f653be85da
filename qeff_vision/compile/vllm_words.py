"""The words both vLLM hand-offs share (generate: :mod:`.vllm_handoff`, pooling: :mod:`.vllm_pooling`).

Their own module so the two hand-off modules import it, not each other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: The environment variable naming the plugin's programs (``<vision>:<language>``).
QPC_PATH_ENV = "VLLM_QAIC_QPC_PATH"
PLUGIN_VLLM = "vLLM 0.23.0 + vllm-qaic"


def _python(value: Any) -> str:
    """A JSON-able value as Python source (true/false/null spelled the Python way)."""
    return repr(json.loads(json.dumps(value)))


def serve_argv(engine_args: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` words for engine arguments (booleans as ``--x`` / ``--no-x``)."""
    words = ["vllm", "serve", str(engine_args["model"])]
    for key, value in engine_args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words
