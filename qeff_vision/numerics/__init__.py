"""Device numerics, and the graph every onnxruntime session loads.

The fp16 emulation of a compiled program and its fp32 precision plan, and
:mod:`qeff_vision.numerics.ort_graph` beside ``session_for``.
"""
