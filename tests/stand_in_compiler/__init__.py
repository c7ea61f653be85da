"""Install the stand-in compiler as ``<root>/exec/qaic-exec`` (or ``qaic-compile``) with SDK version files."""

import stat
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("stand_in.py")

APPS_XML = """<?xml version="1.0" encoding="UTF-8"?>
<versions>
  <ci_build>
    <base_name>AIC_APPS_STAND_IN</base_name>
    <base_version>{base}</base_version>
    <build_id>{build}</build_id>
  </ci_build>
</versions>
"""


def install(root, *, name="qaic-exec", mode="ok", version="1.20.2.0", layout="any", record=None, sleep=None):
    """Write an executable wrapper that runs stand_in.py with the venv's Python; return its path."""
    root = Path(root)
    (root / "exec").mkdir(parents=True, exist_ok=True)
    if version:
        parts = version.split(".")
        base, build = ".".join(parts[:2]), ".".join(parts[2:])
        (root / "versions").mkdir(exist_ok=True)
        (root / "versions" / "apps.xml").write_text(APPS_XML.format(base=base, build=build))
    env = {"STAND_IN_MODE": mode, "STAND_IN_LAYOUT": layout}
    if record:
        env["STAND_IN_RECORD"] = str(record)
    if sleep is not None:
        env["STAND_IN_SLEEP"] = str(sleep)
    exports = "".join(f"export {key}='{value}'\n" for key, value in env.items())
    wrapper = root / "exec" / name
    wrapper.write_text(f"#!/bin/sh\n{exports}exec '{sys.executable}' '{SCRIPT}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper
