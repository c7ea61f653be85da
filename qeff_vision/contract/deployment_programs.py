"""Deployment modes and the programs each compiles (pure data, shared by spec/, compile/, runtime/).

``dual`` is the vision program plus one language program; ``single`` one program holding encoder
and decoder; ``disaggregated`` the vision program plus ``lang_prefill`` and ``lang_decode``, both
compiled from the one language graph (docs/design.md "Deployment modes").
"""

from __future__ import annotations

DUAL = "dual"
SINGLE = "single"
DISAGGREGATED = "disaggregated"
DEPLOYMENTS = (DUAL, SINGLE, DISAGGREGATED)
LANG_PREFILL = "lang_prefill"
LANG_DECODE = "lang_decode"
#: A single program's keep specializations bind every image symbol to this (the compiler takes
#: positive values only; the host's placeholder image has these sides): no encoder runs there.
# ref: QEfficient's single QPC encodes in every specialization; ours only where the side is larger.
KEEP_SIDE = 1

#: Program directory names under OUT per mode, in compile order; each maps to its compile: section.
PROGRAMS: dict[str, dict[str, str]] = {
    DUAL: {"vision": "vision", "lang": "language"},
    SINGLE: {"lang": "language"},
    DISAGGREGATED: {"vision": "vision", LANG_PREFILL: "language", LANG_DECODE: "language"},
}
