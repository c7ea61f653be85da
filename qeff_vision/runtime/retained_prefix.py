"""What a program already holds, so a later prompt prefills only the part that differs.

A program that keeps one sequence's state between calls holds the KV cache of every token fed
so far (positions 0..H-1) and the images' rows or cross K/V; the host keeps a record of those
tokens and images. Two runners keep one: a ``deployment: single`` program (always: the state
lives in it), and the dual deployment's language program when a conversation asks for it
(:mod:`qeff_vision.runtime.kept_prefix`; the host holds its KV on onnxruntime, the device on
Cloud AI 100). A conversation renders its whole history every turn (the chat template's text,
what transformers ``generate`` is given), and that history starts with what the program holds:
the earlier prompts and the fed part of the replies. The longest common prefix is kept and only
the rest is prefilled, so an image shown in an earlier turn is never encoded again and the
history is not prefilled again (vLLM's prefix caching serves chat turns the same way; ref: vllm
``v1/core/kv_cache_manager.py`` ``get_computed_blocks``).

The kept prefix (:func:`resume_point`):

- holds tokens equal to the held ones (the last prompt, then the generated tokens fed after it);
- never ends inside an image, and every image in it is the held image of the same index (same
  content key: a placeholder id says nothing of the pixels);
- leaves at least one token to prefill (its logits give the first new token);
- is H or the end of the last prompt when the program has caches not indexed by position (a
  sliding-window ring, whose slots' positions follow from the next chunk's first position; a
  recurrent state): those cannot be rolled back, so they resume where they stopped or from the
  copy kept at the end of the last prefill (host caches only), else the prompt starts over.

Positional KV slots after the kept prefix need no clearing: a chunk writes its own positions
before attending and the mask reads no later position (what lets a device reuse its resident
cache across requests without clearing it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from qeff_vision.contract.language_io import SLOT_ROLES
from qeff_vision.contract.segments import Segment
from qeff_vision.contract.states import KeptPrefix


@dataclass
class HeldPrefix:
    """The sequence a program holds after a generation.

    Attributes:
        tokens: Token ids whose KV the program holds, in position order.
        image_keys: Content keys of the images among those tokens, in prompt order.
        prompt_len: Tokens of the last prompt (where its prefill stopped).
        past: The host-held caches (empty when the device retains them).
        at_prompt_end: The caches not indexed by position as they were at ``prompt_len`` (host
            only; None when there are none to keep or the device holds them).
    """

    tokens: np.ndarray
    image_keys: tuple[str, ...]
    prompt_len: int
    past: dict[str, np.ndarray] = field(default_factory=dict)
    at_prompt_end: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class Resume:
    """Where a prompt's prefill starts on a program that holds :class:`HeldPrefix`.

    Attributes:
        start: Prompt tokens kept (their KV is held); prefill starts here.
        images: Images kept (every placeholder of them is before ``start``).
        restore: Host caches to prefill after: the held ones, with the copy kept at the last
            prompt's end in place of those that cannot be rolled back.
    """

    start: int = 0
    images: int = 0
    restore: dict[str, np.ndarray] = field(default_factory=dict)


def unpositioned_caches(io, exclude: Sequence[str] = ()) -> list[str]:
    """Cache inputs of ``io`` not indexed by position (window rings, recurrent states).

    Each layer's state says what a kept prefix may restore of it
    (:class:`~qeff_vision.contract.states.KeptPrefix`): a ``ctx_len`` KV cache holds position p at
    slot p (any prefix); a ring or a recurrent state cannot be rolled back (these); image states
    go with their images. ``exclude``: caches managed otherwise.
    """
    return [
        row.name
        for row in io.rows(*SLOT_ROLES)
        if row.name not in exclude and io.layers[row.layer].kept_prefix is KeptPrefix.AT_END
    ]


def resume_point(
    held: HeldPrefix | None,
    input_ids: np.ndarray,
    spans: Sequence[tuple[int, int]],
    keys: Sequence[str],
    unpositioned: Sequence[str],
) -> Resume:
    """The longest prefix of ``input_ids`` the program may keep (rules in the module docstring).

    Args:
        held: What the program holds (None: nothing yet).
        input_ids: The new prompt's token ids.
        spans: ``[start, stop)`` of each image's placeholder tokens in the prompt, in order.
        keys: Each image's content key, in order.
        unpositioned: Names of the caches that cannot be rolled back (:func:`unpositioned_caches`).
    """
    if held is None or len(input_ids) < 2:
        return Resume()
    limit = min(len(held.tokens), len(input_ids) - 1)
    differs = np.flatnonzero(held.tokens[:limit] != input_ids[:limit])
    start = int(differs[0]) if len(differs) else limit
    start = _before_new_images(start, spans, keys, held.image_keys)
    restore = dict(held.past)
    if unpositioned and start != len(held.tokens):
        if held.at_prompt_end is not None and held.prompt_len <= start:
            start = held.prompt_len
            restore.update(held.at_prompt_end)
        else:
            start = 0
    if not start:
        return Resume()
    return Resume(start, sum(1 for _, stop in spans if stop <= start), restore)


def _before_new_images(
    start: int, spans: Sequence[tuple[int, int]], keys: Sequence[str], held: Sequence[str]
) -> int:
    """``start`` moved back to the first image it cuts or that is not the held one of its index."""
    for index, (first, stop) in enumerate(spans):
        if first >= start:
            break
        if stop > start or index >= len(held) or held[index] != keys[index]:
            return first
    return start


def segments_after(segments: Sequence[Segment], start: int) -> list[Segment]:
    """The segments of the images after a kept prefix of ``start`` tokens, counted from ``start``.

    The prefix never ends inside an image (:func:`resume_point`), so each image is either kept
    whole (dropped here) or after the prefix whole.
    """
    if not start:
        return list(segments)
    return [
        replace(
            segment,
            start=segment.start - start,
            runs=tuple((first - start, length) for first, length in segment.runs),
        )
        for segment in segments
        if segment.start >= start
    ]


def held_after(
    input_ids: np.ndarray,
    generated: Sequence[int],
    image_keys: Sequence[str],
    past: Mapping[str, np.ndarray],
    at_prompt_end: Mapping[str, np.ndarray] | None,
) -> HeldPrefix:
    """What the program holds after a generation: the prompt and every generated token but the last.

    The last generated token is never fed (generation stops after choosing it).
    """
    fed = np.asarray(list(generated[:-1]), dtype=np.int64)
    return HeldPrefix(
        tokens=np.concatenate([np.asarray(input_ids, dtype=np.int64).reshape(-1), fed]),
        image_keys=tuple(image_keys),
        prompt_len=len(input_ids),
        past=dict(past),
        at_prompt_end=dict(at_prompt_end) if at_prompt_end is not None else None,
    )


def kept_note(start: int, length: int) -> str:
    """What ``run`` prints about a prompt that continued from the held prefix."""
    return (
        f"{start} of {length} prompt tokens already held by the program (earlier turns): "
        f"prefilled {length - start}"
    )


def served_notes(images: int, held: int, states: str) -> list[str]:
    """What ``run`` prints per image of a prompt: held from an earlier turn, or encoded now.

    Args:
        images: Images of the prompt.
        held: How many of them (the leading ones) the program already holds.
        states: What the program holds of an image ("KV", "K/V").
    """
    return [
        f"image {number}: "
        + (f"{states} held from an earlier turn" if number <= held else "encoded inside the single program")
        for number in range(1, images + 1)
    ]


def image_set_resume(resume: Resume, held: HeldPrefix | None, keys: Sequence[str]) -> Resume:
    """``resume`` for a program where a token that sees no image still reads every image's states.

    transformers' mllama turns a cross-attention mask row without any image into zeros, i.e. a
    uniform attention over all the prompt's image states (only the MLP is masked out; ref:
    transformers v5 models/mllama/modeling_mllama.py ``_prepare_cross_attention_mask``), so the
    KV of the tokens before the first image depends on every image of the prompt. A prefix is
    kept only while the prompt's images are exactly the held ones; otherwise the text is
    prefilled again, but the held images that lead the prompt stay in their slots (not encoded
    again: their K/V depend on the pixels only).
    """
    if held is None or tuple(keys) == held.image_keys:
        return resume
    shared = 0
    for ours, theirs in zip(keys, held.image_keys):
        if ours != theirs:
            break
        shared += 1
    return Resume(0, shared)
