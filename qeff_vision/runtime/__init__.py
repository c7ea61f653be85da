"""Chunk-aware runtime: the chunk planner, the per-image embedding cache, sessions, generation.

Import what you use from its module (``qeff_vision.runtime.planner``, ``.embedding_cache``,
``.artifacts``, ...): the package itself imports nothing, so importing one pure module (the
planner, the cache: numpy only) does not load onnxruntime or torch.
"""
