"""Smoke test of benchmarks/batched_decode.py on the session's continuous-batching export (tiny, 2 sizes)."""

from __future__ import annotations

from tests import helpers


def test_benchmark_prints_the_table_verdict_and_plot(cb_exported, tmp_path, capsys):
    benchmark = helpers.load_benchmark("batched_decode")
    plot = tmp_path / "plot.png"
    argv = ["--export", str(cb_exported("qwen2_5_vl")), "--work", str(tmp_path), "--plot", str(plot)]
    code = benchmark.main([*argv, "--full-batch-sizes", "1", "2", "--new-tokens", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "decode tok/s" in out and "vision B/decode step" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("batched")]
    assert [row[1] for row in rows] == ["1", "2"]
    # Every request decodes 3 tokens after its first; F = 2 needs fewer calls than tokens decoded.
    assert int(rows[1][2]) < 2 * 3
    assert "target not evaluated" in out
    assert plot.is_file() and plot.stat().st_size > 0
