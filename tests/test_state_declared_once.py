"""Per-layer state is declared one way: the state kind classes (issue 51, part 3).

A family returns one :class:`~qeff_vision.contract.states.LayerState` per layer; generic code asks
the instance or its class (``KINDS``) and never compares a kind, or the ``layer_types`` string a
kind stands for, by its spelling. The spellings the contract still converts for tests and tools
(bare slot symbols, ``recurrent_layers=``, :data:`~qeff_vision.contract.language_io.LayerCache`)
are converted in :mod:`qeff_vision.contract.language_io` alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qeff_vision.contract.states import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    KINDS,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    ChunkedRing,
    SlidingRing,
    kind_for_layer_type,
)
from qeff_vision.export.decoder import attention_masks
from qeff_vision.export.ring_plan import overlay_span, span_overlay
from qeff_vision.families import all_families

PACKAGE = Path(__file__).resolve().parents[1] / "qeff_vision"
# Where a kind's spelling may be matched: the kinds themselves and the one conversion of shorthands.
OWNERS = {Path("contract/states"), Path("contract/language_io.py")}
TYPE_NAMES = r"(FULL_ATTENTION|SLIDING_ATTENTION|CHUNKED_ATTENTION|LINEAR_ATTENTION|RECURRENT)"
KIND_NAMES = r"(FULL_CACHE|RING_CACHE|SHARED_CACHE|RECURRENT_CACHE)"
FORBIDDEN = [
    re.compile(rf"(==|!=)\s*{TYPE_NAMES}\b"),
    re.compile(rf"\b{TYPE_NAMES}\s*(==|!=)"),
    re.compile(rf"(==|!=|\bin)\s*{KIND_NAMES}\b"),
    re.compile(r"\b(state|source|cache)\w*\.kind\s*(==|!=)"),
    re.compile(r"\brecurrent_layers\s*="),
    re.compile(r"\b(LayerCache|declared_state)\("),
    re.compile(
        r"""(==|!=)\s*["'](full_attention|sliding_attention|chunked_attention|linear_attention)["']"""
    ),
]


def _generic_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "families" and len(relative.parts) > 2:
            continue  # a family's own package reads its own config's layer types
        if any(relative == owner or owner in relative.parents for owner in OWNERS):
            continue
        yield relative, path.read_text()


def test_no_generic_module_compares_a_kind_by_its_spelling():
    found = [
        f"{relative}:{number}: {line.strip()}"
        for relative, text in _generic_files()
        for number, line in enumerate(text.splitlines(), 1)
        if any(pattern.search(line) for pattern in FORBIDDEN)
    ]
    assert found == []


def test_every_layer_type_maps_to_its_kind():
    assert kind_for_layer_type(SLIDING_ATTENTION) is SlidingRing
    assert kind_for_layer_type(CHUNKED_ATTENTION) is ChunkedRing
    assert kind_for_layer_type(FULL_ATTENTION).layer_type == FULL_ATTENTION
    assert kind_for_layer_type(LINEAR_ATTENTION).layer_type == LINEAR_ATTENTION
    assert kind_for_layer_type("no_such_attention") is None
    assert all(kind_for_layer_type(kind.layer_type) is kind for kind in KINDS if kind.layer_type)


def test_ring_spans_come_from_the_kind():
    parts = {"sliding_window": 4, "attention_chunk_size": 8}
    assert overlay_span(SLIDING_ATTENTION, parts) == 4
    assert overlay_span(CHUNKED_ATTENTION, parts) == 8
    assert overlay_span(FULL_ATTENTION, parts) is None
    keys = torch.arange(12).view(1, 1, -1)
    query = torch.tensor([[[9]]])
    assert span_overlay(FULL_ATTENTION, keys, query, 4) is None
    assert span_overlay(SLIDING_ATTENTION, keys, query, None) is None
    window = span_overlay(SLIDING_ATTENTION, keys, query, 4)[0, 0].tolist()
    assert window == [k > 5 for k in range(12)]
    block = span_overlay(CHUNKED_ATTENTION, keys, query, 4)[0, 0].tolist()
    assert block == [k // 4 == 2 for k in range(12)]


def test_masks_per_layer_type_follow_the_kinds():
    """A window layer kept full length sees the window; a chunked one its block; full the past."""
    positions = torch.tensor([[6, 7, -1]])
    masks = attention_masks(
        positions,
        10,
        [FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION],
        3,
        None,
        torch.float32,
        attention_chunk_size=4,
    )
    seen = {t: (m[0, 0, 1] == 0).nonzero().view(-1).tolist() for t, m in masks.items()}
    assert seen == {
        FULL_ATTENTION: list(range(8)),
        SLIDING_ATTENTION: [5, 6, 7],
        CHUNKED_ATTENTION: [4, 5, 6, 7],
    }
    assert not (masks[FULL_ATTENTION][0, 0, 2] == 0).any()  # padding sees nothing


@pytest.mark.parametrize("family", all_families(), ids=lambda f: f.name)
def test_every_family_declares_states_as_instances(family):
    """Every pinned config of every family: one registered kind's instance per layer, no bare symbol."""
    from qeff_vision.families import describe_checkpoint
    from qeff_vision.real_width import pinned_configs

    paths = pinned_configs(family.name)
    assert paths, family.name
    for path in paths:
        model = describe_checkpoint(path.parent, path)
        states = family.layer_caches(model)
        assert len(states) == family.text_dims(model).num_layers, path
        assert all(isinstance(state, KINDS) for state in states), path
