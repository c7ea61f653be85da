"""Smoke test of benchmarks/chunked_vision.py on a tiny configuration (the full benchmark is not run)."""

from __future__ import annotations

from tests import helpers


def test_benchmark_runs_a_tiny_configuration(exported, tmp_path, capsys):
    benchmark = helpers.load_benchmark("chunked_vision")
    plot = tmp_path / "plot.png"
    code = benchmark.main(
        [
            "--export",
            str(exported("qwen2_5_vl")),
            "--work",
            str(tmp_path),
            "--images",
            "224x224",
            "--seq-lens",
            "32",
            "--turns",
            "2",
            "--repeats",
            "1",
            "--plot",
            str(plot),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert plot.is_file() and plot.read_bytes().startswith(b"\x89PNG")
    assert "SYNTHETIC" in out
    # 64 image rows at S = 32: chunk sends V = 32 rows per chunk, full all 64.
    assert "224x224 (64 tokens), S=32: full sends 2.0x the bytes per chunk" in out
    assert "encoder runs once per distinct image with the cache: 2 encodings for 2 images, yes" in out
