"""Helpers the benchmark scripts share.

Not benchmarks themselves: tests/test_benchmarks_smoke.py lists only ``benchmarks/*.py``.
"""
