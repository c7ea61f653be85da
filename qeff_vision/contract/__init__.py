"""The language/vision contract as pure data: IO tables, decoder kinds, segments and symbols.

Torch-free; imports nothing of ours but ``symbols`` and ``errors`` (the bottom layer, see
docs/design.md "Layers").
"""
