"""The request file of ``qeff-vision run ART --requests FILE.jsonl``: one JSON object per line.

Keys: ``prompt`` (the user's text, required), ``images`` (image paths, possibly empty; relative
paths are relative to the file), ``max_new_tokens`` (a positive integer; the command's
``--max-new-tokens`` when absent) and ``arrival_step`` (the engine step at which the request
arrives, a non-negative integer; 0 when absent), and the sampling parameters of
:class:`~qeff_vision.inputs.sampling_params.SamplingParams` under vLLM's names (``temperature``,
``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``seed``), each
overriding the command's value for that request. Blank lines are skipped. Any other key, a wrong
type or value, or a missing image file is a user error naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from qeff_vision.errors import UserError
from qeff_vision.inputs.sampling_params import GREEDY, SamplingParams

SAMPLING_KEYS = SamplingParams.names()
KEYS = ("prompt", "images", "max_new_tokens", "arrival_step", *SAMPLING_KEYS)
#: Sampling keys that take whole numbers (the others take any number).
_INTEGER_SAMPLING_KEYS = ("top_k", "seed")


@dataclass(frozen=True)
class Request:
    """One request of a request file.

    Attributes:
        index: Its position among the file's requests (0-based; blank lines do not count).
        prompt: The user's text.
        images: Image paths, resolved against the file's directory, in prompt order.
        max_new_tokens: Upper bound of generated tokens.
        arrival_step: The engine step at which the request arrives.
        sampling: How its tokens are chosen (the command's parameters, overridden by its keys).
    """

    index: int
    prompt: str
    images: tuple[Path, ...] = ()
    max_new_tokens: int = 32
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY


def _integer(value, key: str, minimum: int, where: str) -> int:
    # bool is an int subclass in Python; `true` is not a token count.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where}: {key!r} must be an integer >= {minimum}, got {json.dumps(value)}")
    return value


def _sampling(entry: dict, default: SamplingParams, where: str) -> SamplingParams:
    """``default`` with the line's sampling keys applied."""
    given = {key: entry[key] for key in SAMPLING_KEYS if key in entry}
    for key, value in given.items():
        whole = key in _INTEGER_SAMPLING_KEYS
        # bool is an int subclass in Python; `true` is not a number.
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            kind = "an integer" if whole else "a number"
            raise UserError(f"{where}: {key!r} must be {kind}, got {json.dumps(value)}")
    try:
        return replace(default, **given) if given else default
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def parse_request(
    line: str,
    index: int,
    base: Path,
    default_max_new_tokens: int,
    where: str,
    default_sampling: SamplingParams = GREEDY,
) -> Request:
    """One request from one line of JSON.

    Args:
        line: The line's text.
        index: The request's position among the file's requests.
        base: Directory relative image paths are resolved against.
        default_max_new_tokens: ``max_new_tokens`` when the line has none.
        where: ``FILE:LINE`` for error messages.
        default_sampling: The sampling parameters the line's keys override.

    Raises:
        UserError: Not a JSON object, an unknown key, a wrong type or value, a missing image file.
    """
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(entry, dict):
        raise UserError(f"{where}: each line must be a JSON object with keys {', '.join(KEYS)}")
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
    prompt = entry.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: 'prompt' must be a non-empty string")
    images = entry.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise UserError(f"{where}: 'images' must be a list of image paths (may be empty)")
    paths = []
    for image in images:
        path = Path(image) if Path(image).is_absolute() else base / image
        if not path.is_file():
            raise UserError(f"{where}: image {image!r} not found ({path})")
        paths.append(path)
    max_new = entry.get("max_new_tokens", default_max_new_tokens)
    arrival = entry.get("arrival_step", 0)
    return Request(
        index=index,
        prompt=prompt,
        images=tuple(paths),
        max_new_tokens=_integer(max_new, "max_new_tokens", 1, where),
        arrival_step=_integer(arrival, "arrival_step", 0, where),
        sampling=_sampling(entry, default_sampling, where),
    )


def read_requests(
    path: str | Path, default_max_new_tokens: int = 32, default_sampling: SamplingParams = GREEDY
) -> list[Request]:
    """Every request of a request file, in file order (``default_sampling``: the command's).

    Raises:
        UserError: The file is missing, unreadable, holds no request, or a line is bad (the
            message names ``FILE:LINE``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such request file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the request file ({exc})") from None
    requests: list[Request] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            where = f"{path}:{number}"
            requests.append(
                parse_request(
                    line, len(requests), path.parent, default_max_new_tokens, where, default_sampling
                )
            )
    if not requests:
        raise UserError(f"{path}: no requests (one JSON object per line)")
    return requests
