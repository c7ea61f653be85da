"""The quantization config's own rules: which modules are quantized, and one-line refusals."""

from __future__ import annotations

import re
from collections.abc import Iterable

from qeff_vision.errors import UserError


def not_converted(module: str, patterns: Iterable[str] | None) -> bool:
    """Whether ``module`` is in a ``modules_to_not_convert`` list (transformers' matching rule).

    A pattern matches from the start up to a module boundary, as a regular expression with the
    same boundary, or as a suffix (ref: transformers v5 quantizers/quantizers_utils.py
    ``should_convert_module``).
    """
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(
        re.match(rf"(?:{pattern}){boundary}", module) or module.endswith(pattern)
        for pattern in patterns or ()
    )


def targeted(module: str, targets: Iterable[str]) -> bool:
    """Whether a compressed-tensors ``targets`` / ``ignore`` list names ``module``.

    ``re:`` entries are regular expressions matched from the start of the module name; other
    entries are a module name or a class name (ref: compressed-tensors utils/match.py
    ``is_match``). Only linear layers are stored quantized, so a class name (``Linear``) names
    every quantized module; a dotted name must be the module itself.
    """
    for target in targets or ():
        if target.startswith("re:"):
            if re.match(target[3:], module):
                return True
        elif target == module or ("." not in target and target[:1].isupper()):
            return True
    return False


def refuse(model_dir, scheme: str, tensor: str, why: str = "") -> UserError:
    """The one-line error for a scheme export does not read, naming the first tensor stored in it."""
    detail = f" ({why})" if why else ""
    return UserError(
        f"{model_dir}: unsupported quantization scheme {scheme}{detail}, first stored in {tensor!r}; "
        "export a dequantized (bf16) copy of the checkpoint"
    )
