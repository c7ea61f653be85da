"""``vision.patch_buckets``: checks, and what each bucket admits (pure; the family does the token math).

A patch bucket is a vision specialization on a patch count instead of a resolution: any image
whose patches fit it is encoded at its own resolution, and several images share one call when
their patches fit together. An image larger than the largest bucket is downscaled by the
processor's own rule with its pixel bound set to that bucket (aspect ratio kept).
"""

from __future__ import annotations

from qeff_vision.families.base import Family, ImageSize, ModelDescription
from qeff_vision.spec.strict_yaml import yaml_path

HERE = "vision.patch_buckets"
# Aspect ratios (height:width) shown by `validate` for the largest image a bucket admits.
ASPECTS = ((1, 1), (3, 4), (9, 16), (16, 9), (1, 4), (4, 1))
# A side long enough that the processor's pixel bound, not the side, limits the image.
PROBE = 100_000


def check_patch_buckets(
    reader,
    warnings: list[str],
    family: Family,
    model: ModelDescription,
    buckets: tuple[int, ...],
    max_images: int | None,
    ctx_len: int | None,
) -> None:
    """Errors: a family without patch buckets, a bucket the family cannot take, a request too long.

    Warning: a bucket no image of the processor's ``max_pixels`` can fill (compiled, never full).
    """
    capability = family.patch_buckets
    if capability is None:
        reader.add(HERE, f"family {family.name} has no patch-bucket vision program; list vision.images")
        return
    for index, patches in enumerate(buckets):
        for problem in capability.bucket_problems(model, patches):
            reader.add(yaml_path(HERE, index), problem)
    if not buckets:
        return
    largest = capability.max_patches(model)
    for patches in buckets:
        if patches > largest:
            warnings.append(
                f"{HERE}: bucket {patches} is larger than any image the processor produces "
                f"(max_pixels gives at most {largest} patches): no single image fills it"
            )
    tokens = capability.bucket_symbols(model, min(max(buckets), largest))["vision_size"]
    if ctx_len is not None and max_images is not None and tokens * max_images >= ctx_len:
        reader.add(
            HERE,
            f"the largest bucket admits {tokens} image tokens per image x {max_images} image(s) per request, "
            f"which does not fit ctx_len {ctx_len}",
        )


def largest_image(
    family: Family, model: ModelDescription, patches: int, aspect: tuple[int, int]
) -> ImageSize:
    """The largest image of ``aspect`` (height:width) a bucket of ``patches`` takes unresized."""
    height, width = aspect
    scale = PROBE / max(height, width)
    fitted = family.patch_buckets.fit_to_patches(
        model, ImageSize(round(height * scale), round(width * scale)), patches
    )
    return ImageSize(*fitted)


def admission_lines(family: Family, model: ModelDescription, buckets: tuple[int, ...]) -> list[str]:
    """One line per bucket: image tokens, and the largest image per aspect ratio it admits unresized."""
    lines = []
    for patches in buckets:
        tokens = family.patch_buckets.bucket_symbols(model, patches)["vision_size"]
        largest = ", ".join(
            f"{h}:{w} {image.height}x{image.width}"
            for (h, w) in ASPECTS
            for image in [largest_image(family, model, patches, (h, w))]
        )
        lines.append(
            f"patch bucket {patches}: up to {tokens} image tokens per call (images packed while they fit); "
            f"largest image per aspect ratio (height:width height x width): {largest}"
        )
    top = max(buckets)
    lines.append(
        f"images with more than {top} patches are downscaled to fit bucket {top} (aspect ratio kept)"
    )
    return lines
