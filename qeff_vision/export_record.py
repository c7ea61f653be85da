"""``export.json``: the record an export leaves beside its two graphs.

Torch-free, so the compile driver and the runtime read it without importing the exporter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from qeff_vision.errors import UserError
from qeff_vision.fsutil import read_json

EXPORT_FILE = "export.json"
PROGRAMS = ("vision", "lang")
# Which vision program an export holds: one specialized per resolution, or per patch count.
VISION_MODE = "vision_mode"
RESOLUTIONS = "resolutions"
PATCH_BUCKETS = "patch_buckets"


def vision_mode(manifest: dict[str, Any]) -> str:
    """``patch_buckets`` or ``resolutions`` (exports from before the key hold the latter)."""
    return manifest.get(VISION_MODE) or RESOLUTIONS


def config_hash(model_dir: str | Path) -> str:
    """sha256 of config.json: identifies the architecture an export belongs to."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def read_export(out_dir: str | Path) -> dict[str, Any]:
    """Read and sanity-check ``export.json`` of an export directory.

    Raises:
        UserError: No export.json, an unreadable one, or one without both programs.
    """
    path = Path(out_dir) / EXPORT_FILE
    manifest = read_json(path, missing=f"{out_dir}: not an export directory (no {EXPORT_FILE})")
    programs = manifest.get("programs")
    if not isinstance(programs, dict) or any(program not in programs for program in PROGRAMS):
        raise UserError(f"{path}: expected programs 'vision' and 'lang'")
    return manifest


def recorded_symbols(manifest: dict[str, Any]) -> set[str]:
    """Every symbolic axis ``export.json`` records on the programs' inputs and outputs."""
    found: set[str] = set()
    for program in (manifest.get("programs") or {}).values():
        for side in ("inputs", "outputs"):
            for io in ((program or {}).get(side) or {}).values():
                found.update(str(symbol) for symbol in ((io or {}).get("axes") or {}).values())
    return found
