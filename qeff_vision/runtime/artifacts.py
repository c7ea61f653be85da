"""A compile output directory as the runtime sees it: programs, their specializations, the checkpoint.

:func:`load_artifacts` opens a directory once: the manifest, the export record, the family, the
deployment object and the specializations are read there into one :class:`Artifacts`, and the
checkpoint (config, processor, chat template) is opened once on first use; what runs below
receives that object and reads none of them again.

``qeff-vision compile SPEC -o OUT`` writes ``OUT/manifest.json`` last (see
:mod:`qeff_vision.compile_record`). From it the runtime takes the backend, both programs and the
specializations they were compiled for, the export directory and, through the export's
``export.json``, the checkpoint whose config, processor and chat template drive generation.

On the ``onnxruntime`` backend the programs are the exported graphs, run by sessions that accept
only the compiled specializations (what a device enforces). The ``qaic`` backend needs the SDK's
runtime; without it opening the programs is one clear error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.compile_record import program_path, read_manifest
from qeff_vision.errors import UserError
from qeff_vision.export_record import read_export
from qeff_vision.families import Family, get_family
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.hub import HubReference, hub_record
from qeff_vision.runtime.backends import BACKENDS, DeviceRuntime, HostSession, backend_named
from qeff_vision.runtime.deployment import DEPLOYMENTS, Deployment, deployment_named
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generate import Generator, make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.spec.deployment import DUAL
from qeff_vision.spec.hardware import AI200


@dataclass(frozen=True)
class Artifacts:
    """What a finished compile directory holds, resolved to absolute paths.

    Attributes:
        out_dir: The compile output directory.
        manifest: ``OUT/manifest.json``.
        backend: ``qaic`` or ``onnxruntime``.
        family: The model family.
        model_dir: Where the runtime reads config, processor and chat template: ``OUT/model``
            (copied by compile), else the checkpoint the export came from.
        checkpoint_dir: The checkpoint with its weights (a transformers reference loads it); for
            an export of a Hugging Face id whose snapshot is not here, a
            :class:`~qeff_vision.hub.HubReference` to its commit (fetched when a reference is
            asked for); ``None`` when it is not here otherwise (OUT moved, checkpoint deleted).
        export_dir: The export directory.
        vision_path: The vision program (QPC directory or ONNX file).
        language_path: The language program.
        vision_specializations: Symbol values of each compiled vision specialization.
        language_specializations: Symbol values of each compiled language specialization.
        shape: Prefill buckets, decode vision size and ``ctx_len`` of the language program.
        resolutions: The image resolutions the spec compiled (before the processor's resize).
        patch_buckets: The patch counts of a patch-bucket vision program (empty: per resolution).
        phase_specializations: Disaggregated: (prefill, decode) specializations; else empty.
        mode: The deployment mode (:mod:`qeff_vision.runtime.deployment`): how the programs open
            and what the mode supports. Disaggregated: ``language_path`` is the decode program and
            ``language_specializations`` both programs' specializations.
        export_record: The export's ``export.json`` (empty when it cannot be read).
    """

    out_dir: Path
    manifest: Mapping[str, Any]
    backend: str
    family: Family
    model_dir: Path
    export_dir: Path
    checkpoint_dir: Path | HubReference | None
    vision_path: Path
    language_path: Path
    vision_specializations: tuple[dict[str, int], ...]
    language_specializations: tuple[dict[str, int], ...]
    shape: LanguageShape
    resolutions: tuple[ImageSize, ...]
    patch_buckets: tuple[int, ...] = ()
    phase_specializations: tuple[tuple[dict[str, int], ...], ...] = ()
    mode: Deployment = DEPLOYMENTS[DUAL]
    export_record: Mapping[str, Any] = field(default_factory=dict)
    #: The checkpoint, opened on first use and kept (the runtime files are read once).
    _opened: dict[str, Checkpoint] = field(default_factory=dict, compare=False, repr=False)

    @property
    def program_backend(self) -> HostSession | DeviceRuntime:
        """The object of :attr:`backend`: how programs open and where their state lives."""
        return BACKENDS[self.backend]

    def description(self) -> ModelDescription:
        """The checkpoint's config and image-processor config (no torch), read once."""
        return self.checkpoint().description

    def checkpoint(self) -> Checkpoint:
        """The checkpoint the programs were exported from, opened once."""
        if "checkpoint" not in self._opened:
            self._opened["checkpoint"] = Checkpoint.open(self.model_dir, self.family)
        return self._opened["checkpoint"]


def _refuse_former_symbols(manifest: Mapping[str, Any], where: str) -> None:
    """A compile whose specializations bind a symbol its family has since renamed: one user error."""
    try:
        family = get_family(manifest.get("family"))
        names = {
            name
            for program in (manifest.get("programs") or {}).values()
            for entry in (program or {}).get("specializations") or ()
            for name in (entry.get("symbols") or {})
        }
    except (UserError, AttributeError, TypeError):
        return  # an unknown family or malformed entries: the readers below say so in their words
    former = family.former_symbol_note(names)
    if former:
        raise UserError(f"{where}: compiled with {former}; compile it again (`qeff-vision compile`)")


def _export_dir(out_dir: Path, manifest: Mapping[str, Any]) -> Path:
    directory = Path((manifest.get("export") or {}).get("dir") or "export")
    return directory if directory.is_absolute() else out_dir / directory


def _export_record(export_dir: Path) -> Mapping[str, Any]:
    """``export.json``, or empty when it cannot be read (OUT moved without its export)."""
    try:
        return read_export(export_dir)
    except UserError:
        return {}


def _checkpoint_dir(record: Mapping[str, Any], manifest: Mapping[str, Any]) -> str | None:
    """The checkpoint recorded by the export (``export.json`` "model"), else the manifest's."""
    return record.get("model") or manifest.get("model_dir")


def _model_dir(
    out_dir: Path, export_dir: Path, record: Mapping[str, Any], manifest: Mapping[str, Any]
) -> Path:
    """OUT's copy of the runtime files (``manifest["runtime_model"]``), else the checkpoint."""
    copied = manifest.get("runtime_model")
    if copied and (out_dir / copied / "config.json").is_file():
        return out_dir / copied
    model = _checkpoint_dir(record, manifest)
    if _weights_dir(model) is None:
        raise UserError(
            f"{export_dir}: the checkpoint the programs were exported from ({model or 'not recorded'}) "
            "is not a checkpoint directory here; the runtime needs its config, processor and chat template"
        )
    return Path(model)


def _weights_dir(model: str | None) -> Path | None:
    """``model`` if it is a checkpoint directory here (with config.json), else None."""
    return Path(model) if model and (Path(model) / "config.json").is_file() else None


def _hub_reference(record: Mapping[str, Any], manifest: Mapping[str, Any]) -> HubReference | None:
    """The Hub id and commit the export (else the compile) recorded, if any."""
    found = hub_record(record) or hub_record(manifest)
    return HubReference(found["id"], found["commit"]) if found else None


def load_artifacts(out_dir: str | Path) -> Artifacts:
    """Read a compile output directory.

    Raises:
        UserError: No manifest (not compiled, or not finished), an unreadable one, or a missing
            checkpoint.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: no such directory; pass the output directory of `qeff-vision compile`")
    manifest = read_manifest(out_dir)
    backend = backend_named(manifest.get("backend"), out_dir / "manifest.json").name
    where = str(out_dir / "manifest.json")
    _refuse_former_symbols(manifest, where)
    mode = deployment_named(manifest.get("deployment", DUAL), where)
    family = get_family(manifest["family"])
    vision, language, phases = mode.specializations(manifest, where, family)
    if not vision or not language:
        raise UserError(f"{where}: a program has no specializations")
    export_dir = _export_dir(out_dir, manifest)
    record = _export_record(export_dir)
    images = (manifest.get("shapes") or {}).get("images") or []
    buckets = (manifest.get("shapes") or {}).get("patch_buckets") or []
    return Artifacts(
        out_dir=out_dir,
        manifest=manifest,
        backend=backend,
        family=family,
        model_dir=_model_dir(out_dir, export_dir, record, manifest),
        export_dir=export_dir,
        checkpoint_dir=_weights_dir(_checkpoint_dir(record, manifest)) or _hub_reference(record, manifest),
        vision_path=program_path(manifest, out_dir, mode.vision_program),
        language_path=program_path(manifest, out_dir, mode.language_program),
        vision_specializations=vision,
        language_specializations=language,
        shape=LanguageShape.from_specializations(language),
        resolutions=tuple(ImageSize(int(i["height"]), int(i["width"])) for i in images),
        patch_buckets=tuple(int(count) for count in buckets),
        phase_specializations=phases,
        mode=mode,
        export_record=record,
    )


PRECISIONS = ("fp32", "device", "device-mx")


def device_plan(artifacts: Artifacts, program: str) -> list[str] | None:
    """Node outputs ``program`` keeps in fp32 at device precision; None when it compiles in fp32.

    An ai200 program computes in bfloat16: a :class:`~qeff_vision.numerics.device.Bf16Values`
    (its emulation rounds every value to bf16).

    Read from the plan file the manifest names (``node_precision.path``); no file means no node.
    """
    from qeff_vision.numerics.device import Bf16Values
    from qeff_vision.numerics.plan import read_plan

    entry = artifacts.manifest["programs"][program]
    options = entry.get("options") or {}
    if options.get("aic_hw_version") == AI200:  # bfloat16 compute: every value rounded, none kept fp32
        return Bf16Values()
    if not options.get("convert_to_fp16", True):
        return None
    plan = entry.get("node_precision") or {}
    if not plan.get("path"):
        return []
    path = Path(plan["path"])
    return read_plan(path if path.is_absolute() else artifacts.out_dir / path)


def open_programs(artifacts: Artifacts, precision: str | None = None):
    """(vision, language) program sessions for the artifacts' backend.

    A ``deployment: single`` artifact has one program: both places hold the same session.

    Args:
        artifacts: The compile output.
        precision: ``fp32`` runs the exported graphs as they are; ``device`` runs them as the
            compiler will (fp16 with the plan's nodes in fp32, :mod:`qeff_vision.numerics.device`).
            ``device-mx`` adds the microscaling formats the language program was compiled with
            (``-mxfp6-matmul`` weights, an MXINT8 KV cache; :mod:`qeff_vision.numerics.mx`).
            On a ``qaic`` backend the device computes, so only ``device`` applies. ``None``:
            ``fp32`` on onnxruntime, ``device`` on qaic.

    Raises:
        UserError: A ``qaic`` artifact without the SDK runtime, or a graph onnxruntime cannot load.
    """
    backend = artifacts.program_backend
    if precision is None:
        precision = backend.default_precision
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    backend.check_precision(precision, artifacts.out_dir)
    device = backend.emulates_device(precision)
    plans = {
        program: device_plan(artifacts, program) if device else None
        for program in {artifacts.mode.vision_program, artifacts.mode.language_program}
    }
    plans["mx"] = _mx_of(artifacts) if precision == "device-mx" and device else None
    return artifacts.mode.open_programs(artifacts, precision, plans)


def _mx_of(artifacts: Artifacts):
    """The microscaling formats of the compiled language program's options."""
    from qeff_vision.numerics.device import MxEmulation

    options = artifacts.manifest["programs"][artifacts.mode.language_program].get("options") or {}
    return MxEmulation.from_options(
        bool(options.get("mxfp6_matmul")),
        options.get("kv_cache_dtype", ""),
        options.get("state_dtype", "float32"),
    )


def generator_for_artifacts(
    artifacts: Artifacts | str | Path, *, cache: EmbeddingCache | None = None, precision: str | None = None
) -> Generator:
    """A :class:`Generator` over a compile output directory (or loaded :class:`Artifacts`).

    ``precision`` is ``fp32`` or ``device`` (see :func:`open_programs`).
    """
    if not isinstance(artifacts, Artifacts):
        artifacts = load_artifacts(artifacts)
    vision, language = open_programs(artifacts, precision)
    buckets = artifacts.vision_specializations if artifacts.patch_buckets else None
    generator = make_generator(
        artifacts.checkpoint(),
        vision,
        language,
        artifacts.shape,
        cache,
        deployment=artifacts.mode,
        **({"patch_buckets": buckets} if buckets else {}),
    )
    generator.compiled_vision = list(artifacts.vision_specializations)
    if artifacts.mode.video:
        # The spec's vision.video_pruning_rate (written only when not 0): the language program is
        # sized for it.
        generator.set_video_pruning_rate(artifacts.manifest["shapes"].get("video_pruning_rate", 0.0))
    return generator


def _compiled(image_symbols: Mapping[str, int], specializations) -> bool:
    return any(all(spec.get(k, v) == v for k, v in image_symbols.items()) for spec in specializations)


def compiled_size_for(artifacts: Artifacts, height: int, width: int) -> ImageSize | None:
    """The compiled resolution an image of ``height`` x ``width`` must be resized to, or None.

    None when the processor already turns the image into a compiled vision specialization (for
    fixed-resolution families, every image). Otherwise the compiled resolution with the closest
    aspect ratio (then the closest pixel count): the device has no program for other grids.

    Raises:
        UserError: The image needs resizing but the manifest lists no compiled resolution.
    """
    description = artifacts.description()

    def compiled(size: ImageSize) -> bool:
        image_symbols = artifacts.family.vision_symbols(description, size)
        return _compiled(image_symbols, artifacts.vision_specializations)

    if compiled(ImageSize(height, width)):
        return None
    candidates = [size for size in artifacts.resolutions if compiled(size)]
    if not candidates:
        compiled = ", ".join(
            f"{spec.get(symbols.VISION_SIZE, '?')} tokens" for spec in artifacts.vision_specializations
        )
        raise UserError(
            f"a {height}x{width} image matches no compiled vision specialization ({compiled}) and the "
            "manifest lists no resolution to resize it to"
        )

    def distance(size: ImageSize) -> tuple[float, float]:
        aspect = abs(math.log((size.height / size.width) / (height / width)))
        return aspect, abs(math.log((size.height * size.width) / (height * width)))

    return min(candidates, key=distance)


def image_fitter(artifacts: Artifacts):
    """A :class:`~qeff_vision.runtime.conversation.Conversation` ``fit_image`` for these artifacts.

    Resizes an image the compiled vision program cannot take to the closest compiled resolution
    (see :func:`compiled_size_for`) and says so.
    """
    if artifacts.patch_buckets:
        return _bucket_fitter(artifacts)

    def fit(image):
        target = compiled_size_for(artifacts, image.height, image.width)
        if target is None:
            return image, None
        note = (
            f"resized from {image.height}x{image.width} to {target.height}x{target.width} "
            "(height x width), the closest compiled resolution"
        )
        return image.resize((target.width, target.height)), note

    return fit


def _bucket_fitter(artifacts: Artifacts):
    """Patch-bucket mode: every image at its own resolution, unless it exceeds the largest bucket.

    Such an image is downscaled by the processor's own rule with its pixel bound set to the
    largest bucket (aspect ratio kept), and the note says so.
    """
    description = artifacts.description()
    family, largest = artifacts.family, max(artifacts.patch_buckets)

    def fit(image):
        size = ImageSize(image.height, image.width)
        if family.patch_buckets.patch_count(description, size) <= largest:
            return image, None
        height, width = family.patch_buckets.fit_to_patches(description, size, largest)
        note = (
            f"downscaled from {image.height}x{image.width} to {height}x{width} (height x width, aspect "
            f"ratio kept) to fit the largest patch bucket ({largest} patches)"
        )
        return image.resize((width, height)), note

    return fit
