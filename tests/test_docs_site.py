"""The README front door and the documentation site (issue 55).

- README.md stays a front door: at most 250 lines, the two commands, and a quickstart whose
  commands run as written (parsed out of the README, so the test and the README cannot drift):
  the tiny block in a temporary directory, then the Hub-id block against a Hugging Face cache on
  disk (``tests/hub_cache.py``, offline) holding the tiny checkpoint under that id.
- The README's family table is the registry's (``tools/docs_site/families.py``): a registered
  family without a row, or a row that no longer matches its declarations, fails here.
- ``mkdocs build --strict`` builds the site (no broken link, every page in the nav), into a
  temporary directory; every registered family has its page and every spec key the schema accepts
  appears on the spec-key page, checked against the registries.

Cost: the quickstart compiles two tiny checkpoints with ``--backend onnxruntime`` (about 40 s
each on 2 cores); the site build about 20 s.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_cache import add_snapshot, commit_id
from tools.docs_site import families as family_docs
from tools.docs_site import spec_keys

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def test_readme_is_a_front_door():
    text = readme()
    assert len(text.splitlines()) <= 250
    commands = bash_blocks(section(text, "Two commands"))
    assert commands and "make demo" in commands[0] and "make test" in commands[0]
    for heading in ("Install", "Quickstart", "Supported families", "Test tiers", "Documentation"):
        section(text, heading)


def test_readme_family_table_is_the_registry():
    text = readme()
    generated = family_docs.readme_table()
    assert family_docs.README_BEGIN in text and family_docs.README_END in text
    start = text.index(family_docs.README_BEGIN)
    current = text[start : text.index(family_docs.README_END) + len(family_docs.README_END)]
    assert current == generated, (
        "README's family table differs from the registry; regenerate it with "
        "`python -m tools.docs_site.readme`"
    )
    rows = [line for line in current.splitlines() if line.startswith("| [`")]
    assert [re.match(r"\| \[`(\w+)`\]", row).group(1) for row in rows] == family_docs.family_names()


def test_replace_readme_table_keeps_the_rest():
    text = f"intro\n{family_docs.README_BEGIN}\nold\n{family_docs.README_END}\noutro\n"
    replaced = family_docs.replace_readme_table(text, "NEW")
    assert replaced == "intro\nNEW\noutro\n"


def _run_block(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"README block failed ({done.returncode}):\n{block}\n{done.stderr[-3000:]}"
    return done


def test_readme_quickstart_runs_as_written(tmp_path):
    blocks = bash_blocks(section(readme(), "Quickstart"))
    assert len(blocks) == 2, "the quickstart is two bash blocks: the tiny checkpoint, then a Hub id"
    tiny, hub = blocks
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
    }
    done = _run_block(tiny, tmp_path, env)
    assert "compare-hf: tokens identical to transformers generate" in done.stderr
    assert (tmp_path / "out" / "manifest.json").is_file()

    # The Hub block names an id; the cache holds the tiny checkpoint under it (offline, no download).
    repo_id = re.search(r"model: ([\w.-]+/[\w.-]+)", hub).group(1)
    add_snapshot(Path(env["HF_HUB_CACHE"]), repo_id, tmp_path / "tiny-qwen", commit_id(repo_id))
    shutil.rmtree(tmp_path / "tiny-qwen")  # the Hub run must not find the directory instead
    done = _run_block(hub, tmp_path, env)
    assert "prompt" in done.stderr and "prefill chunk" in done.stderr
    manifest = (tmp_path / "out-3b" / "manifest.json").read_text()
    assert repo_id in manifest and commit_id(repo_id) in manifest


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return site


def _page(site: Path, uri: str) -> str:
    return html.unescape((site / uri / "index.html").read_text(encoding="utf-8"))


def test_every_family_has_a_page(built_site):
    index = _page(built_site, "families")
    for family in family_docs.all_families():
        page = _page(built_site, f"families/{family.name}")
        assert family.title in page and family.name in page
        for architecture in family.architectures:
            assert architecture in page
        for feature, support in family.features.rows():
            assert feature in page and (support.note or "") in page
        assert f"{family.name}/" in index  # linked from the index
    pages = {path.name for path in (built_site / "families").iterdir() if path.is_dir()}
    assert pages == set(family_docs.family_names())


def test_every_spec_key_is_documented(built_site):
    page = _page(built_site, "guide/spec-keys")
    keys = [key.path for key in spec_keys.spec_keys()]
    missing = [key for key in keys if f"<code>{key}</code>" not in page]
    assert not missing, f"spec keys missing from the built site: {missing}"
    # Against the schema itself: every top-level, prefill, vision and compile key.
    from qeff_vision.spec import compile_options, schema

    expected = {*schema.TOP_KEYS, *(f"vision.{key}" for key in schema.VISION_KEYS)}
    expected |= {f"prefill.{key}" for key in schema.PREFILL_KEYS}
    expected |= {f"compile.{key}" for key in compile_options.PROGRAM_KEYS}
    assert expected <= set(keys)


def test_an_undocumented_spec_key_stops_the_build(monkeypatch):
    monkeypatch.setattr(spec_keys.schema, "TOP_KEYS", (*spec_keys.schema.TOP_KEYS, "brand_new_key"))
    with pytest.raises(spec_keys.MissingDescription, match="brand_new_key"):
        spec_keys.spec_keys()


def test_decisions_are_one_page_each(built_site):
    pages = sorted(p for p in (REPO / "docs" / "decisions").glob("*.md") if p.name != "index.md")
    assert len(pages) >= 30
    for path in pages:
        assert re.match(r"\d{3}-[a-z0-9-]+\.md$", path.name)
        assert path.read_text(encoding="utf-8").startswith("# ")
        assert (built_site / "decisions" / path.stem / "index.html").is_file()
