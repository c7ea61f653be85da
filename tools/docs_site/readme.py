"""Regenerate the README's family table from the registry: ``python -m tools.docs_site.readme``.

``--check`` exits 1 when the README differs (``tests/test_docs_site.py`` checks the same).
"""

from __future__ import annotations

import sys

from tools.docs_site.families import REPO, readme_table, replace_readme_table


def main(argv: list[str]) -> int:
    """Write (or with ``--check``, compare) the README's generated family table."""
    path = REPO / "README.md"
    text = path.read_text(encoding="utf-8")
    updated = replace_readme_table(text, readme_table())
    if "--check" in argv:
        if updated != text:
            print("README.md: the family table differs from the registry", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
