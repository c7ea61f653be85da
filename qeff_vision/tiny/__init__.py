"""Tiny random-weight checkpoints, saved exactly like real ones (config, safetensors, tokenizer, processor).

Each family package has a ``tiny`` module with ``write_tiny_checkpoint(out_dir, seed)``; this
package holds the family-agnostic pieces: a byte-level tokenizer with a family's special tokens
and chat template.
"""

from __future__ import annotations

from qeff_vision.tiny.tokenizer import build_byte_tokenizer

__all__ = ["build_byte_tokenizer"]
