"""The vLLM tier runs only when asked (``make test-vllm`` sets QEFF_VLLM_TIER=1).

It needs a second venv with vLLM 0.23.0 (VLLM_VENV, default .venv-vllm) and a vllm-qaic checkout
(VLLM_QAIC_SRC); the default ``make test`` does not collect it.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("QEFF_VLLM_TIER") == "1" else ["test_*.py"]
