"""Library API: the verbs of the CLI, for users' Python. Heavy imports happen inside each verb."""

from __future__ import annotations

from qeff_vision.families import all_families


def families_table() -> str:
    """A plain-text table of every family and its feature support."""
    rows = []
    for family in all_families():
        rows.append((f"{family.name} [{family.title}]", "architectures", ", ".join(family.architectures)))
        rows.extend(("", feature, support.cell()) for feature, support in family.features.rows())
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows)
