"""Typed config views: a missing required field is one line naming it; defaults are stated once, noted."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from qeff_vision.cli import main
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import ModelDescription

ROOT = Path(__file__).resolve().parents[1]
FAMILIES_DIR = ROOT / "qeff_vision" / "families"

# One required field per family (a dotted path into config.json): transformers always writes it
# and the family cannot guess it.
REQUIRED = {
    "gemma3": "vision_config.image_size",
    "gemma4": "text_config.hidden_size",
    "glm4v": "image_token_id",
    "internvl": "image_token_id",
    "kimi_k25": "text_config.kv_lora_rank",
    "llama4": "vision_config.image_size",
    "llava": "image_token_index",
    "llava_next": "image_token_index",
    "mistral3": "image_token_index",
    "mllama": "text_config.cross_attention_layers",
    "molmo2": "image_col_id",
    "qwen2_5_vl": "video_token_id",
    "qwen3_5": "video_token_id",
    "qwen3_5_moe": "video_token_id",
    "qwen3_vl": "video_token_id",
    "qwen3_vl_moe": "video_token_id",
}


def test_every_family_names_a_required_field():
    assert sorted(REQUIRED) == [family.name for family in all_families()]


def _without(config: dict, dotted: str) -> dict:
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        node = node[key]
    del node[leaf]
    return config


@pytest.mark.parametrize("family", sorted(REQUIRED))
def test_a_missing_required_field_is_one_line_naming_it(family, tiny_checkpoint, tmp_path, capsys):
    source = tiny_checkpoint(family)
    model = tmp_path / "model"
    model.mkdir()
    for name in source.glob("*.json"):  # configs only: the token math needs no weights
        shutil.copy(name, model / name.name)
    config = model / "config.json"
    config.write_text(json.dumps(_without(json.loads(config.read_text()), REQUIRED[family])))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: t\nmodel: tiny\nconfig: {config}\nfamily: {family}\nctx_len: 4096\n"
        "prefill:\n  seq_lens: [128]\nvision:\n  images:\n    - {height: 336, width: 336}\n"
    )
    out = tmp_path / "out"
    assert main(["specialize", str(spec), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"config lacks required field '{REQUIRED[family]}'" in err and str(config) in err, err
    assert not out.exists()


def test_a_default_is_one_value_reported_as_a_note():
    # Mistral 3's description and host both read the token side from the one view: a config
    # without patch_size gets PixtralVisionConfig's 16 in both, and the note says so.
    family = get_family("mistral3")
    model = ModelDescription({"vision_config": {}, "image_token_index": 10}, source="cfg.json")
    assert family.token_side(model) == 16 * 2
    notes = family.config_view(ModelDescription({**model.config, "text_config": _TEXT})).notes
    assert any(note.startswith("vision_config.patch_size not set; using 16") for note in notes)


_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}


def test_validate_prints_the_defaults_a_pinned_config_relies_on(capsys):
    spec = ROOT / "specs" / "gemma3" / "gemma-3-4b-it.yaml"
    assert main(["validate", str(spec)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{spec}: ok\n")  # then its attention figures
    assert f"{spec}: note: text_config.vocab_size not set; using 262208" in captured.err


def test_no_raw_config_reads_with_defaults_outside_the_views():
    """``x.get(key, default)`` appears under families/ only in the typed views' module."""
    offenders = []
    for path in sorted(FAMILIES_DIR.rglob("*.py")):
        if path.name == "config_view.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and len(node.args) == 2
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_no_dotted_module_strings_or_name_lookups_under_families():
    registry = FAMILIES_DIR / "__init__.py"  # walks the package to discover families
    for path in sorted(FAMILIES_DIR.rglob("*.py")):
        text = path.read_text()
        calls = {
            node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call)
        }
        assert "get_family" not in calls, path
        assert "export_module" not in text and "host_module" not in text, path
        assert "import_module" not in calls or path == registry, path
