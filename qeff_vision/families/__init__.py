"""Family registry: the only place that maps a checkpoint to the code that knows its family.

Each subpackage of ``qeff_vision.families`` defines one family and registers it with
:func:`register`. Subpackages are discovered by walking this package, so adding a family adds
files and edits nothing here. Registration checks the description at import time.
"""

from __future__ import annotations

import importlib
import pkgutil

from qeff_vision.errors import UserError
from qeff_vision.families.base import Family, ImageSize, ModelDescription, describe_checkpoint

__all__ = [
    "Family",
    "ImageSize",
    "ModelDescription",
    "all_families",
    "describe_checkpoint",
    "family_for",
    "get_family",
    "register",
]

_REGISTRY: dict[str, Family] = {}
_DISCOVERED = False


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: check a family description and add it to the registry."""
    family = cls()
    problems = []
    if not family.name or not family.name.isidentifier():
        problems.append("name must be a Python identifier")
    if family.name in _REGISTRY:
        problems.append("name already registered")
    if not family.architectures:
        problems.append("architectures is empty")
    if not family.export_module:
        problems.append("export_module is not set")
    if not getattr(family, "features", None):
        problems.append("features are not declared")
    else:
        problems += [
            f"feature {feat!r} is unsupported without a reason"
            for feat, s in family.features.rows()
            if not s.supported and not s.note
        ]
    if not family.vision_input_axes:
        problems.append("vision_input_axes is empty")
    if problems:
        raise TypeError(f"family {cls.__name__}: " + "; ".join(problems))
    _REGISTRY[family.name] = family
    return cls


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.ispkg:
            importlib.import_module(f"{__name__}.{module.name}")
    _DISCOVERED = True


def all_families() -> list[Family]:
    """Every registered family, sorted by name."""
    _discover()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def get_family(name: str) -> Family:
    """The family registered under ``name``; a user error naming the known ones otherwise."""
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UserError(f"unknown family {name!r}; supported families: {known}") from None


def family_for(model: ModelDescription) -> Family:
    """The family that accepts ``model``'s architecture or model type."""
    _discover()
    for family in _REGISTRY.values():
        if set(model.architectures) & set(family.architectures) or model.model_type in family.model_types:
            return family
    arch = ", ".join(model.architectures) or model.model_type or "unknown"
    supported = ", ".join(f"{f.name} ({', '.join(f.architectures)})" for f in all_families())
    raise UserError(f"{model.source}: architecture {arch} is not supported; supported families: {supported}")
