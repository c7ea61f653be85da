"""The two compile backends as objects: the SDK compiler, or every specialization run on the host.

``compile --backend qaic`` (:data:`SDK_COMPILER`) finds the SDK compiler and builds QPCs;
``--backend onnxruntime`` (:data:`HOST_VERIFY`) needs no SDK and runs every specialization of
both programs once on onnxruntime, so the graphs must produce their outputs there. The driver
asks the object (:func:`compile_backend`) and never compares backend names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qeff_vision.compile_record import ONNXRUNTIME, QAIC
from qeff_vision.errors import UserError


class SdkCompiler:
    """``qaic``: compile each program with the SDK compiler."""

    name = QAIC
    #: Builds on the host (onnxruntime verification) instead of calling a compiler.
    verifies_on_host = False
    #: The graphs' outputs are needed before the build (the host run reads them).
    outputs_required = False

    def resolve_sdk(
        self, detect: Callable[[], Any], find: Callable[[], Any], dry_run: bool
    ) -> tuple[Any, Any]:
        """(SDK info, compiler path); a missing compiler is an error unless dry-running.

        Args:
            detect: Finds the installed SDK (None when absent).
            find: Finds the compiler binary, raising when there is none.
            dry_run: Nothing will be compiled (the compiler may be absent).

        Raises:
            UserError: No compiler found (the message names every path tried).
        """
        sdk = detect()
        if dry_run:
            return sdk, sdk.compiler if sdk and sdk.compiler else None
        return sdk, find()


class HostVerify:
    """``onnxruntime``: no SDK; every specialization runs once on the host."""

    name = ONNXRUNTIME
    verifies_on_host = True
    outputs_required = True

    def resolve_sdk(
        self, detect: Callable[[], Any], find: Callable[[], Any], dry_run: bool
    ) -> tuple[Any, Any]:
        """(None, None): nothing of the SDK is used."""
        return None, None


SDK_COMPILER = SdkCompiler()
HOST_VERIFY = HostVerify()
COMPILE_BACKENDS = {backend.name: backend for backend in (SDK_COMPILER, HOST_VERIFY)}


def compile_backend(name: str) -> SdkCompiler | HostVerify:
    """The object of ``compile --backend NAME``.

    Raises:
        UserError: An unknown name.
    """
    if name not in COMPILE_BACKENDS:
        raise UserError(f"unknown backend {name!r}; expected {QAIC} or {ONNXRUNTIME}")
    return COMPILE_BACKENDS[name]
