"""benchmarks/export_memory.py: export peak RSS per weight byte, stage timings and parity.

The fast tier runs it on the tiny checkpoint (float16 only; a tiny model's RSS is the interpreter,
so only the parity and the stages are checked). The full Qwen2.5-VL-3B config (3.75 B random
parameters, ~15 GB of disk, tens of minutes on two cores) is ``slow``: it checks the <= 1.3x target.
"""

from __future__ import annotations

import pytest

from tests import helpers

STAGES = {"load", "patch", "trace_vision", "trace_language", "write_vision", "write_lang", "check"}


def test_tiny_float16_export_reports_stages_and_parity(tmp_path):
    benchmark = helpers.load_benchmark("export_memory")
    writer, rows = benchmark.measure("tiny", ["float16"], tmp_path)
    (row,) = rows
    assert row["weight_bytes"] == 2 * writer["weight_params"] > 0
    assert set(row["timings"]) == STAGES and row["peak_rss"] > 0
    assert row["parity"]["top1_same"] and row["parity"]["relative"] < 1e-2
    assert "RSS/weights" in benchmark.table(rows)


@pytest.mark.slow
def test_full_qwen2_5_vl_3b_exports_within_1_3x_of_its_weights(tmp_path):
    writer, rows = helpers.load_benchmark("export_memory").measure(
        "qwen2_5_vl-3b-full", ["float32", "float16"], tmp_path
    )
    assert writer["weight_params"] > 3.7e9
    for row in rows:
        assert row["peak_rss"] <= 1.3 * row["weight_bytes"], row
        assert row["parity"]["top1_same"], row
