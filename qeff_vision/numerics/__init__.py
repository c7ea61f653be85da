"""Device numerics: the fp16 emulation of a compiled program and its fp32 precision plan."""
