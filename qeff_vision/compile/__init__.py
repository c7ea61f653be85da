"""Compile stage: typed compiler options, SDK discovery, compiler argv, runner, cache and manifest.

Only :mod:`qeff_vision.compile.options` and :mod:`qeff_vision.compile.sdk` are imported by other
stages (the spec loader validates ``compile:`` with them); nothing here imports torch.
"""
