"""Real-width tier (marker ``realwidth``): every family's largest intermediate under 256 MiB (issue 54).

Each family's smallest pinned config at its real widths, depth cut (the largest intermediate does
not depend on depth: every layer of a kind has the same shapes), exported with the default
attention-blocking policy; measured on the graphs (fp16 device bytes,
``qeff_vision.compile.activation_memory``): the vision program at a 1920x1080 and a 2560x1440 image
as the family's processor sizes them, and the language program at seq_len 512 / ctx_len 32768.
The measuring code is benchmarks/activation_memory.py's, which prints the same figures before and
after blocking (docs/benchmarks/activation-memory.md).
"""

from __future__ import annotations

import pytest

from qeff_vision.compile.activation_memory import describe, graph_activation_memory
from qeff_vision.contract.attention_blocking import DEFAULT_BOUND, AttentionBlocking
from qeff_vision.families import all_families
from tests import helpers

pytestmark = pytest.mark.realwidth

IMAGES = ((1080, 1920), (1440, 2560))
LANGUAGE = {"batch_size": 1, "seq_len": 512, "ctx_len": 32768, "vision_size": 512, "vision_batch_size": 1}


@pytest.mark.parametrize("family", [family.name for family in all_families()])
def test_largest_intermediate_within_the_bound_at_high_resolution(family, tmp_path):
    bench = helpers.load_benchmark("activation_memory")
    checkpoint = bench._checkpoint(family, tmp_path, smoke=False)
    export = bench._export(checkpoint, tmp_path / "export", AttentionBlocking())
    graph = export / "vision" / "model.onnx"
    measured = 0
    for height, width in IMAGES:
        feeds = bench._vision_feeds(family, checkpoint, height, width)
        if feeds is None:  # the family does not take this size
            continue
        figures = graph_activation_memory(graph, bench._bound_symbols(graph, feeds))
        print(f"{family} vision {width}x{height}: {describe(figures)}")  # shown with -s (the tier's log)
        assert figures.unresolved == 0, (height, width)
        assert figures.largest_bytes <= DEFAULT_BOUND, (height, width, figures)
        measured += 1
    assert measured, "no image size measured"
    values = {**LANGUAGE, **bench._language_extras(family, checkpoint, LANGUAGE["ctx_len"])}
    figures = graph_activation_memory(export / "lang" / "model.onnx", values)
    print(f"{family} lang S512/ctx32768: {describe(figures)}")
    assert figures.unresolved == 0 and figures.largest_bytes <= DEFAULT_BOUND, figures
