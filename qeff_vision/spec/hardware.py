"""Target hardware of a spec: ``compile.aic_hw_version`` (``ai100``, ``ai200`` or ``auto``).

``auto`` asks the installed platform SDK which accelerator is present, as QEfficient does
(ref: quic/efficient-transformers QEfficient/utils/constants.py ``get_default_aic_hw_version``,
commit ebf55e8): run ``/opt/qti-aic/tools/qaic-util -q`` (10 s at most), read the first device's
``FW IMAGE_VARIANT`` field, and take ``ai200`` when the variant names ``AIC200``; anything else,
no device listed, a tool that is missing or fails, gives ``ai100``. Some platform releases print
the field as ``NSP IMAGE_VARIANT``; both spellings are read. ``QAIC_UTIL`` names another tool path.

What a version changes (see docs/decisions/044-ai200-bfloat16.md): on ai100 an fp32 graph is
compiled with ``-convert-to-fp16`` and its IO and state in float16; on ai200 the device computes in
bfloat16 (QEfficient keeps a bf16 checkpoint bf16 only when the target is ai200:
``modeling_auto.py`` ``_resolve_torch_dtype``), with no ``-convert-to-fp16`` and bfloat16 custom IO.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

AI100 = "ai100"
AI200 = "ai200"
AUTO = "auto"
BFLOAT16 = "bfloat16"
# "2.0" is how older SDKs (and older QEfficient) spell ai100.
AI100_NUMERIC = "2.0"
QAIC_UTIL_ENV = "QAIC_UTIL"
DEFAULT_QAIC_UTIL = Path("/opt/qti-aic/tools/qaic-util")
DETECT_TIMEOUT_SECONDS = 10.0
_VARIANT = re.compile(r"(?:FW|NSP)\s+IMAGE_VARIANT\s*:\s*(\S+)")


def is_ai200(version: str) -> bool:
    """Whether ``version`` (a resolved ``aic_hw_version``) is AI 200 (bfloat16 compute)."""
    return version == AI200


@dataclass(frozen=True)
class HwDetection:
    """What ``aic_hw_version: auto`` resolved to, and why.

    Attributes:
        version: ``ai100`` or ``ai200``.
        reason: One line for logs and manifests (the variant read, or why the fallback was taken).
        variant: The first device's image variant as printed, or ``None`` when none was read.
    """

    version: str
    reason: str
    variant: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """The manifest record."""
        return {"aic_hw_version": self.version, "reason": self.reason, "variant": self.variant}


def version_from_qaic_util(output: str) -> HwDetection:
    """Read ``qaic-util -q`` output: the first device's image variant decides (``ai100`` without one)."""
    match = _VARIANT.search(output)
    if match is None:
        return HwDetection(AI100, "qaic-util -q listed no device image variant: ai100 assumed")
    variant = match.group(1)
    version = AI200 if "AIC200" in variant.upper() else AI100
    return HwDetection(version, f"qaic-util -q: first device's IMAGE_VARIANT {variant} -> {version}", variant)


Runner = Callable[..., subprocess.CompletedProcess]


def detect_hw_version(
    tool: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    run: Runner = subprocess.run,
    timeout: float = DETECT_TIMEOUT_SECONDS,
) -> HwDetection:
    """Resolve ``auto``: ask ``qaic-util -q``; ``ai100`` (with the reason) when it cannot answer.

    Args:
        tool: The qaic-util executable; ``QAIC_UTIL`` from ``env``, else the SDK's default path.
        env: Environment to read ``QAIC_UTIL`` from (``os.environ`` by default).
        run: ``subprocess.run`` or a double of it (tests).
        timeout: Seconds the tool may take.
    """
    env = os.environ if env is None else env
    path = Path(tool) if tool is not None else Path(env.get(QAIC_UTIL_ENV) or DEFAULT_QAIC_UTIL)
    if not path.is_file() or not os.access(path, os.X_OK):
        return HwDetection(AI100, f"{path} not found (no platform SDK): ai100 assumed")
    try:
        result = run([str(path), "-q"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return HwDetection(AI100, f"{path} -q failed ({type(exc).__name__}): ai100 assumed")
    if result.returncode != 0 and not _VARIANT.search(result.stdout or ""):
        return HwDetection(AI100, f"{path} -q exited with {result.returncode} and no device: ai100 assumed")
    return version_from_qaic_util(result.stdout or "")


@functools.cache
def detected_once(tool: str) -> HwDetection:
    """:func:`detect_hw_version` for ``tool``, asked once per process (specs loaded together agree)."""
    return detect_hw_version(tool)


def detect_for_spec() -> HwDetection:
    """The detection a spec's ``auto`` resolves to (the tool ``QAIC_UTIL`` or the SDK default names)."""
    return detected_once(os.environ.get(QAIC_UTIL_ENV) or str(DEFAULT_QAIC_UTIL))
