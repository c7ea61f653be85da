"""Stand-in for the one QEfficient module the vllm-qaic plugin imports on its serving path.

The plugin's Qwen processor (``qaic_custom_mm_processor.py``) imports
``QEfficient.utils.constants`` for default resolutions before it reads the ``height``/``width`` it
is given; the tier always gives them, so only the names must exist. QEfficient itself pins a torch
that vLLM 0.23 cannot share a venv with.
"""
