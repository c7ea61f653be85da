"""Load and check a spec file: schema first (unknown keys, types, ranges), then the model's token math.

Every problem is collected with its YAML path and raised at once as one
:class:`~qeff_vision.errors.SpecError`; nothing here raises any other exception for bad input.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision import families
from qeff_vision.compile.options import parse_compile_options
from qeff_vision.errors import SpecError, UserError
from qeff_vision.families.base import Family, ImageSize, ModelDescription, describe_checkpoint
from qeff_vision.spec.model import DTYPES, FLAT, LAYOUTS, PrefillSpec, Spec, VisionSpec
from qeff_vision.spec.policy import FIXED, POLICY_NAMES, VisionSizePolicy, chunk_span
from qeff_vision.spec.strict_yaml import load_strict_yaml, yaml_path

TOP_KEYS = (
    "name",
    "model",
    "family",
    "config",
    "dtype",
    "batch_size",
    "ctx_len",
    "prefill",
    "vision",
    "specialization_layout",
    "compile",
)
PREFILL_KEYS = ("seq_lens",)
VISION_KEYS = ("images", "max_images", "vision_size")
IMAGE_KEYS = ("height", "width", "frames")
# Generous bounds: they only keep arithmetic finite and messages sane for absurd input.
MAX_IMAGE_SIDE = 100_000
MAX_FRAMES = 10_000
MAX_CTX_LEN = 1 << 20
MAX_BATCH_SIZE = 4096
MAX_IMAGES_PER_REQUEST = 1024
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
HUB_ID_PATTERN = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_MISSING = object()


class _Reader:
    """Typed access to parsed YAML that records a problem (with its path) instead of raising."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
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

    def integer(
        self, data: dict, key: str, path: str, *, default: Any = _MISSING, maximum: int
    ) -> int | None:
        """A positive integer no larger than ``maximum``; ``None`` when absent without default or bad."""
        value = data.get(key, default)
        if value is _MISSING:
            return None
        here = yaml_path(path, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.add(here, f"must be a positive integer (got {value!r})")
            return None
        if value > maximum:
            self.add(here, f"must be at most {maximum} (got {value})")
            return None
        return value

    def text(
        self, data: dict, key: str, path: str, *, choices: tuple[str, ...] = (), default: Any = _MISSING
    ):
        """A non-empty string, optionally one of ``choices``; ``None`` when absent or bad."""
        value = data.get(key, default)
        if value is _MISSING or value is None and default is None:
            return None
        here = yaml_path(path, key)
        if choices and value not in choices:
            self.add(here, f"must be one of {', '.join(choices)} (got {value!r})")
            return None
        if not isinstance(value, str) or not value.strip():
            self.add(here, f"must be a non-empty string (got {value!r})")
            return None
        return value


def load_spec(path: str | Path) -> Spec:
    """Read, validate and check a spec file against its model's config.

    Args:
        path: The YAML spec. Relative ``model:`` directories and ``config:`` paths in it are
            resolved against the spec file's directory.

    Returns:
        The checked :class:`Spec`; its ``warnings`` list non-fatal findings.

    Raises:
        SpecError: Listing every problem, each prefixed by its YAML path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), ["file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), [f"cannot read the file ({exc.__class__.__name__}: {exc})"]) from None
    data, problems = load_strict_yaml(text)
    if problems:
        raise SpecError(str(path), problems)
    return spec_from_data(data, path)


def spec_from_data(data: object, source: Path) -> Spec:
    """Validate already-parsed spec ``data`` as if read from ``source`` (see :func:`load_spec`)."""
    if data is None:
        raise SpecError(str(source), ["<top level>: the spec is empty"])
    reader = _Reader()
    top = reader.mapping(data, "", TOP_KEYS, required=("model", "ctx_len", "prefill", "vision"))
    name = reader.text(top, "name", "", default=source.stem)
    if name is not None and not NAME_PATTERN.fullmatch(name):
        reader.add(
            "name", f"must be letters, digits, '.', '_' or '-' (it names the golden directory); got {name!r}"
        )
    model = reader.text(top, "model", "")
    family_name = reader.text(top, "family", "", default=None)
    config = reader.text(top, "config", "", default=None)
    dtype = reader.text(top, "dtype", "", choices=DTYPES, default=DTYPES[0])
    batch_size = reader.integer(top, "batch_size", "", default=1, maximum=MAX_BATCH_SIZE)
    ctx_len = reader.integer(top, "ctx_len", "", maximum=MAX_CTX_LEN)
    layout = reader.text(top, "specialization_layout", "", choices=LAYOUTS, default=FLAT)
    seq_lens = _read_prefill(reader, top.get("prefill", _MISSING), ctx_len)
    vision = _read_vision(reader, top.get("vision", _MISSING), ctx_len)
    compile_options, compile_problems = parse_compile_options(top.get("compile"), "compile")
    reader.problems += compile_problems

    description = model_dir = config_path = None
    family = None
    warnings: list[str] = []
    if model is not None:
        description, model_dir, config_path = _describe(reader, source.parent, model, config)
    if description is not None:
        family = _resolve_family(reader, description, family_name, "config" if config else "model")
    if family is not None and description is not None:
        _check_model(reader, warnings, family, description, ctx_len)
    if family is not None and description is not None and vision is not None:
        _check_images(reader, warnings, family, description, vision, seq_lens, ctx_len)

    if reader.problems:
        raise SpecError(str(source), reader.problems)
    assert None not in (name, model, family, dtype, batch_size, ctx_len, seq_lens, vision, layout)
    assert vision.complete
    return Spec(
        name=name,
        model=model,
        family=family.name,
        dtype=dtype,
        batch_size=batch_size,
        ctx_len=ctx_len,
        prefill=PrefillSpec(seq_lens),
        vision=vision.spec(),
        layout=layout,
        compile=compile_options,
        source=source,
        model_dir=model_dir,
        config_path=config_path,
        model_description=description,
        warnings=tuple(warnings),
    )


def _read_prefill(reader: _Reader, value: Any, ctx_len: int | None) -> tuple[int, ...] | None:
    if value is _MISSING:
        return None
    prefill = reader.mapping(value, "prefill", PREFILL_KEYS, required=PREFILL_KEYS)
    raw = prefill.get("seq_lens")
    if "seq_lens" not in prefill:
        return None
    if not isinstance(raw, list) or not raw:
        reader.add("prefill.seq_lens", f"must be a non-empty list of chunk sizes (got {raw!r})")
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


def _read_policy(reader: _Reader, value: Any, ctx_len: int | None) -> VisionSizePolicy | None:
    here = "vision.vision_size"
    if isinstance(value, str) and value in POLICY_NAMES:
        return VisionSizePolicy(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        reader.add(here, f"must be {' or '.join(POLICY_NAMES)} or a positive integer (got {value!r})")
        return None
    if ctx_len is not None and value >= ctx_len:
        reader.add(here, f"vision_size {value} must be smaller than ctx_len {ctx_len}")
        return None
    return VisionSizePolicy(FIXED, value)


@dataclass
class _VisionInput:
    """What parsed cleanly in ``vision:``, kept for the model checks even when other parts did not.

    ``images`` keeps each valid image with its index in the YAML list; ``max_images`` and
    ``policy`` are ``None`` when they were invalid (checks that need them are skipped).
    """

    images: list[tuple[int, ImageSize]]
    max_images: int | None
    policy: VisionSizePolicy | None
    policy_given: bool
    complete: bool

    def spec(self) -> VisionSpec:
        assert self.complete and self.max_images is not None and self.policy is not None
        return VisionSpec(
            tuple(image for _, image in self.images), self.max_images, self.policy, self.policy_given
        )


def _read_vision(reader: _Reader, value: Any, ctx_len: int | None) -> _VisionInput | None:
    if value is _MISSING:
        return None
    before = len(reader.problems)
    vision = reader.mapping(value, "vision", VISION_KEYS, required=("images",))
    max_images = reader.integer(vision, "max_images", "vision", default=1, maximum=MAX_IMAGES_PER_REQUEST)
    given = "vision_size" in vision
    policy = _read_policy(reader, vision["vision_size"], ctx_len) if given else VisionSizePolicy()
    raw = vision.get("images")
    images: list[tuple[int, ImageSize]] = []
    if "images" in vision and (not isinstance(raw, list) or not raw):
        reader.add("vision.images", f"must be a non-empty list of {{height, width}} (got {raw!r})")
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
            reader.add(here, f"duplicate image {_label(image)} (also vision.images[{first}])")
            continue
        images.append((index, image))
    return _VisionInput(images, max_images, policy, given, complete=len(reader.problems) == before)


def _label(image: ImageSize) -> str:
    return f"{image.height}x{image.width}" + (f"x{image.frames}f" if image.frames != 1 else "")


def _local(spec_dir: Path, text: str) -> Path:
    """``text`` as a path, relative paths taken from the spec file's directory."""
    path = Path(text)
    if text.startswith("~"):
        try:
            path = path.expanduser()
        except RuntimeError:  # unknown user in ~user
            pass
    return path if path.is_absolute() else spec_dir / path


def _exists(path: Path, kind: str) -> bool:
    """``path`` is a directory (``kind == "dir"``) or a file; False for any unusable path."""
    try:
        return path.is_dir() if kind == "dir" else path.is_file()
    except (OSError, ValueError):
        return False


def _describe(
    reader: _Reader, spec_dir: Path, model: str, config: str | None
) -> tuple[ModelDescription | None, Path | None, Path | None]:
    """Read the config (pinned snapshot, checkpoint or local hub cache) without touching the network."""
    candidate = _local(spec_dir, model)
    model_dir = candidate if _exists(candidate, "dir") else None
    if model_dir is None and not HUB_ID_PATTERN.fullmatch(model):
        reader.add("model", f"{model!r} is neither a directory (relative to the spec) nor a Hugging Face id")
        return None, None, None
    if config is not None:
        config_path = _local(spec_dir, config)
        if not _exists(config_path, "file"):
            reader.add("config", f"config snapshot {config_path} not found")
            return None, model_dir, None
    elif model_dir is not None:
        config_path = model_dir / "config.json"
        if not _exists(config_path, "file"):
            reader.add("model", f"{model_dir} has no config.json")
            return None, model_dir, None
    else:
        config_path = _cached_hub_config(model)
        if config_path is None:
            reader.add(
                "model",
                f"{model!r} is a Hugging Face id with no local copy; add `config:` with a "
                "pinned config.json snapshot so the spec works offline",
            )
            return None, None, None
    # The image-processor config comes from the checkpoint directory, else from beside the pinned
    # config (or the hub cache snapshot); families fall back to published defaults without one.
    try:
        description = describe_checkpoint(model_dir or config_path.parent, config_path)
    except UserError as exc:
        reader.add("config" if config else "model", str(exc))
        return None, model_dir, config_path
    return description, model_dir, config_path


def _cached_hub_config(repo_id: str) -> Path | None:
    """config.json of ``repo_id`` from the local Hugging Face cache, if present (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - any hub-side validation error means "not usable offline"
        return None
    return Path(found) if isinstance(found, str) else None


def _resolve_family(
    reader: _Reader, model: ModelDescription, name: str | None, config_key: str
) -> Family | None:
    try:
        detected = families.family_for(model)
    except (UserError, TypeError, ValueError) as exc:
        detected = None
        if name is None:
            reader.add(config_key, str(exc))
    if name is None:
        return detected
    try:
        family = families.get_family(name)
    except UserError as exc:
        reader.add("family", str(exc))
        return None
    if detected is not family:
        arch = ", ".join(model.architectures) or model.model_type or "unknown"
        reader.add("family", f"{name} does not accept architecture {arch} of {model.source}")
        return None
    return family


def _check_model(
    reader: _Reader, warnings: list[str], family: Family, model: ModelDescription, ctx_len: int | None
) -> None:
    try:
        dims = family.text_dims(model)
    except (UserError, ArithmeticError, TypeError, ValueError) as exc:
        reader.add("config", f"unusable language config: {exc}")
        return
    if ctx_len is not None and 0 < dims.max_position_embeddings < ctx_len:
        warnings.append(
            f"ctx_len: {ctx_len} exceeds the model's max_position_embeddings {dims.max_position_embeddings}"
        )


def image_tokens(family: Family, model: ModelDescription, image: ImageSize) -> int:
    """Placeholder tokens ``image`` becomes (the family's token math, frames included)."""
    return family.image_tokens(model, image)


def _check_images(
    reader: _Reader,
    warnings: list[str],
    family: Family,
    model: ModelDescription,
    vision: _VisionInput,
    seq_lens: tuple[int, ...] | None,
    ctx_len: int | None,
) -> None:
    policy, max_images = vision.policy, vision.max_images
    if vision.policy_given and not family.features.dynamic_vision_size.supported:
        reader.add(
            "vision.vision_size",
            f"family {family.name} has no dynamic vision size "
            f"({family.features.dynamic_vision_size.note}); remove this key",
        )
    tokens: dict[int, int] = {}
    for index, image in vision.images:
        here = yaml_path("vision.images", index)
        try:
            found = family.validate_image(model, image)
            if not found:
                tokens[index] = image_tokens(family, model, image)
        except (ArithmeticError, ValueError, TypeError, UserError) as exc:
            found = [f"token math failed for {_label(image)}: {exc}"]
        for problem in found:
            reader.add(here, problem)
    labels = dict(vision.images)
    for index, count in tokens.items():
        here = yaml_path("vision.images", index)
        if ctx_len is not None and max_images is not None and count * max_images >= ctx_len:
            rows = count * max_images
            per_request = f" x {max_images} images per request = {rows} rows" if max_images > 1 else ""
            reader.add(
                here,
                f"{_label(labels[index])} becomes {count} image tokens{per_request}, which does not fit "
                f"ctx_len {ctx_len} (must be smaller, leaving room for text)",
            )
        if policy is not None and policy.kind == FIXED and count > policy.size:
            warnings.append(
                f"{here}: {_label(labels[index])} becomes {count} image tokens, more than vision_size "
                f"{policy.size}: its placeholders must be split over several chunks (chunking required)"
            )
    if not (seq_lens and tokens and policy and max_images) or family.features.chunk_split.supported:
        return
    request = max(tokens.values()) * max_images
    capacity = max(min(s, policy.for_bucket(s, request)) for s in seq_lens)
    for index, count in tokens.items():
        if chunk_span(count, capacity)[0] > 1:
            reader.add(
                yaml_path("vision.images", index),
                f"{count} image tokens do not fit one chunk (at most {capacity} placeholders) and "
                f"{family.name} cannot split an image across chunks ({family.features.chunk_split.note})",
            )
