"""mkdocs hook (``mkdocs.yml``: ``hooks:``): the generated pages and the directory sections of the nav.

At build time it adds, without writing anything into ``docs/``:

- ``families/index.md`` and one ``families/<name>.md`` per registered family
  (:mod:`tools.docs_site.families`), listed under the nav's ``Families`` entry, so a registered
  family always has a page in the nav;
- ``guide/spec-keys.md``, every spec key (:mod:`tools.docs_site.spec_keys`).

A nav entry whose value is a directory (``Decisions: decisions/``) becomes that directory's
``index.md`` followed by its other pages in file-name order, titled by their first heading, so a
new decision or benchmark page joins the nav by being added.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `mkdocs build` from the repository root: the package and tools/
    sys.path.insert(0, str(REPO))

from mkdocs.structure.files import File  # noqa: E402

from tools.docs_site import families, spec_keys  # noqa: E402

FAMILIES_SECTION = "Families"


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _expand(entry, docs_dir: Path):
    """A nav entry with directory sections (``Title: dir/``) and the families section expanded."""
    if isinstance(entry, list):
        return [_expand(item, docs_dir) for item in entry]
    if not isinstance(entry, dict):
        return entry
    expanded = {}
    for title, value in entry.items():
        if title == FAMILIES_SECTION:
            value = ["families/index.md"] + [
                {f.title: f"families/{f.name}.md"} for f in families.all_families()
            ]
        elif isinstance(value, str) and value.endswith("/"):
            folder = docs_dir / value
            pages = sorted(p for p in folder.glob("*.md") if p.name != "index.md")
            value = ([f"{value}index.md"] if (folder / "index.md").exists() else []) + [
                {_title(p): f"{value}{p.name}"} for p in pages
            ]
        else:
            value = _expand(value, docs_dir)
        expanded[title] = value
    return expanded


def on_config(config):
    """Expand the nav's directory sections and the families section."""
    config["nav"] = _expand(config["nav"], Path(config["docs_dir"]))
    return config


def on_files(files, config):
    """Add the generated pages."""
    generated = {
        "families/index.md": families.families_index(),
        "guide/spec-keys.md": spec_keys.spec_keys_page(),
    }
    for family in families.all_families():
        generated[f"families/{family.name}.md"] = families.family_page(family)
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    return files
