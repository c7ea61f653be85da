"""Does a spec fit the vLLM servers its printed forms target? Warnings for ``validate``.

The rules come from how each server feeds the language program (see
:mod:`qeff_vision.compile.vllm_handoff`):

* vLLM 0.23.0 + vllm-qaic sends every prefill chunk at one length S and pads the chunk's image
  rows to the ``vision_embeds`` binding of the program's first specialization (V0). A chunk of S
  tokens can carry min(S, M) image rows (M: the most image tokens of a request), so V0 must hold
  them, and S must be a compiled bucket with ``vision_size`` V0. Its scheduler cuts chunks at S
  tokens wherever images fall, so a family that keeps an image's tokens in one chunk (their
  attention is bidirectional) is served correctly only when no image crosses a chunk boundary.
* the guide's vLLM 0.8.5 fork sends a whole image's rows once and walks them with ``image_idx``:
  the ``vision_size`` of the bucket it prefills with (the largest) must hold every row of the
  largest image.
"""

from __future__ import annotations

from typing import Any

from qeff_vision import symbols
from qeff_vision.compile.vllm_handoff import FORK_VLLM, PLUGIN_VLLM, plugin_prefill
from qeff_vision.spec.policy import CHUNK


def serving_warnings(result: Any) -> list[str]:
    """Warnings for a spec's :class:`~qeff_vision.spec.specializations.ProgramSpecializations`.

    ``vision_size: chunk`` shapes the language program for the plugin; ``max`` or a fixed size for
    the fork. Each spec is checked against the server its policy targets. A spec with the
    on-device sampler is one the plugin cannot serve at all.
    """
    spec = result.spec
    sampler = []
    if spec.compile.language.sampler is not None:  # asserted by tests/vllm_tier
        sampler = [
            f"{PLUGIN_VLLM}: the plugin never feeds the on-device sampler's inputs (it samples on the "
            "host from logits), so it cannot serve this language program; qeff-vision run does"
        ]
    bf16 = []
    if spec.compile.hardware == "ai200":  # the same fact the plugin's printed forms open with
        bf16 = [
            f"{PLUGIN_VLLM}: its numpy session maps no bfloat16 IO type, so as pinned it does not bind "
            "these ai200 programs' bfloat16 pixel_values and vision_embeds; qeff-vision run does"
        ]
    return sampler + bf16 + _protocol_warnings(result)


def _protocol_warnings(result: Any) -> list[str]:
    """Warnings about how each server feeds image rows (see the module docstring)."""
    spec = result.spec
    language = [s.symbols for s in result.language.specializations]
    prefill = [s for s in language if int(s[symbols.SEQ_LEN]) > 1]
    if symbols.VISION_SIZE not in prefill[0]:
        return []  # cross-attention: no image rows ride in the prefill chunks
    # The policy says which server the spec is shaped for: chunk-sized rows are the plugin's
    # protocol, whole-image rows (max or a fixed size) the fork's.
    if spec.vision.vision_size.kind == CHUNK:
        return _plugin_warnings(spec, language, prefill, result.request_image_tokens)
    largest_seq = max(spec.prefill.seq_lens)
    largest_size = max(int(s[symbols.VISION_SIZE]) for s in prefill if int(s[symbols.SEQ_LEN]) == largest_seq)
    image_rows = max((image.tokens for image in result.images), default=0)
    if largest_size < image_rows:
        return [
            f"{FORK_VLLM}: the fork sends an image's {image_rows} rows at once, but bucket {largest_seq} "
            f"has vision_size {largest_size}; use vision_size: max (or a fixed size of at least {image_rows})"
        ]
    return []


def _plugin_warnings(spec, language, prefill, request_image_tokens) -> list[str]:
    from qeff_vision.families import get_family

    warnings = []
    first_seq, first_size = int(prefill[0][symbols.SEQ_LEN]), int(prefill[0][symbols.VISION_SIZE])
    seq_len, _ = plugin_prefill(language)
    rows = min(seq_len, request_image_tokens)
    if first_size < rows:
        warnings.append(
            f"{PLUGIN_VLLM}: the plugin pads each chunk's image rows to the first specialization's "
            f"vision_size {first_size} (bucket {first_seq}) and sends {seq_len}-token chunks that carry up "
            f"to {rows} image rows; list first a bucket whose vision_size holds its chunk's rows"
        )
    family = get_family(spec.family)
    if not family.features.chunk_split.supported:
        warnings.append(
            f"{PLUGIN_VLLM}: the plugin cuts prefill chunks every {seq_len} tokens wherever images fall, "
            f"but {family.title} keeps an image's tokens in one chunk; an image crossing a chunk "
            "boundary is answered wrongly"
        )
    return warnings
