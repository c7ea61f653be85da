"""Declarative description of a vision-language model family.

A family is data plus a little token math: which Hugging Face architectures it accepts, how its
config names map to normalized dimensions, the symbolic axes of its two programs, how many
vision tokens an image of a given resolution becomes, and which features it supports. Nothing in
this module imports torch; the torch side of a family lives in its ``export`` module and is
imported only when a graph is built (see :class:`FamilyParts` and :meth:`Family.adapter`).

:class:`Family` is written in three parts, one idea each: this module (what the family is, its
parts and its token math), :mod:`~qeff_vision.families.config_reading` (reading a checkpoint's
configs into the typed view) and :mod:`~qeff_vision.families.language_declarations` (per-layer
caches and the language IO table). Families import every name they use from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from qeff_vision import symbols
from qeff_vision.contract.decoder_kinds import (  # noqa: F401 - decoder kinds re-exported for families
    CROSS_ATTENTION,
    TOKEN_MERGE,
    DecoderKind,
)
from qeff_vision.contract.language_io import (  # noqa: F401 - layer types re-exported for families
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    HEAD_DIM,
    HIDDEN_SIZE,
    LINEAR_ATTENTION,
    NUM_KV_HEADS,
    RECURRENT,
    SLIDING_ATTENTION,
    VOCAB_SIZE,
    IORow,
    LanguageIO,
    LayerState,
    Role,
    language_io,
)
from qeff_vision.contract.tasks import EMBED, GENERATE, SCORE  # noqa: F401 - task names re-exported
from qeff_vision.families.config_reading import FamilyConfig, TextDims  # noqa: F401 - TextDims re-exported
from qeff_vision.families.description import ModelDescription, describe_checkpoint  # noqa: F401
from qeff_vision.families.features import (  # noqa: F401 - the feature vocabulary, re-exported
    DISAGGREGATED_PROGRAMS,
    EVS_VIDEO_PRUNING,
    NO_DEEPSTACK,
    NO_VIDEO_PRUNING,
    NOT_DECLARED,
    QEFFICIENT_CCL,
    QEFFICIENT_CONTINUOUS_BATCHING,
    Features,
    Support,
    bidirectional,
    no,
    single_program_not_built,
    yes,
)
from qeff_vision.families.language_declarations import FamilyLanguageIO
from qeff_vision.families.layout import (  # noqa: F401 - layout capabilities re-exported for families
    Capability,
    ImageMarkers,
    JoinedImages,
    PlaceholderRuns,
    SingleProgramGate,
)

C = TypeVar("C", bound=Capability)

if TYPE_CHECKING:
    from qeff_vision.families.host import Host


@dataclass(frozen=True)
class ImageSize:
    """An image resolution the user wants compiled (height and width in pixels, before resizing)."""

    height: int
    width: int
    frames: int = 1
    video: bool = False  # a clip of ``frames`` frames (``vision.videos``), not a still image


@dataclass(frozen=True)
class FamilyParts:
    """The parts of a registered family besides its description (see :func:`~qeff_vision.families.register`).

    Attributes:
        host: The family's host-protocol class (numpy only).
        adapter: Zero-argument loader of the export adapter class; it imports torch, so it runs
            only when a graph is built.
        tiny: ``tiny(out_dir, seed=0) -> Path``: writes a tiny random checkpoint of the family.
    """

    host: type[Host]
    adapter: Callable[[], type]
    tiny: Callable[..., Path]


class Family(FamilyConfig, FamilyLanguageIO):
    """Base class of a model family description. Subclasses set the class attributes and token math.

    The class attributes of its other two parts are set the same way: the config keys and stated
    defaults (:class:`~qeff_vision.families.config_reading.FamilyConfig`) and the language
    program's shape-giving data (:class:`~qeff_vision.families.language_declarations.FamilyLanguageIO`:
    ``position_id_rows``, ``stacked_vision_rows``, ``extra_language_inputs``, ``decoder_kind``).

    Class attributes:
        name: Registry key and CLI value (``qwen2_5_vl``).
        title: Human name for tables.
        architectures: ``config.architectures`` values this family accepts.
        model_types: ``config.model_type`` values this family accepts.
        features: The feature matrix.
        parts: Host class, export-adapter loader and tiny builder, set by registration.
        vision_input_axes: Vision-program inputs and their symbolic axes.
        layout: The named layout capabilities the family lists (:mod:`qeff_vision.families.layout`:
            marker tokens between images, placeholders in runs, joined images, the single
            program's encode gate), each read by the one module that owns it; none by default.
        tasks: Spec ``task`` values the family's language program can be built for
            (:mod:`qeff_vision.contract.tasks`): ``generate`` always; ``embed`` / ``score`` (the
            pooling programs) only where declared and checked against transformers.
        vllm_score_overrides: ``hf_overrides`` with which vLLM's pooling runner loads the family's
            reranker as a yes/no sequence classifier (printed for ``task: score``).
    """

    name: str = ""
    title: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    features: Features
    parts: FamilyParts | None = None
    vision_input_axes: Mapping[str, Mapping[int, str]] = {}
    layout: tuple[Capability, ...] = ()
    tasks: tuple[str, ...] = (GENERATE,)
    vllm_score_overrides: Mapping[str, Any] | None = None

    def capability(self, kind: type[C]) -> C | None:
        """The listed :attr:`layout` capability of class ``kind``, or None when the family lists none."""
        return next((item for item in self.layout if isinstance(item, kind)), None)

    @property
    def single_program_gate(self) -> SingleProgramGate:
        """The listed :class:`~qeff_vision.families.layout.SingleProgramGate`, else the default one."""
        return self.capability(SingleProgramGate) or SingleProgramGate()

    # Read-only views of the capabilities under their former attribute names (what tests and
    # family code read); generic modules ask :meth:`capability` (tests/test_family_surface.py).

    @property
    def vision_images_symbol(self) -> str:
        """The vision graph's image-count symbol (:attr:`SingleProgramGate.images_symbol`)."""
        return self.single_program_gate.images_symbol

    @property
    def single_encode_axis(self) -> int:
        """The single program's encode axis (:attr:`SingleProgramGate.encode_axis`)."""
        return self.single_program_gate.encode_axis

    @property
    def joins_images(self) -> bool:
        """The family lists :class:`~qeff_vision.families.layout.JoinedImages`."""
        return self.capability(JoinedImages) is not None

    @property
    def placeholders_in_runs(self) -> bool:
        """The family lists :class:`~qeff_vision.families.layout.PlaceholderRuns`."""
        return self.capability(PlaceholderRuns) is not None

    @property
    def tokens_between_images(self) -> int:
        """:attr:`ImageMarkers.between` of the listed markers (0 without)."""
        markers = self.capability(ImageMarkers)
        return 0 if markers is None else markers.between

    #: Optional capability: the family's :class:`PatchBuckets` subclass (a vision program on patch
    #: counts, several images packed per call). None: ``vision.patch_buckets`` is refused.
    patch_bucket_capability: type[PatchBuckets] | None = None
    #: Symbols the family named otherwise before it took QEfficient's names (former -> current).
    #: An export or compile that still binds a former one is refused (or re-exported) by name
    #: instead of failing later on a symbol nothing binds.
    former_symbols: Mapping[str, str] = {}
    #: Symbols the family's graphs no longer have under any name (former -> what replaced them, in
    #: words). Refused (or re-exported) as :attr:`former_symbols` are.
    retired_symbols: Mapping[str, str] = {}

    def former_symbol_note(self, names: Iterable[str]) -> str | None:
        """``symbol 'old' (now 'new')`` for the first former or retired symbol among ``names``, else None."""
        found = sorted(set(names) & set(self.former_symbols))
        if found:
            return f"{self.title}'s former symbol {found[0]!r} (now {self.former_symbols[found[0]]!r})"
        retired = sorted(set(names) & set(self.retired_symbols))
        if retired:
            return f"{self.title}'s former symbol {retired[0]!r} ({self.retired_symbols[retired[0]]})"
        return None

    #: Image-processor options a spec may set (``vision.image_processor``): name -> allowed values
    #: (Gemma 4's ``max_soft_tokens``). The spec's token math reads them over the checkpoint's
    #: processor config, and compile writes them into OUT's copy of it, so ``run`` processes
    #: images exactly as the vision specializations were compiled.
    image_processor_options: Mapping[str, tuple[int, ...]] = {}

    @property
    def bidirectional_images(self) -> bool:
        """Placeholders of one image attend to each other both ways (declared by ``chunk_split``)."""
        return self.features.chunk_split.bidirectional_images

    def _parts(self) -> FamilyParts:
        if self.parts is None:
            raise TypeError(f"family {self.name!r} is not registered (no host, adapter or tiny builder)")
        return self.parts

    def host(self, model: ModelDescription) -> Host:
        """The host protocol of this family for ``model`` (a :class:`~qeff_vision.families.host.Host`)."""
        return self._parts().host(self, model)

    def adapter(self):
        """The family's export adapter (imports torch): an ``ExportAdapter`` holding this family."""
        return self._parts().adapter()(self)

    def write_tiny_checkpoint(self, out_dir: str | Path, seed: int = 0) -> Path:
        """Write a tiny random-weight checkpoint of this family to ``out_dir``."""
        return self._parts().tiny(out_dir, seed)

    def splits_images(self, model: ModelDescription) -> bool:
        """Whether ``model``'s image placeholders may be split across prefill chunks.

        The family's ``chunk_split`` feature by default. A family whose image attention depends on
        the checkpoint (Gemma 4: bidirectional on sliding layers only with
        ``use_bidirectional_attention == "vision"``) reads it here; the planner, the spec checks
        and the specializations ask this, not the feature.
        """
        return self.features.chunk_split.supported

    # ---- token math (subclasses) ----

    def vision_symbols(self, model: ModelDescription, image: ImageSize) -> dict[str, int]:
        """Values of every symbolic vision-program dimension for one image (batch excluded).

        Must include ``vision_size``: the vision tokens of one image including frames.
        """
        raise NotImplementedError

    def fixed_pixel_side(self, model: ModelDescription) -> int | None:
        """The vision graph's pixel side when it is fixed (not a symbol), else None.

        ``deployment: single`` renames a fixed side to a symbol so its encode entries bind it
        (compile/single_program.py ``PIXEL_SIDE``).
        """
        return None

    def image_tokens(self, model: ModelDescription, image: ImageSize) -> int:
        """Placeholder tokens (= vision_embeds rows) one image of this size becomes."""
        return self.vision_symbols(model, image)[symbols.VISION_SIZE]

    def language_rows(
        self, model: ModelDescription, image: ImageSize, video_pruning_rate: float = 0.0
    ) -> int:
        """Rows (= placeholders) an image or clip takes in the prompt at a video pruning rate.

        Its :meth:`image_tokens`; a family declaring ``video_pruning`` gives a pruned clip's kept
        rows, which depend only on the grid and the rate (so ``specialize`` sizes for them).
        """
        return self.image_tokens(model, image)

    def tokens_before_image(self, model: ModelDescription, number: int) -> int:
        """Most prompt tokens the processor puts between image ``number - 1``'s span and image ``number``'s.

        What the spec checks add between joined images (:class:`JoinedImages`): by default the
        listed :class:`ImageMarkers`. A family whose separator is text (Molmo2's ``Image N``)
        counts it with the checkpoint's tokenizer, or bounds it without one.

        Args:
            model: The checkpoint.
            number: The later image's number in the prompt, from 2.
        """
        return self.tokens_between_images

    def image_extent(self, model: ModelDescription, image: ImageSize) -> int:
        """Prompt tokens from an image's first placeholder to its last.

        Its placeholders, plus the break tokens between them in a family with :class:`PlaceholderRuns`.
        """
        return self.image_tokens(model, image)

    def validate_image(self, model: ModelDescription, image: ImageSize) -> list[str]:
        """Problems with compiling ``image`` for this family (empty when fine)."""
        return []

    def vision_attention(self, model: ModelDescription, values: Mapping[str, int], policy) -> Any:
        """The vision program's largest attention at one specialization's symbol ``values``.

        A :class:`~qeff_vision.contract.attention_blocking.VisionAttention` (its ``blocks`` as the
        export's ``policy`` gives them), or None when the family declares none. ``validate`` and
        the golden files estimate the score bytes from it; ``compile`` measures the graph.
        """
        return None

    # ---- optional capabilities ----

    @property
    def patch_buckets(self) -> PatchBuckets | None:
        """The family's patch-bucket vision program (:attr:`patch_bucket_capability`), or None."""
        capability = self.patch_bucket_capability
        return None if capability is None else capability(self)

    @property
    def supports_patch_buckets(self) -> bool:
        """The family has a patch-bucket vision program."""
        return self.patch_bucket_capability is not None

    def vision_io(self, model: ModelDescription, patch_buckets: bool = False):
        """(input axes, output axes) of the vision program in the given mode."""
        if patch_buckets and self.patch_buckets is not None:
            return dict(self.patch_buckets.input_axes), dict(self.patch_buckets.output_axes)
        return dict(self.vision_input_axes), self.vision_outputs(model)


def tower_value(
    model: ModelDescription, names: Iterable[str], default: int, section: str = "vision_config"
) -> int:
    """An integer of the vision tower's config: the first of ``names`` set, else transformers' default.

    A pair (``[14, 14]``) gives its first element.
    """
    config = model.config.get(section) or {}
    for name in names:
        value = config.get(name)
        if value is not None:
            return int(value[0] if isinstance(value, (list, tuple)) else value)
    return default


def count_symbol(values: Mapping[str, int], name: str) -> int:
    """A count symbol of a specialization (images, frames, tiles); 1 when the graph has none."""
    return int(values[name]) if name in values else 1


class PatchBuckets:
    """Optional capability: a vision program specialized on a patch count instead of a resolution.

    For towers that take any resolution: several images are packed per call into a bucket of
    patches. A family that has it sets :attr:`Family.patch_bucket_capability` to its subclass;
    its host then also packs images (``patch_layout``, ``pack_vision_inputs``, ``item_patches``,
    ``item_rows``) and its export adapter builds the program (``patch_bucket_encoder``,
    ``patch_bucket_example_inputs``). Families without it have nothing to override.

    Args:
        family: The family whose token math the buckets follow.
    """

    #: Inputs and outputs of the patch-bucket vision program and their symbolic axes.
    input_axes: Mapping[str, Mapping[int, str]] = {}
    output_axes: Mapping[str, Mapping[int, str]] = {}

    def __init__(self, family: Family):
        self.family = family

    def patch_count(self, model: ModelDescription, image: ImageSize) -> int:
        """Patches an image occupies in a bucket at its own (processor-resized) resolution."""
        raise NotImplementedError

    def bucket_symbols(self, model: ModelDescription, patches: int) -> dict[str, int]:
        """Values of the patch-bucket program's symbols for a bucket of ``patches`` (vision_size included)."""
        raise NotImplementedError

    def bucket_problems(self, model: ModelDescription, patches: int) -> list[str]:
        """Why ``patches`` cannot be a bucket (empty when it can)."""
        return []

    def fit_to_patches(self, model: ModelDescription, image: ImageSize, patches: int) -> tuple[int, int]:
        """(height, width) the processor's own resize gives with its pixel bound set to ``patches``."""
        raise NotImplementedError

    def max_patches(self, model: ModelDescription) -> int:
        """Patches of the largest image the processor produces."""
        raise NotImplementedError
