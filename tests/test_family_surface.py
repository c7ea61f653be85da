"""A family is a small declaration: count the callables each family overrides (issue 51).

The surface of a family is every callable its own classes define over a generic base member (the
description's :class:`~qeff_vision.families.base.Family`, the host's
:class:`~qeff_vision.families.host.Host`, the export adapter's
:class:`~qeff_vision.export.adapter.ExportAdapter`, a :class:`~qeff_vision.families.base.PatchBuckets`
subclass) plus the duck-typed methods of the optional capabilities, counted over the whole MRO (a
callable inherited from another family's package counts as this family's too). Callables a listed or
declared capability brings (:func:`~qeff_vision.families.layout.declared_capabilities`) are booked to
that capability; the rest is the family's core, which stays within :data:`CORE_LIMIT`.
docs/guide/family-declaration.md shows the figures.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from qeff_vision.families import all_families
from qeff_vision.families.layout import DECLARED_CAPABILITY_CALLABLES, declared_capabilities

PACKAGE = Path(__file__).resolve().parents[1] / "qeff_vision"
#: The most callables a family's core overrides (issue 51's target).
CORE_LIMIT = 15
#: Families still over the limit, with the ceiling they may not exceed. A family that falls within
#: the limit must leave this table (Gemma 4 left it at 15: its per-layer shapes ride on its states,
#: its forced last full layer is ``last_layer_type``). Empty: every family is within the limit.
OVER_LIMIT: dict[str, int] = {}
#: Duck-typed capability methods (no generic base declares them): counted when a family defines them.
DUCK_TYPED = set(DECLARED_CAPABILITY_CALLABLES["patch_buckets"])


def _family_owned(cls: type) -> bool:
    """A class of a family's own package (``qeff_vision.families.<family>.*``)."""
    parts = cls.__module__.split(".")
    return (
        parts[:2] == ["qeff_vision", "families"]
        and len(parts) > 2
        and (PACKAGE / "families" / parts[2]).is_dir()
    )


def _callable(value) -> bool:
    if isinstance(value, type):
        return False  # a class-valued attribute (a capability's class) is data
    return isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value)


def overridden(cls: type | None) -> set[str]:
    """Names of the callables ``cls``'s family-owned classes define over a generic member (or duck-typed)."""
    if cls is None:
        return set()
    generic = [c for c in cls.__mro__ if not _family_owned(c) and c is not object]
    names = set()
    for owned in (c for c in cls.__mro__ if _family_owned(c)):
        for name, value in vars(owned).items():
            if name.startswith("__") or not _callable(value):
                continue
            if name in DUCK_TYPED or any(name in vars(base) for base in generic):
                names.add(name)
    return names


def surface(family) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(core, capabilities): part -> overridden names, capability -> the names booked to it."""
    parts = {
        "description": overridden(type(family)),
        "host": overridden(family.parts.host),
        "adapter": overridden(family.parts.adapter()),
        "patch_buckets": overridden(family.patch_bucket_capability),
    }
    booked: dict[str, set[str]] = {}
    for capability, names in declared_capabilities(family).items():
        booked[capability] = {name for part in parts.values() for name in part if name in names}
    taken = set().union(*booked.values()) if booked else set()
    core = {part: names - taken for part, names in parts.items()}
    return core, booked


FAMILIES = all_families()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_family_core_overrides_at_most_15_callables(family):
    core, booked = surface(family)
    count = sum(len(names) for names in core.values())
    limit = OVER_LIMIT.get(family.name, CORE_LIMIT)
    assert count <= limit, (family.name, count, {k: sorted(v) for k, v in core.items()})
    if family.name in OVER_LIMIT:
        assert count > CORE_LIMIT, f"{family.name} is within {CORE_LIMIT}: drop it from OVER_LIMIT"
    # Every booked callable belongs to a capability the family really declares.
    for capability, names in booked.items():
        assert names <= set(declared_capabilities(family)[capability]), capability


def test_undeclared_capability_callables_count_as_core():
    """A capability's callables overridden without declaring it are not booked away (the count is honest)."""
    for family in FAMILIES:
        core, booked = surface(family)
        declared = declared_capabilities(family)
        for names in core.values():
            for name in names:
                assert not any(name in owns for owns in declared.values()), (family.name, name)


# Layout flags that were attributes of Family, branched on in generic code before issue 51: each is
# now a capability (qeff_vision/families/layout.py) that only its owner module reads.
RETIRED_FLAGS = ("joins_images", "placeholders_in_runs", "tokens_between_images", "single_encode_axis")
FLAG_READ = re.compile(r"\bfamily\.(" + "|".join(RETIRED_FLAGS) + r")\b")


def _generic_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "families" and len(relative.parts) > 2:
            continue  # a family's own package may read its own declarations
        yield relative, path.read_text()


def test_no_generic_module_branches_on_a_layout_flag():
    found = [
        f"{relative}:{number}"
        for relative, text in _generic_modules()
        for number, line in enumerate(text.splitlines(), 1)
        if FLAG_READ.search(line)
    ]
    assert found == []


def test_no_family_sets_a_retired_flag():
    """Families list capabilities; the former attribute names are read-only views on Family."""
    for family in FAMILIES:
        for cls in type(family).__mro__:
            if _family_owned(cls):
                assert not set(vars(cls)) & set(RETIRED_FLAGS), (family.name, cls.__name__)
