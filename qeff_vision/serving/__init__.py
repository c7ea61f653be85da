"""Clients for the ``vllm serve`` endpoints that ``compile --print-serve`` prints (torch-free)."""
