"""Compile stage: SDK discovery, compiler argv, runner, cache, the vLLM hand-off and the golden check.

Above spec/ and runtime/ in the layering (docs/design.md "Layers"): it compiles a loaded spec and
runs the runtime for calibration; the typed compile options live in
:mod:`qeff_vision.spec.compile_options` (the ``compile:`` section of a spec) and the manifest
format in :mod:`qeff_vision.compile_record`. Nothing here imports torch.
"""
