"""A user's turn as the model takes it: chat messages, the chat template, the processor's arrays.

Everything between what a user gives (text, images, clips) and the arrays the runtime and
transformers' ``generate`` both take; nothing here runs a program. A one-turn prompt
(:func:`process_turn`) is what the benchmarks and the transformers reference use as it is; a
:class:`~qeff_vision.runtime.conversation.Conversation` renders its whole history with the same
messages every turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qeff_vision.errors import UserError
from qeff_vision.media import Clip


@dataclass
class PromptInputs:
    """One rendered and processed prompt.

    Attributes:
        messages: The chat messages rendered (history plus the new user turn).
        text: The chat template's output.
        images: Every image of the conversation, in prompt order.
        processed: Processor outputs as numpy arrays (what :meth:`Generator.generate` takes).
        notes: Things worth telling the user (e.g. an image resized to a compiled resolution).
    """

    messages: list[dict]
    text: str
    images: list[Any]
    processed: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    videos: list[Clip] = field(default_factory=list)


def user_message(image_count: int, text: str, video_count: int = 0) -> dict:
    """One user turn: the images first, then the videos, then the text."""
    content: list[dict] = [{"type": "image"} for _ in range(image_count)]
    content += [{"type": "video"} for _ in range(video_count)]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def process_turn(processor, images: Sequence[Any], text: str) -> dict[str, Any]:
    """One user turn (``images`` then ``text``) rendered with the chat template and processed.

    What a one-turn :class:`Conversation` sends, without a program: the benchmarks and the
    transformers reference take it as it is.

    Returns:
        Processor outputs as numpy arrays (bfloat16 widened to float32, see :func:`as_arrays`).
    """
    rendered = processor.apply_chat_template([user_message(len(images), text)], add_generation_prompt=True)
    return as_arrays(processor(text=[rendered], images=list(images) or None, return_tensors="pt"))


def assistant_message(text: str) -> dict:
    """One assistant turn holding ``text``."""
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def media_by_turn(
    first: Sequence[Any], by_turn: Mapping[int, Sequence[Any]] | None, turns: int, kind: str
) -> list[list[Any]]:
    """What each of ``turns`` turns shows: ``first`` then ``by_turn[1]`` in turn 1, ``by_turn[n]`` in turn n.

    Raises:
        UserError: A turn number outside 1..turns.
    """
    shown: list[list[Any]] = [list(first)] + [[] for _ in range(turns - 1)]
    for number, items in (by_turn or {}).items():
        if not 1 <= number <= turns:
            raise UserError(
                f"{kind} for turn {number}, but the conversation has {turns} turn(s) (one per prompt)"
            )
        shown[number - 1].extend(items)
    return shown


def as_arrays(processed) -> dict[str, Any]:
    """Processor outputs (torch tensors) as numpy arrays.

    A bfloat16 tensor widens to float32 (exactly): Llama 4's image processor normalizes in bfloat16
    (ref: transformers v5 models/llama4/image_processing_llama4.py, ``rescale_and_normalize``), which
    numpy cannot hold, so ``return_tensors="np"`` fails on it.
    """
    import torch

    return {
        name: (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        if torch.is_tensor(value)
        else value
        for name, value in processed.items()
    }
