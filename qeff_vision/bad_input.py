"""Where errors that libraries raise on bad input become one-line ``UserError``s.

A corrupt ``.safetensors`` header, an image whose header claims 30000 x 30000 pixels, a
checkpoint without tokenizer files: each reaches a library (struct/json, PIL, transformers) that
raises its own exception type, often not an ``OSError`` (``OverflowError``, ``MemoryError``,
``PIL.Image.DecompressionBombError``, ``safetensors_rust.SafetensorError``). Code that reads an
input file wraps the read in :func:`reading`, which names the file and what it was expected to
be; the CLI prints that one line and exits 2. Text from the user (prompts) is checked by
:func:`check_prompt` before it reaches a tokenizer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from qeff_vision.errors import UserError, shown


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn any error raised while reading ``path`` into a UserError naming it.

    ``KeyboardInterrupt`` (a ``BaseException``) and UserErrors pass through unchanged. Keep the
    block to the read itself: a bug in our own code inside it would be reported as bad input.

    Args:
        path: The input file or directory being read.
        what: What it should have been, for the message (``"a safetensors file"``).
    """
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - libraries raise many types on corrupt input
        raise UserError(f"{path}: not {what} ({type(exc).__name__}: {first_line(exc)})") from exc


def placeholder_texts(processor: object) -> tuple[str, ...]:
    """The text a transformers processor expands into image or video tokens (``"<image>"``)."""
    found = (getattr(processor, name, None) for name in ("image_token", "video_token"))
    return tuple(text for text in found if isinstance(text, str) and text)


def check_prompt(prompt: object, placeholders: Iterable[str] = ()) -> str:
    """A prompt as the tokenizer may take it; a UserError naming the prompt otherwise.

    Args:
        prompt: The user's text.
        placeholders: Text the processor expands into image or video tokens (``"<image>"``). A
            prompt holding one would ask the processor for more images than were given: the
            images are given with ``--image``/``images``, never inside the text.

    Raises:
        UserError: Not a string, not valid UTF-8 (a command line's undecodable bytes arrive as
            lone surrogates), or it contains a placeholder.
    """
    if not isinstance(prompt, str):
        raise UserError(f"prompt {shown(prompt)}: expected text")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = prompt[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
        raise UserError(
            f"prompt {shown(prompt)}: not valid UTF-8 text ({byte} at character {exc.start})"
        ) from None
    for placeholder in placeholders:
        if placeholder and placeholder in prompt:
            raise UserError(
                f"prompt {shown(prompt)}: contains the image placeholder {placeholder!r}; give images with "
                "--image (the processor inserts their placeholders) and leave it out of the text"
            )
    return prompt
