"""Checks of a spec against its model: config lookup (offline), family, token math, fit in ctx_len.

They run on whatever part of the spec parsed, so a typo in one section does not hide a problem
in another.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from qeff_vision import families, hub
from qeff_vision.contract.video_pruning import OPTION
from qeff_vision.errors import UserError, shown
from qeff_vision.families.base import Family, ModelDescription, describe_checkpoint
from qeff_vision.families.layout import JoinedImages
from qeff_vision.hub import HUB_ID_PATTERN, cached_config
from qeff_vision.spec.policy import FIXED, WholeImages
from qeff_vision.spec.schema import Reader, VisionInput, image_label
from qeff_vision.spec.strict_yaml import yaml_path


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


def describe_model(
    reader: Reader,
    spec_dir: Path,
    model: str,
    config: str | None,
    revision: str | None = None,
    *,
    fetch: bool = False,
) -> tuple[ModelDescription | None, Path | None, Path | None]:
    """Read the config (pinned snapshot, checkpoint or Hugging Face cache).

    Without ``fetch`` this never touches the network (``validate``, ``specialize``): a Hub id
    needs ``config:`` or a cached copy. With it (``compile``), a Hub id without either has its
    small files (config, processor, tokenizer) downloaded through :mod:`qeff_vision.hub`.
    """
    candidate = _local(spec_dir, model)
    model_dir = candidate if _exists(candidate, "dir") else None
    if model_dir is None and not HUB_ID_PATTERN.fullmatch(model):
        reader.add(
            "model", f"{shown(model)} is neither a directory (relative to the spec) nor a Hugging Face id"
        )
        return None, None, None
    if model_dir is not None and revision is not None:
        reader.add("revision", f"{model_dir} is a directory; a revision applies to a Hugging Face id only")
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
        config_path = cached_config(model, revision)
        if config_path is None and fetch:
            try:
                config_path = hub.resolve(model, revision, weights=False).directory / "config.json"
            except UserError as exc:
                reader.add("model", str(exc))
                return None, None, None
        if config_path is None:
            reader.add(
                "model",
                f"{shown(model)} is a Hugging Face id with no local copy; add `config:` with a "
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


def resolve_family(
    reader: Reader, model: ModelDescription, name: str | None, config_key: str
) -> Family | None:
    """The family inferred from the config, or the one named by ``family:`` if it accepts the config."""
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


def check_model(
    reader: Reader, warnings: list[str], family: Family, model: ModelDescription, ctx_len: int | None
) -> None:
    """The config reads into the family's typed view; warn when ``ctx_len`` exceeds the model's positions."""
    try:
        family.config_view(model)  # every required field, language and vision alike
    except UserError as exc:
        reader.add("config", str(exc))
        return
    try:
        dims = family.text_dims(model)
    except (ArithmeticError, TypeError, ValueError) as exc:
        reader.add("config", f"unusable language config: {exc}")
        return
    if ctx_len is not None and 0 < dims.max_position_embeddings < ctx_len:
        warnings.append(
            f"ctx_len: {ctx_len} exceeds the model's max_position_embeddings {dims.max_position_embeddings}"
        )


def check_images(
    reader: Reader,
    warnings: list[str],
    family: Family,
    model: ModelDescription,
    vision: VisionInput,
    seq_lens: tuple[int, ...] | None,
    ctx_len: int | None,
) -> None:
    """Each image against the family (aspect ratio, token math) and ``ctx_len``; the vision-size policy.

    Errors: a ``vision_size`` for a family without a dynamic one, images the family rejects, an
    image whose tokens x ``max_images`` do not fit ``ctx_len``, an image no bucket can hold whole
    for a family that cannot split images across chunks. Warning: an image with more tokens than
    a fixed vision size (its placeholders must be chunked).
    """
    policy, max_images = vision.policy, vision.max_images
    if vision.policy_given and not family.features.dynamic_vision_size.supported:
        reader.add(
            "vision.vision_size",
            f"family {family.name} has no dynamic vision size "
            f"({family.features.dynamic_vision_size.note}); remove this key",
        )
    rate = vision.video_pruning_rate
    if rate and not family.features.video_pruning.supported:
        reader.add(
            f"vision.{OPTION}",
            f"{family.title} does not prune video tokens "
            f"({family.features.video_pruning.note}); remove this key",
        )
        rate = 0.0
    elif rate and not any(image.video for _, image in vision.images):
        reader.add(f"vision.{OPTION}", "prunes clips, but vision.videos lists none")
    tokens: dict[int, int] = {}
    for index, image in vision.images:
        here = yaml_path("vision.images", index)
        try:
            found = family.validate_image(model, image)
            if not found:
                tokens[index] = family.language_rows(model, image, rate)
        except (ArithmeticError, ValueError, TypeError, UserError) as exc:
            found = [f"token math failed for {image_label(image)}: {exc}"]
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
                f"{image_label(labels[index])} becomes {count} image tokens{per_request}, which does not fit "
                f"ctx_len {ctx_len} (must be smaller, leaving room for text)",
            )
        if policy is not None and policy.kind == FIXED and count > policy.size:
            warnings.append(
                f"{here}: {image_label(labels[index])} becomes {count} image tokens, more than vision_size "
                f"{policy.size}: its placeholders must be split over several chunks (chunking required)"
            )
    if not (seq_lens and tokens and policy and max_images):
        return
    check_chunk_rules(reader, family, model, labels, tokens, policy, max_images, seq_lens)


def _bucket_text(buckets: dict[int, int], rows: bool = True) -> str:
    if not rows:
        return "seq_len: " + ", ".join(str(s) for s in sorted(buckets))
    return "seq_len/vision_size: " + ", ".join(f"{s}/{v}" for s, v in sorted(buckets.items()))


def _needed(span: int, rows: int, per_chunk_rows: bool) -> str:
    return f"seq_len >= {span}" + (f" and vision_size >= {rows}" if per_chunk_rows else "")


def check_chunk_rules(reader, family, model, labels, tokens, policy, max_images, seq_lens) -> None:
    """What a family keeps in one chunk must fit one prefill bucket, for every declared combination.

    The run-time planner (:mod:`qeff_vision.runtime.planner`, ``_check_images_fit`` and
    ``_check_groups_fit``) refuses a prompt whose whole image (a family that cannot split one:
    Gemma 3's and Gemma 4's bidirectional images, mllama's tiles) or joined images (Molmo2: every
    image token attends to every other, so a prompt's images and the text between them are one
    chunk) need more tokens or rows than any bucket holds. A spec declaring such a prompt would
    validate and compile, then refuse requests it declared: so each listed image, and for a
    joining family every combination of up to ``max_images`` listed images, needs one bucket S
    with S >= its tokens (its extent: placeholders plus the tokens between them) and V(S) >= its
    rows, V as the specializations compute it. Clips are neither split nor joined here.
    """
    splits = family.splits_images(model)
    joins = family.capability(JoinedImages) is not None  # this module owns JoinedImages
    if splits and not joins:
        return  # nothing is kept whole: any prompt chunks at any bucket
    request = max(tokens.values()) * max_images
    whole = None
    if not splits:
        whole = WholeImages.for_family(family, tuple(tokens.values()), max_images)
    buckets = {s: policy.for_bucket(s, request, whole) for s in seq_lens}
    # A decoder without vision_size (cross-attention) takes a chunk's images whatever their rows.
    rows_per_chunk = family.features.dynamic_vision_size.supported
    if not rows_per_chunk:
        buckets = {s: request for s in seq_lens}

    def fits(span: int, rows: int) -> bool:
        return any(s >= span and (v >= rows or not rows_per_chunk) for s, v in buckets.items())

    extents = {index: family.image_extent(model, labels[index]) for index in tokens}
    if not splits:
        for index, count in tokens.items():
            if not fits(extents[index], count):
                reader.add(
                    yaml_path("vision.images", index),
                    f"{image_label(labels[index])} is {extents[index]} tokens ({count} image rows) and "
                    f"{family.name} cannot split an image across chunks "
                    f"({family.features.chunk_split.note}), "
                    f"but no prefill bucket holds it ({_bucket_text(buckets, rows_per_chunk)}): add a "
                    f"bucket with {_needed(extents[index], count, rows_per_chunk)}",
                )
                return
    if joins and max_images > 1:
        text = _bucket_text(buckets, rows_per_chunk)
        _check_joined_images(
            reader, family, model, labels, tokens, extents, max_images, text, fits, rows_per_chunk
        )


def _check_joined_images(
    reader, family, model, labels, tokens, extents, max_images, text, fits, per_chunk_rows
):
    """Every combination of 2..``max_images`` listed images, one joined run, must fit one bucket."""
    still = sorted(i for i in tokens if not labels[i].video)
    worst = None
    for count in range(2, max_images + 1):
        between = sum(family.tokens_before_image(model, number) for number in range(2, count + 1))
        for combination in itertools.combinations_with_replacement(still, count):
            span = sum(extents[i] for i in combination) + between
            rows = sum(tokens[i] for i in combination)
            if not fits(span, rows) and (worst is None or (span, rows) > worst[:2]):
                worst = (span, rows, combination)
        if worst is not None:
            break  # the fewest images that fail: the combination a user meets first
    if worst is None:
        return
    span, rows, combination = worst
    shown_images = " + ".join(image_label(labels[i]) for i in combination)
    reader.add(
        "vision.max_images",
        f"{len(combination)} images ({shown_images}) are one run of {span} tokens ({rows} image rows): "
        f"{family.name} keeps a prompt's images in one chunk, but no prefill bucket holds it "
        f"({text}): add a bucket with {_needed(span, rows, per_chunk_rows)}, or lower max_images",
    )


def video_pruning_notes(family: Family, model: ModelDescription, vision) -> list[str]:
    """One note per clip of a spec with a video pruning rate: the rows it keeps, known before encoding.

    Args:
        family: The spec's family.
        model: The checkpoint description.
        vision: The spec's :class:`~qeff_vision.spec.model.VisionSpec`.
    """
    rate = vision.video_pruning_rate
    if not rate:
        return []
    notes = []
    for image in vision.images:
        if image.video:
            full, kept = family.image_tokens(model, image), family.language_rows(model, image, rate)
            notes.append(
                f"{OPTION} {rate}: a {image_label(image)} clip keeps {kept} of its {full} rows (the "
                "count depends only on its grid and the rate, so vision_size and the chunk table are "
                f"sized for {kept}; the vision program still encodes all {full})"
            )
    return notes
