"""A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, plus special tokens.

It tokenizes any text offline, round-trips exactly, and keeps the vocabulary small (256 byte
tokens + the family's specials), which is what a few-MB test checkpoint needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def build_byte_tokenizer(
    special_tokens: Sequence[str],
    *,
    chat_template: str,
    bos_token: str | None,
    eos_token: str,
    pad_token: str,
    extra_attributes: dict[str, str] | None = None,
):
    """Build a ``PreTrainedTokenizerFast``-compatible tokenizer.

    Args:
        special_tokens: Family special tokens, in id order after the 256 byte tokens.
        chat_template: Jinja chat template stored with the tokenizer.
        bos_token: Beginning-of-sequence token, or None.
        eos_token: End-of-sequence token.
        pad_token: Padding token.
        extra_attributes: Named special tokens (e.g. ``{"image_token": "<|image_pad|>"}``).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` ready for ``save_pretrained``.
    """
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # Register specials first so their ids follow the declared order (256, 257, ...).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in special_tokens if t not in {bos_token, eos_token, pad_token}],
        extra_special_tokens=extra_attributes or {},
    )
    tokenizer.chat_template = chat_template
    return tokenizer
