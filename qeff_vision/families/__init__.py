"""Family registry: the only place that maps a checkpoint to the code that knows its family.

Each subpackage of ``qeff_vision.families`` defines one family and registers it with
:func:`register`, handing over every part of the family as an object: the description (a
:class:`Family` subclass), the host protocol class, a loader of the torch-side export adapter and
the tiny-checkpoint builder. Subpackages are discovered by walking this package, so adding a
family adds files and edits nothing here. Registration checks every part at import time.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from qeff_vision.contract.tasks import GENERATE, TASKS
from qeff_vision.errors import UserError
from qeff_vision.families.base import Family, FamilyParts, ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.families.host import Host

__all__ = [
    "Family",
    "FamilyParts",
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


def register(
    cls: type[Family],
    *,
    host: Callable[[], type[Host]],
    adapter: Callable[[], type],
    tiny: Callable[..., object],
) -> type[Family]:
    """Check a family and every part of it, and add it to the registry.

    Args:
        cls: The description (token math, IO rows, features); torch-free.
        host: Zero-argument loader of the family's :class:`~qeff_vision.families.host.Host`
            subclass (numpy only). Called here, so a missing or wrong host fails at import.
        adapter: Zero-argument loader of the family's export adapter class (an
            :class:`~qeff_vision.export.adapter.ExportAdapter` subclass taking the family). It
            imports torch, so it is called only when a graph is built.
        tiny: ``tiny(out_dir, seed=0) -> Path``: writes the family's tiny random checkpoint.

    Raises:
        TypeError: A part is missing or of the wrong kind, or the description is incomplete.
    """
    family = cls()
    problems = []
    if not family.name or not family.name.isidentifier():
        problems.append("name must be a Python identifier")
    if family.name in _REGISTRY:
        problems.append("name already registered")
    if not family.architectures:
        problems.append("architectures is empty")
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
    if GENERATE not in family.tasks or not set(family.tasks) <= set(TASKS):
        problems.append(f"tasks must include {GENERATE} and name only {', '.join(TASKS)}")
    host_class = host() if callable(host) else None
    if not (isinstance(host_class, type) and issubclass(host_class, Host)):
        problems.append("host must be a loader returning a Host subclass")
    if not callable(adapter):
        problems.append("adapter must be a loader of the export adapter class")
    if not callable(tiny):
        problems.append("tiny must be the tiny-checkpoint builder")
    if problems:
        raise TypeError(f"family {cls.__name__}: " + "; ".join(problems))
    # On the class: a subclass made for a test or an experiment inherits its family's parts.
    cls.parts = FamilyParts(host=host_class, adapter=adapter, tiny=tiny)
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
