"""Named layout capabilities: the prompt and program layouts a family lists instead of setting flags.

A family's token layout or program layout sometimes departs from the common one: one image's
placeholders come in several runs, a prompt's images share one chunk, the composed single
program gates its encoder on another axis. Each departure is a small frozen object the family
lists in :attr:`Family.layout <qeff_vision.families.base.Family.layout>`, and each is read by the
one module that implements it (its ``owner``), like the per-layer state kinds of
:mod:`qeff_vision.contract.states`. Generic code asks :meth:`Family.capability
<qeff_vision.families.base.Family.capability>` for the object; no generic module reads a layout
flag off the family (tests/test_family_surface.py greps for them).

``owns`` names the family callables a capability brings with it: a family that lists the
capability may override them, and the declaration-surface count (tests/test_family_surface.py,
docs/guide/family-declaration.md) books them to the capability, not to the family's core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qeff_vision import symbols


@dataclass(frozen=True)
class Capability:
    """Base of a named layout capability (a family lists instances in ``Family.layout``)."""

    #: The module that implements the capability (the only generic reader of its fields).
    owner: ClassVar[str] = ""
    #: Family callables (``Family``, ``Host`` or ``ExportAdapter`` methods) the capability brings.
    owns: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class ImageMarkers(Capability):
    """Marker tokens the processor always puts between the placeholder spans of two images.

    Only a family that keeps images whole needs it: the ``chunk`` vision-size policy then sizes a
    bucket for the whole images that really fit in it (docs/decisions/027).

    Attributes:
        between: The fewest tokens between two images' spans (Gemma 3's ``<end_of_image>`` and the
            next ``<start_of_image>``: 2).
    """

    between: int = 0

    owner: ClassVar[str] = "qeff_vision.spec.policy (WholeImages)"


@dataclass(frozen=True)
class PlaceholderRuns(Capability):
    """One image's placeholders are several runs with other tokens between them.

    Mistral 3 ends each row of image tokens with ``[IMG_BREAK]``, Llama 4 separates tiles, a
    Qwen3-VL clip puts a timestamp before each frame. The host joins consecutive runs into an item
    by its row count (``find_segments(..., multi_run=True)``).
    """

    owner: ClassVar[str] = "qeff_vision.contract.segments (find_segments)"
    owns: ClassVar[tuple[str, ...]] = ("image_extent",)  # placeholders plus the breaks between runs


@dataclass(frozen=True)
class JoinedImages(Capability):
    """A prompt's images share one chunk, with the tokens between them (Molmo2).

    Every image token attends to every other one across images, so the host marks each image
    after the first ``joined`` and the spec checks that ``max_images`` of them fit one bucket;
    ``Family.tokens_before_image`` counts the separator text a family writes between them.
    """

    owner: ClassVar[str] = "qeff_vision.spec.checks (_check_joined_images)"
    owns: ClassVar[tuple[str, ...]] = ("tokens_before_image", "segments")


@dataclass(frozen=True)
class SingleProgramGate(Capability):
    """How ``deployment: single`` composes the vision graph into the language program.

    Attributes:
        encode_axis: The axis of the vision graph's first (pixel) input whose extent is 1 in a keep
            specialization and larger in every encode one: the image side (the last axis of
            [..., C, H, W]) by default; a patch-sequence graph names its patch axis. A pixel input
            without the image-count axis concatenates a call's images on it.
        images_symbol: The vision graph's symbol that counts the images of one call (named
            ``num_images`` in the composed program); mllama's vision graph leads with the
            language batch and names another.
    """

    encode_axis: int = -1
    images_symbol: str = symbols.BATCH_SIZE

    owner: ClassVar[str] = "qeff_vision.compile.single_program (compose)"
    owns: ClassVar[tuple[str, ...]] = ("fixed_pixel_side",)


#: Every layout capability, in the order the guide lists them.
CAPABILITIES: tuple[type[Capability], ...] = (ImageMarkers, PlaceholderRuns, JoinedImages, SingleProgramGate)


#: Family callables that come with an optional capability declared elsewhere than ``layout``: the
#: ``video_pruning`` feature, the patch-bucket vision program (``Family.patch_bucket_capability``;
#: its host and adapter methods are duck-typed), the cross-attention decoder kind. A family that
#: declares the capability may override them; the surface count books them to it.
DECLARED_CAPABILITY_CALLABLES: dict[str, tuple[str, ...]] = {
    "video_pruning": ("language_rows", "pruning_grids", "pruned_positions", "hf_pruned_encoder_outputs"),
    "patch_buckets": (
        "patch_count",
        "bucket_symbols",
        "bucket_problems",
        "fit_to_patches",
        "max_patches",
        "patch_layout",
        "pack_vision_inputs",
        "item_patches",
        "item_rows",
        "patch_bucket_encoder",
        "patch_bucket_example_inputs",
    ),
    "cross-attention": ("vision_outputs", "request_symbols", "language_decoder"),
}


def declared_capabilities(family) -> dict[str, tuple[str, ...]]:
    """Name -> the callables it brings, of every capability ``family`` lists or declares."""
    found = {type(item).__name__: type(item).owns for item in family.layout}
    if family.features.video_pruning.supported:
        found["video_pruning"] = DECLARED_CAPABILITY_CALLABLES["video_pruning"]
    if family.patch_bucket_capability is not None:
        found["patch_buckets"] = DECLARED_CAPABILITY_CALLABLES["patch_buckets"]
    kind = family.decoder_kind.name  # token-merge brings nothing; cross-attention its K/V program
    if kind in DECLARED_CAPABILITY_CALLABLES:
        found[kind] = DECLARED_CAPABILITY_CALLABLES[kind]
    return found
