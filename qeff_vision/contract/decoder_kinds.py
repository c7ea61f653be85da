"""Decoder kinds: how a family's language program sees images (pure data).

A kind is an object, not a string compared in generic code: the IO table asks it whether the
decoder merges vision rows, the runtime looks up the runner registered for it
(:data:`qeff_vision.runtime.generate.RUNNERS`), and a family's export adapter builds the decoder
module of its kind (``ExportAdapter.language_decoder``). A new kind is a new object here plus its
runner; no generic code compares names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderKind:
    """One way a decoder consumes images.

    Attributes:
        name: Shown by ``qeff-vision families``.
        merges_vision_rows: The vision program's rows replace placeholder embeddings in the token
            sequence (``vision_embeds`` / ``image_idx`` rows in the language IO table, a
            ``vision_size`` axis); otherwise images reach the decoder another way.
    """

    name: str
    merges_vision_rows: bool

    def __str__(self) -> str:
        return self.name


#: Token-merge: the vision program's rows replace the placeholder tokens' embeddings.
TOKEN_MERGE = DecoderKind("token-merge", merges_vision_rows=True)
#: Cross-attention: the vision program produces key/value states that dedicated cross-attention
#: layers read as retained state; a prompt holds one placeholder per image and no image rows.
CROSS_ATTENTION = DecoderKind("cross-attention", merges_vision_rows=False)
