"""Find the Cloud AI 100 SDK compiler and read the SDK version. The compiler is found, never faked.

Lookup order for the compiler: an explicit path (``--compiler``), the ``QAIC_COMPILER`` environment
variable, then the SDK's default install locations. ``qaic-exec`` was renamed ``qaic-compile`` in
newer SDKs; both names are tried.

The Apps SDK records its version in ``<sdk>/versions/apps.xml`` (``<base_version>`` and
``<build_id>`` elements; QEfficient reads the same file, ref: quic/efficient-transformers
QEfficient/utils/constants.py ``SDK_APPS_XML``). The version decides two things for us: whether
the compiler accepts named specializations (``{"name": ..., "symbols": {...}}``; older compilers
reject them) and how the hardware version is spelled.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from qeff_vision.errors import UserError

COMPILER_ENV = "QAIC_COMPILER"
DEFAULT_SDK_ROOT = Path("/opt/qti-aic")
QAIC_EXEC = "qaic-exec"
QAIC_COMPILE = "qaic-compile"
DEFAULT_COMPILERS = (DEFAULT_SDK_ROOT / "exec" / QAIC_EXEC, DEFAULT_SDK_ROOT / "exec" / QAIC_COMPILE)
VERSION_FILES = ("versions/apps.xml", "versions/platform.xml")

# First SDK release whose compiler reads named specializations. The rename to qaic-compile came
# later, so a compiler named qaic-compile takes them too. Project assumption: raise it if a
# compiler of this version rejects the named layout (the spec can always force `flat`).
NAMED_SPECIALIZATIONS_SINCE = (1, 20)
# QEfficient passed "-aic-hw-version=2.0" to old qaic-exec releases and "ai100" to newer ones.
HW_VERSION_NAME_SINCE = (1, 18)


@dataclass(frozen=True)
class SdkInfo:
    """What is known about the installed SDK.

    Attributes:
        compiler: Path of the compiler executable, ``None`` when only version files were found.
        version: Apps SDK version such as ``"1.20.2.0"``, ``None`` when no version file is readable.
        root: SDK root directory the version was read from (``/opt/qti-aic`` by default).
    """

    compiler: Path | None
    version: str | None
    root: Path | None = None

    @property
    def compiler_name(self) -> str:
        """``qaic-exec`` or ``qaic-compile`` (any other file name is treated as ``qaic-exec``)."""
        if self.compiler is not None and self.compiler.name == QAIC_COMPILE:
            return QAIC_COMPILE
        return QAIC_EXEC

    @property
    def version_tuple(self) -> tuple[int, ...] | None:
        """Numeric version components, ``None`` when the version is unknown."""
        return parse_version(self.version)

    @property
    def named_specializations(self) -> bool:
        """True when the compiler takes the named specialization layout.

        Unknown versions get the flat layout, which every SDK reads.
        """
        if self.compiler_name == QAIC_COMPILE:
            return True
        version = self.version_tuple
        return version is not None and version >= NAMED_SPECIALIZATIONS_SINCE

    @property
    def specialization_layout(self) -> str:
        """``named`` or ``flat``: what a spec's ``layout: auto`` resolves to."""
        return "named" if self.named_specializations else "flat"

    def hw_version_flag_value(self, requested: str) -> str:
        """Spelling of ``-aic-hw-version`` this SDK understands for ``requested``."""
        version = self.version_tuple
        old = self.compiler_name == QAIC_EXEC and version is not None and version < HW_VERSION_NAME_SINCE
        if requested == "ai100" and old:
            return "2.0"
        return requested

    def to_dict(self) -> dict[str, str | None]:
        """Plain dictionary for manifests."""
        return {
            "compiler": str(self.compiler) if self.compiler else None,
            "compiler_name": self.compiler_name if self.compiler else None,
            "version": self.version,
            "root": str(self.root) if self.root else None,
            "specialization_layout": self.specialization_layout,
        }


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"1.20.2.0"`` -> ``(1, 20, 2, 0)``; ``None`` for anything without a leading number."""
    if not text:
        return None
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    if not match:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def read_sdk_version(root: str | os.PathLike) -> str | None:
    """The SDK version from ``root/versions/apps.xml`` (or ``platform.xml``), ``None`` if unreadable.

    ``base_version`` (``1.20``) and ``build_id`` (``2.0``) are joined into ``1.20.2.0``.
    """
    for relative in VERSION_FILES:
        path = Path(root) / relative
        try:
            tree = ElementTree.parse(path)
        except (OSError, ElementTree.ParseError):
            continue
        base = tree.getroot().findtext(".//base_version")
        if not base or not base.strip():
            continue
        build = tree.getroot().findtext(".//build_id")
        return base.strip() + (f".{build.strip()}" if build and build.strip() else "")
    return None


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def compiler_candidates(explicit: str | os.PathLike | None, env: Mapping[str, str]) -> list[tuple[str, Path]]:
    """Every place the compiler is looked for, in order, with where each came from."""
    candidates: list[tuple[str, Path]] = []
    if explicit:
        candidates.append(("--compiler", Path(explicit)))
    if env.get(COMPILER_ENV):
        candidates.append((COMPILER_ENV, Path(env[COMPILER_ENV])))
    candidates.extend(("SDK default", path) for path in DEFAULT_COMPILERS)
    return candidates


def find_compiler(explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The compiler executable, or a user error naming every path tried.

    An explicit path or ``QAIC_COMPILER`` that does not exist is an error on its own: silently
    falling back to another compiler would compile with something the user did not ask for.
    """
    env = os.environ if env is None else env
    tried = []
    for source, path in compiler_candidates(explicit, env):
        if _usable(path):
            return path.resolve()
        if source != "SDK default":
            raise UserError(f"compiler {path} (from {source}) is not an executable file")
        tried.append(str(path))
    raise UserError(
        "no SDK compiler found (tried " + ", ".join(tried) + f"; set --compiler PATH or {COMPILER_ENV}); "
        "use --dry-run to write the compiler inputs and print the command lines, "
        "or --backend onnxruntime to verify the spec without the SDK"
    )


def sdk_root_of(compiler: Path) -> Path:
    """The SDK root a compiler belongs to: ``<root>/exec/qaic-exec`` -> ``<root>``."""
    return compiler.parent.parent


def detect_sdk(
    compiler: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    root: str | os.PathLike | None = None,
) -> SdkInfo | None:
    """What SDK is installed, without raising: ``None`` when neither compiler nor version files exist.

    Args:
        compiler: An explicit compiler path (as given to ``--compiler``).
        env: Environment to read ``QAIC_COMPILER`` from (``os.environ`` by default).
        root: SDK root holding ``versions/``; by default the root of the compiler found, else
            ``/opt/qti-aic``.
    """
    try:
        found: Path | None = find_compiler(compiler, env)
    except UserError:
        found = None
    sdk_root = Path(root) if root is not None else (sdk_root_of(found) if found else DEFAULT_SDK_ROOT)
    version = read_sdk_version(sdk_root)
    if found is None and version is None:
        return None
    return SdkInfo(compiler=found, version=version, root=sdk_root if version else None)
