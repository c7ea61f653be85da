"""Device numerics: the fp16 emulation of a compiled program and its fp32 precision plan, and the
graph every onnxruntime session loads (:mod:`qeff_vision.numerics.ort_graph`, beside ``session_for``)."""
