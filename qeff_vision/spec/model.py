"""The validated spec: what one YAML file asks for, as frozen data (see ``load_spec``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qeff_vision.contract.tasks import GENERATE
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.spec.compile_options import CompileOptions
from qeff_vision.spec.deployment import Deployment
from qeff_vision.spec.hardware import AI200
from qeff_vision.spec.policy import VisionSizePolicy
from qeff_vision.spec.weights import WeightsSpec

DTYPES = ("float32", "float16")
FLAT = "flat"
NAMED = "named"
AUTO = "auto"
LAYOUTS = (FLAT, NAMED, AUTO)


@dataclass(frozen=True)
class PrefillSpec:
    """The ``prefill:`` section.

    Attributes:
        seq_lens: Prefill chunk buckets, ascending; one language specialization each.
    """

    seq_lens: tuple[int, ...]


@dataclass(frozen=True)
class VisionSpec:
    """The ``vision:`` section.

    Attributes:
        images: Image resolutions to compile; one vision specialization each (resolutions the
            family resizes to the same grid share one).
        max_images: Images one request may carry.
        vision_size: The vision-size policy of the language specializations.
        vision_size_given: ``vision.vision_size`` was written in the spec (not defaulted).
        patch_buckets: Patch counts of the patch-bucket vision program (one specialization each,
            any image resolution); empty in resolution-list mode (``images``).
        image_processor: Image-processor options the spec sets (``vision.image_processor``, e.g.
            Gemma 4's ``max_soft_tokens``), as (name, value); the family declares which exist.
            The token math reads them, and compile writes them into OUT's processor config.
        video_pruning_rate: ``vision.video_pruning_rate`` (EVS; 0 = off): the language program is
            sized for clips of the rows they keep (:meth:`Family.language_rows`).
    """

    images: tuple[ImageSize, ...]
    max_images: int = 1
    vision_size: VisionSizePolicy = field(default_factory=VisionSizePolicy)
    vision_size_given: bool = False
    patch_buckets: tuple[int, ...] = ()
    image_processor: tuple[tuple[str, int], ...] = ()
    video_pruning_rate: float = 0.0


@dataclass(frozen=True)
class Spec:
    """A checked spec. Build one with :func:`qeff_vision.spec.load_spec`.

    Attributes:
        name: Spec name (the golden directory name); the file stem when not given.
        model: ``model:`` as written: a Hugging Face id or a directory.
        revision: ``revision:`` of a Hugging Face id (branch, tag or commit); ``None``: ``main``.
        family: Registered family name, given or inferred from the config.
        dtype: Floating dtype of the exported graphs (``float32`` or ``float16``).
        batch_size: Sequences per program run.
        ctx_len: KV-cache length in tokens.
        prefill: Prefill chunk buckets.
        vision: Images, images per request and the vision-size policy.
        layout: Specialization file layout: ``flat``, ``named`` or ``auto`` (follow the SDK).
        compile: Typed compiler options of both programs.
        source: The spec file.
        model_dir: ``model`` resolved to a local checkpoint directory; ``None`` for a hub id.
        config_path: The config.json the spec was checked against (pinned snapshot or checkpoint).
        model_description: That config (and image-processor config) as read, without torch.
        warnings: Things worth knowing that are not errors (e.g. an image needs more rows than a
            fixed vision size, so its placeholders must be chunked).
        full_batch_size: KV slots of a continuous-batching language program (``None``: not
            continuous batching). Prefill then runs at batch_size 1, decode at this batch size.
        deployment: ``deployment`` and ``kv_cache_prefix``: which programs are compiled.
        weights: How the export stores weights on disk (``dtype``, ``keep_quantized``).
        task: What the language program computes: ``generate`` (the KV-cache decoder, default),
            ``embed`` (the last token's L2-normalized hidden state) or ``score`` (the reranker's
            ``sigmoid(logit("yes") - logit("no"))``); the family declares which it supports. A
            pooling task has no KV cache and no decode specialization: a prompt runs in one call
            of the smallest prefill bucket that holds it, so ``prefill.seq_lens`` are prompt
            lengths and ``ctx_len`` the longest prompt (:mod:`qeff_vision.contract.tasks`).
    """

    name: str
    model: str
    family: str
    dtype: str
    batch_size: int
    ctx_len: int
    prefill: PrefillSpec
    vision: VisionSpec
    layout: str
    compile: CompileOptions
    source: Path
    model_dir: Path | None
    config_path: Path
    model_description: ModelDescription = field(repr=False, compare=False)
    warnings: tuple[str, ...] = ()
    full_batch_size: int | None = None
    deployment: Deployment = field(default_factory=Deployment)
    revision: str | None = None
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    task: str = GENERATE

    def weight_dtypes(self) -> dict[str, str]:
        """Stored dtype of each exported program's float weights (``vision``, ``lang``), from ``weights``."""
        return {
            "vision": self.weights.program_dtype(self.compute_dtype("vision")),
            "lang": self.weights.program_dtype(self.compute_dtype("language")),
        }

    def compute_dtype(self, program: str) -> str:
        """Dtype the device computes ``program`` (``vision``/``language``) in.

        bfloat16 on ai200; float16 when converting (ai100's ``-convert-to-fp16``) or exported so.
        """
        if self.compile.hardware == AI200:
            return "bfloat16"
        if self.dtype == "float16" or self.compile.program(program).convert_to_fp16:
            return "float16"
        return self.dtype
