"""The target's rules over one program's compile options (``compile.aic_hw_version``, issue 49).

:func:`resolve_hardware` replaces ``auto`` by the detected version and requires both programs to
target one kind of device; :func:`hardware_rules` fills ai200's defaults (no ``-convert-to-fp16``,
bfloat16 KV cache and state) and refuses, with the reason, what a target cannot take. The facts
behind each refusal are in docs/decisions/044-ai200-bfloat16.md.
"""

from __future__ import annotations

from typing import Any

from qeff_vision.spec.hardware import AI100, AI200, AUTO, BFLOAT16, HwDetection
from qeff_vision.spec.node_precision import NODE_PRECISION_AUTO, NODE_PRECISION_NONE


def resolve_hardware(
    given: dict[str, dict[str, Any]], path: str, detect
) -> tuple[HwDetection | None, list[str]]:
    """Replace ``auto`` by the detected version in every program; both programs must agree."""
    detection = None
    if any(values.get("aic_hw_version") == AUTO for values in given.values()):
        detection = detect() if detect is not None else HwDetection(AI100, "no detection asked: ai100")
        for values in given.values():
            if values.get("aic_hw_version") == AUTO:
                values["aic_hw_version"] = detection.version
    kinds = {name: values.get("aic_hw_version", AI100) == AI200 for name, values in given.items()}
    if len(set(kinds.values())) > 1:
        named = ", ".join(f"{n} {'ai200' if k else 'ai100'}" for n, k in kinds.items())
        return detection, [
            f"{path}.aic_hw_version: the programs target different hardware ({named}); "
            "both run on one kind of accelerator"
        ]
    return detection, []


# Why a value is refused on a target (the SDK facts known; see docs/decisions/044-ai200-bfloat16.md).
_AI200_REFUSED = {
    ("convert_to_fp16", True): "-convert-to-fp16 is ai100's fp32-to-fp16 path; ai200 computes in "
    "bfloat16 (leave convert_to_fp16 out)",
    ("kv_cache_dtype", "float16"): "ai200 programs compute in bfloat16; a float16 cache would be "
    "converted on every read and write (use bfloat16, the ai200 default)",
    ("kv_cache_dtype", "mxint8"): "no public SDK release or QEfficient test pairs an MXINT8 KV cache "
    "with ai200's bfloat16 programs (QEfficient passes the flag through untested on ai200); use bfloat16",
    ("state_dtype", "float16"): "ai200 programs compute in bfloat16; keep recurrent state bfloat16 "
    "(the ai200 default) or float32",
}


def hardware_rules(values: dict[str, Any], path: str) -> list[str]:
    """Fill the hardware's defaults into one program's given values; refuse what the target lacks."""
    if values.get("aic_hw_version") != AI200:
        return [
            f"{path}.{key}: bfloat16 needs aic_hw_version: ai200 (ai100 has no bfloat16 compute; "
            "QEfficient loads bf16 checkpoints in float32 for ai100)"
            for key in ("kv_cache_dtype", "state_dtype")
            if values.get(key) == BFLOAT16
        ]
    refused = [(key, reason) for (key, value), reason in _AI200_REFUSED.items() if values.get(key) == value]
    problems = [f"{path}.{key}: {reason}" for key, reason in refused]
    plan = values.get("node_precision", NODE_PRECISION_AUTO)
    if plan not in (NODE_PRECISION_AUTO, NODE_PRECISION_NONE):
        problems.append(
            f"{path}.node_precision: a node precision file applies under -convert-to-fp16 only; "
            "ai200 computes in bfloat16 with fp32's range (auto plans nothing there)"
        )
    values["convert_to_fp16"] = False
    values.setdefault("kv_cache_dtype", BFLOAT16)
    values.setdefault("state_dtype", BFLOAT16)
    return problems
