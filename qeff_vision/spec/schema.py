"""Schema of a spec: typed reading of the parsed YAML, every problem recorded with its YAML path.

Nothing here looks at the model; :mod:`qeff_vision.spec.checks` does that with what parsed.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qeff_vision.contract import video_pruning
from qeff_vision.families.base import ImageSize
from qeff_vision.spec.model import VisionSpec
from qeff_vision.spec.policy import FIXED, POLICY_NAMES, VisionSizePolicy
from qeff_vision.spec.strict_yaml import shown, yaml_path

TOP_KEYS = (
    "name",
    "model",
    "revision",
    "family",
    "config",
    "dtype",
    "batch_size",
    "full_batch_size",
    "ctx_len",
    "prefill",
    "vision",
    "specialization_layout",
    "compile",
    "deployment",
    "kv_cache_prefix",
    "retain_full_kv",
    "weights",
    "task",
)
PREFILL_KEYS = ("seq_lens",)
VISION_KEYS = (
    "images",
    "videos",
    "patch_buckets",
    "max_images",
    "vision_size",
    "image_processor",
    "video_pruning_rate",
)
VIDEO_KEYS = ("height", "width", "frames")
IMAGE_KEYS = ("height", "width", "frames")
# Generous bounds: they only keep arithmetic finite and messages sane for absurd input.
MAX_IMAGE_SIDE = 100_000
MAX_FRAMES = 10_000
MAX_CTX_LEN = 1 << 20
MAX_BATCH_SIZE = 4096
MAX_IMAGES_PER_REQUEST = 1024
MAX_BUCKET_PATCHES = 1 << 20
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MISSING = object()


class Reader:
    """Typed access to parsed YAML that records a problem (with its path) instead of raising."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        """Record ``message`` about the value at YAML ``path``."""
        self.problems.append(f"{path}: {message}")

    def mapping(
        self, value: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
    ) -> dict:
        """``value`` as a dict with only ``allowed`` keys; missing ``required`` keys are problems."""
        if not isinstance(value, Mapping):
            self.add(path or "<top level>", f"must be a mapping with keys {', '.join(allowed)}")
            return {}
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.add(yaml_path(path, str(key)), f"unknown key{hint}; allowed: {', '.join(allowed)}")
        for key in required:
            if key not in value:
                self.add(yaml_path(path, key), "is required")
        return {key: value[key] for key in value if key in allowed}

    def integer(self, data: dict, key: str, path: str, *, default: Any = MISSING, maximum: int) -> int | None:
        """A positive integer no larger than ``maximum``; ``None`` when absent without default or bad."""
        value = data.get(key, default)
        if value is MISSING:
            return None
        here = yaml_path(path, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.add(here, f"must be a positive integer (got {shown(value)})")
            return None
        if value > maximum:
            self.add(here, f"must be at most {maximum} (got {value})")
            return None
        return value

    def text(self, data: dict, key: str, path: str, *, choices: tuple[str, ...] = (), default: Any = MISSING):
        """A non-empty string, optionally one of ``choices``; ``None`` when absent or bad."""
        value = data.get(key, default)
        if value is MISSING or value is None and default is None:
            return None
        here = yaml_path(path, key)
        if choices and value not in choices:
            self.add(here, f"must be one of {', '.join(choices)} (got {shown(value)})")
            return None
        if not isinstance(value, str) or not value.strip():
            self.add(here, f"must be a non-empty string (got {shown(value)})")
            return None
        return value


def read_prefill(reader: Reader, value: Any, ctx_len: int | None) -> tuple[int, ...] | None:
    """The ``prefill:`` section: sorted unique buckets, or ``None`` when absent or invalid."""
    if value is MISSING:
        return None
    prefill = reader.mapping(value, "prefill", PREFILL_KEYS, required=PREFILL_KEYS)
    raw = prefill.get("seq_lens")
    if "seq_lens" not in prefill:
        return None
    if not isinstance(raw, list) or not raw:
        reader.add("prefill.seq_lens", f"must be a non-empty list of chunk sizes (got {shown(raw)})")
        return None
    before = len(reader.problems)
    seen: dict[int, int] = {}
    by_index = dict(enumerate(raw))
    for index in by_index:
        here = yaml_path("prefill.seq_lens", index)
        seq_len = reader.integer(by_index, index, "prefill.seq_lens", maximum=MAX_CTX_LEN)
        if seq_len is None:
            continue
        if seq_len in seen:
            reader.add(here, f"duplicate bucket {seq_len} (also prefill.seq_lens[{seen[seq_len]}])")
        elif seq_len == 1:
            reader.add(here, "1 is the decode shape, always generated; prefill buckets must be at least 2")
        elif ctx_len is not None and seq_len > ctx_len:
            reader.add(here, f"seq_len {seq_len} exceeds ctx_len {ctx_len}")
        seen.setdefault(seq_len, index)
    return tuple(sorted(seen)) if len(reader.problems) == before else None


def read_policy(reader: Reader, value: Any, ctx_len: int | None) -> VisionSizePolicy | None:
    """``vision.vision_size``: ``chunk``, ``max`` or an integer below ``ctx_len``."""
    here = "vision.vision_size"
    if isinstance(value, str) and value in POLICY_NAMES:
        return VisionSizePolicy(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        reader.add(here, f"must be {' or '.join(POLICY_NAMES)} or a positive integer (got {shown(value)})")
        return None
    if ctx_len is not None and value >= ctx_len:
        reader.add(here, f"vision_size {value} must be smaller than ctx_len {ctx_len}")
        return None
    return VisionSizePolicy(FIXED, value)


@dataclass
class VisionInput:
    """What parsed cleanly in ``vision:``, kept for the model checks even when other parts did not.

    ``images`` keeps each valid image with its index in the YAML list; ``max_images`` and
    ``policy`` are ``None`` when they were invalid (checks that need them are skipped).
    """

    images: list[tuple[int, ImageSize]]
    max_images: int | None
    policy: VisionSizePolicy | None
    policy_given: bool
    complete: bool
    patch_buckets: tuple[int, ...] = ()
    image_processor: tuple[tuple[str, int], ...] = ()
    video_pruning_rate: float = 0.0

    def spec(self) -> VisionSpec:
        """The checked section (only when ``complete``)."""
        assert self.complete and self.max_images is not None and self.policy is not None
        return VisionSpec(
            tuple(image for _, image in self.images),
            self.max_images,
            self.policy,
            self.policy_given,
            self.patch_buckets,
            self.image_processor,
            self.video_pruning_rate,
        )


def read_vision(reader: Reader, value: Any, ctx_len: int | None) -> VisionInput | None:
    """The ``vision:`` section, partially when some of it is invalid; ``None`` when absent."""
    if value is MISSING:
        return None
    before = len(reader.problems)
    vision = reader.mapping(value, "vision", VISION_KEYS)
    if isinstance(vision, dict) and "patch_buckets" in vision and ("images" in vision or "videos" in vision):
        reader.add(
            "vision",
            "give either images/videos (one program per resolution) or patch_buckets (images of any size), "
            "not both",
        )
    elif isinstance(vision, dict) and not {"images", "videos", "patch_buckets"} & set(vision):
        reader.add(
            "vision",
            "needs images or videos (a list of {height, width} / {height, width, frames}) "
            "or patch_buckets (patch counts, images of any resolution)",
        )
    buckets = read_patch_buckets(reader, vision["patch_buckets"]) if "patch_buckets" in vision else ()
    max_images = reader.integer(vision, "max_images", "vision", default=1, maximum=MAX_IMAGES_PER_REQUEST)
    given = "vision_size" in vision
    policy = read_policy(reader, vision["vision_size"], ctx_len) if given else VisionSizePolicy()
    raw = vision.get("images")
    images: list[tuple[int, ImageSize]] = []
    if "images" in vision and (not isinstance(raw, list) or not raw):
        reader.add("vision.images", f"must be a non-empty list of {{height, width}} (got {shown(raw)})")
    for index, item in enumerate(raw if isinstance(raw, list) else []):
        here = yaml_path("vision.images", index)
        entry = reader.mapping(item, here, IMAGE_KEYS, required=("height", "width"))
        height = reader.integer(entry, "height", here, maximum=MAX_IMAGE_SIDE)
        width = reader.integer(entry, "width", here, maximum=MAX_IMAGE_SIDE)
        frames = reader.integer(entry, "frames", here, default=1, maximum=MAX_FRAMES)
        if None in (height, width, frames):
            continue
        image = ImageSize(height, width, frames)
        first = next((other for other, seen in images if seen == image), None)
        if first is not None:
            reader.add(here, f"duplicate image {image_label(image)} (also vision.images[{first}])")
            continue
        images.append((index, image))
    raw_videos = vision.get("videos")
    if "videos" in vision and (not isinstance(raw_videos, list) or not raw_videos):
        reader.add(
            "vision.videos",
            f"must be a non-empty list of {{height, width, frames}} (got {shown(raw_videos)})",
        )
    for index, item in enumerate(raw_videos if isinstance(raw_videos, list) else []):
        here = yaml_path("vision.videos", index)
        entry = reader.mapping(item, here, VIDEO_KEYS, required=("height", "width", "frames"))
        height = reader.integer(entry, "height", here, maximum=MAX_IMAGE_SIDE)
        width = reader.integer(entry, "width", here, maximum=MAX_IMAGE_SIDE)
        frames = reader.integer(entry, "frames", here, maximum=MAX_FRAMES)
        if None in (height, width, frames):
            continue
        video = ImageSize(height, width, frames, video=True)
        if any(seen == video for _, seen in images):
            reader.add(here, f"duplicate video {image_label(video)}")
            continue
        images.append((len(images), video))
    options = read_image_processor(reader, vision["image_processor"]) if "image_processor" in vision else ()
    rate = vision.get(video_pruning.OPTION, 0.0)
    problem = video_pruning.rate_problem(rate)
    if problem:
        reader.add(f"vision.{video_pruning.OPTION}", problem.removeprefix(f"{video_pruning.OPTION} "))
        rate = 0.0
    complete = len(reader.problems) == before
    return VisionInput(images, max_images, policy, given, complete, buckets, options, float(rate))


def read_image_processor(reader: Reader, raw: Any) -> tuple[tuple[str, int], ...]:
    """``vision.image_processor``: option name -> integer (the family checks names and values)."""
    here = "vision.image_processor"
    if not isinstance(raw, dict) or not raw:
        reader.add(here, f"must be a mapping of image-processor options to integers (got {shown(raw)})")
        return ()
    options = []
    for key in raw:
        value = reader.integer(raw, key, here, maximum=MAX_IMAGE_SIDE)
        if value is not None:
            options.append((str(key), value))
    return tuple(options)


def read_patch_buckets(reader: Reader, raw: Any) -> tuple[int, ...]:
    """``vision.patch_buckets``: sorted unique patch counts (empty when invalid)."""
    here = "vision.patch_buckets"
    if not isinstance(raw, list) or not raw:
        reader.add(here, f"must be a non-empty list of patch counts (got {shown(raw)})")
        return ()
    before = len(reader.problems)
    seen: dict[int, int] = {}
    by_index = dict(enumerate(raw))
    for index in by_index:
        count = reader.integer(by_index, index, here, maximum=MAX_BUCKET_PATCHES)
        if count is None:
            continue
        if count in seen:
            reader.add(yaml_path(here, index), f"duplicate bucket {count} (also {here}[{seen[count]}])")
        seen.setdefault(count, index)
    return tuple(sorted(seen)) if len(reader.problems) == before else ()


def image_label(image: ImageSize) -> str:
    """``1080x1920`` (``x8f`` appended for 8 frames), as messages and tables show an image."""
    return f"{image.height}x{image.width}" + (f"x{image.frames}f" if image.frames != 1 or image.video else "")
