"""Specializations and custom IO of both programs, generated from a checked spec. Pure; no torch.

Every symbol comes from the family's declared graph axes, so a specialization binds exactly the
symbols of its graph: the vision program gets the family's token math for each image plus
``batch_size``; the language program gets ``batch_size``, ``seq_len``, ``ctx_len``,
``vision_batch_size`` and ``vision_size`` (from the vision-size policy) for each prefill bucket and
for decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from qeff_vision import symbols
from qeff_vision.contract.full_kv import full_length_caches
from qeff_vision.contract.language_io import KV_ROLES, DType
from qeff_vision.contract.sampler_io import with_sampler
from qeff_vision.contract.tasks import is_pooling, pooled_io
from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.fsutil import atomic_write_text
from qeff_vision.spec.compile_options import LANGUAGE, PROGRAM_DIRS, VISION
from qeff_vision.spec.deployment import split_language
from qeff_vision.spec.model import AUTO, FLAT, LAYOUTS, NAMED, Spec
from qeff_vision.spec.policy import WholeImages, chunk_span, decode_vision_size, prefill_vision_sizes
from qeff_vision.spec.single import single_program

SPECIALIZATIONS_FILE = "specializations.json"
CUSTOM_IO_FILE = "custom_io.yaml"
DECODE = "Decode"


def resolve_layout(layout: str, detected: str | None = None) -> str:
    """The concrete file layout (``flat`` or ``named``) for a spec's ``specialization_layout``.

    Args:
        layout: ``flat``, ``named`` or ``auto``.
        detected: The layout the installed SDK accepts
            (:attr:`qeff_vision.compile.sdk.SdkInfo.specialization_layout`), when known. ``auto``
            without one means ``flat``, which every SDK reads; golden files are always generated
            that way so they do not depend on the machine.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown specialization layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if layout == AUTO:
        return detected if detected in (FLAT, NAMED) else FLAT
    return layout


@dataclass(frozen=True)
class Specialization:
    """One shape bucket of a program.

    Attributes:
        name: ``Vision-1080x1920``, ``Prefill-128`` or ``Decode`` (written in the named layout).
        symbols: Symbol -> value (a decimal string), in graph order.
    """

    name: str
    symbols: Mapping[str, str]


@dataclass(frozen=True)
class ProgramFiles:
    """The specializations and custom IO of one program.

    Attributes:
        program: ``vision`` or ``language`` (the ``compile:`` section names).
        directory: Output sub-directory: ``vision`` or ``lang``.
        layout: ``flat`` or ``named``.
        specializations: The buckets, in file order.
        custom_io: (IO name, precision) pairs, in graph order.
    """

    program: str
    directory: str
    layout: str
    specializations: tuple[Specialization, ...]
    custom_io: tuple[tuple[str, str], ...]

    def specializations_json(self) -> str:
        """``specializations.json`` text in this program's layout."""
        if self.layout == NAMED:
            entries: list = [{"name": s.name, "symbols": dict(s.symbols)} for s in self.specializations]
        else:
            entries = [dict(s.symbols) for s in self.specializations]
        return json.dumps({"specializations": entries}, indent=2) + "\n"

    def custom_io_yaml(self) -> str:
        """``custom_io.yaml`` text in the SDK's layout (repeated ``- IOName`` / ``Precision`` entries)."""
        return "\n".join(
            f"- IOName: {name}\n  Precision: {precision}\n" for name, precision in self.custom_io
        )


@dataclass(frozen=True)
class ImageChunks:
    """How one spec image lands in the programs (a row of the ``specialize`` table).

    Attributes:
        image: The resolution from the spec.
        tokens: Its placeholder tokens (vision_embeds rows).
        vision_specialization: Name of the vision specialization that encodes it.
        chunks: Prefill bucket -> (fewest, most) chunks its placeholders span. For a family that
            cannot split an image across chunks: (1, 1) when the bucket holds the whole image,
            (0, 0) when it cannot (the host must use a larger bucket for that chunk).
    """

    image: ImageSize
    tokens: int
    vision_specialization: str
    chunks: Mapping[int, tuple[int, int]]


@dataclass(frozen=True)
class ProgramSpecializations:
    """Everything ``qeff-vision specialize`` writes for one spec.

    Attributes:
        spec: The spec it was built from.
        vision: Vision-program files.
        language: Language-program files.
        images: Per-image token and chunk counts.
        request_image_tokens: The most image tokens one request can carry (max image x max_images).
        programs: The files of every program the spec's deployment compiles, in order (the dual
            pair when empty; ``disaggregated`` splits the language program in two).
    """

    spec: Spec
    vision: ProgramFiles
    language: ProgramFiles
    images: tuple[ImageChunks, ...]
    request_image_tokens: int
    programs: tuple[ProgramFiles, ...] = ()

    @property
    def warnings(self) -> tuple[str, ...]:
        """The spec's warnings."""
        return self.spec.warnings

    def files(self) -> dict[str, str]:
        """Relative POSIX path -> text of every generated file (the golden layout too)."""
        out: dict[str, str] = {}
        for program in self.programs or (self.vision, self.language):
            out[f"{program.directory}/{SPECIALIZATIONS_FILE}"] = program.specializations_json()
            out[f"{program.directory}/{CUSTOM_IO_FILE}"] = program.custom_io_yaml()
        return out


def _image_name(image: ImageSize) -> str:
    return f"Vision-{image.height}x{image.width}" + (
        f"x{image.frames}" if image.frames != 1 or image.video else ""
    )


def specialization_image_size(name: str) -> tuple[int, int] | None:
    """(height, width) of the image a specialization named ``name`` was built from, else None.

    Vision entries (``Vision-HxW``) and a single program's encode entries (``Encode-S-nxHxW``,
    the first image of a ``+``-joined tile total) name one; patch-bucket entries
    (``Vision-patchesN``) and the other language entries do not.
    """
    found = re.fullmatch(r"(?:Vision-|Encode-\d+-\d+x)(\d+)x(\d+)(?:x\d+)?(?:\+.*)?", name)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _graph_order(axes_maps: Iterable[Mapping[str, Mapping[int, str]]]) -> list[str]:
    """Every symbol of a graph, in order of first appearance."""
    order: list[str] = []
    for axes in axes_maps:
        for per_input in axes.values():
            for symbol in per_input.values():
                if symbol not in order:
                    order.append(symbol)
    return order


def _bind(order: list[str], values: Mapping[str, int], where: str) -> dict[str, str]:
    missing = [symbol for symbol in order if symbol not in values]
    if missing:
        raise ValueError(f"{where}: no value for graph symbol(s) {', '.join(missing)}")
    return {symbol: str(values[symbol]) for symbol in order}


def _custom_io(names: Iterable[str], precision_of: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name, precision_of[name]) for name in names if name in precision_of)


def _span(tokens: int, extent: int, seq_len: int, vision_size: int, splittable: bool) -> tuple[int, int]:
    """Chunks an image spans: its ``tokens`` placeholders need rows, its ``extent`` tokens need seq_len.

    ``extent`` counts the tokens from its first to its last placeholder (Mistral 3's row breaks
    included); for one contiguous run it equals ``tokens`` and this is chunk_span(tokens, min(S, V)).
    """
    if splittable:
        by_rows, by_tokens = chunk_span(tokens, min(seq_len, vision_size)), chunk_span(extent, seq_len)
        return max(by_rows[0], by_tokens[0]), max(by_rows[1], by_tokens[1])
    return (1, 1) if extent <= seq_len and tokens <= vision_size else (0, 0)


def build_specializations(
    spec: Spec, model: ModelDescription | None = None, layout: str | None = None
) -> ProgramSpecializations:
    """Vision and language specializations plus custom IO for ``spec``.

    Args:
        spec: A spec from :func:`qeff_vision.spec.load_spec` (already validated).
        model: The checkpoint description; defaults to the one the spec was checked against.
        layout: ``flat``/``named`` (or ``auto``, resolved as in :func:`resolve_layout` with no SDK)
            to override the spec's ``specialization_layout``. A caller that knows the SDK passes
            ``resolve_layout(spec.layout, sdk.specialization_layout)``.

    Returns:
        Both programs' files and the per-image chunk table.
    """
    family = get_family(spec.family)
    model = model if model is not None else spec.model_description
    resolved = resolve_layout(layout or spec.layout)
    num_layers = family.text_dims(model).num_layers

    buckets = spec.vision.patch_buckets
    vision_inputs, vision_outputs = family.vision_io(model, patch_buckets=bool(buckets))
    vision_order = _graph_order([vision_inputs, vision_outputs])
    if symbols.BATCH_SIZE in vision_order:  # batch first: easier to read, same meaning
        vision_order.insert(0, vision_order.pop(vision_order.index(symbols.BATCH_SIZE)))
    vision_specs: list[Specialization] = []
    image_tokens: list[tuple[ImageSize, int, str]] = []
    where = f"family {family.name}, vision program"
    for image in spec.vision.images:
        # The vision outputs are the language table's vision rows: their symbols (a stack depth) too.
        values = {
            **family.language_symbols(model),
            **family.vision_symbols(model, image),
            symbols.BATCH_SIZE: spec.batch_size,
        }
        bound = _bind(vision_order, values, where)
        match = next((s for s in vision_specs if s.symbols == bound), None)
        if match is None:
            match = Specialization(_image_name(image), bound)
            vision_specs.append(match)
        # The language side counts a pruned clip's kept rows (the vision program encodes them all).
        rows = family.language_rows(model, image, spec.vision.video_pruning_rate)
        image_tokens.append((image, rows, match.name))
    for patches in buckets:
        values = {
            **family.language_symbols(model),
            **family.patch_buckets.bucket_symbols(model, patches),
            symbols.BATCH_SIZE: 1,
        }
        vision_specs.append(Specialization(f"Vision-patches{patches}", _bind(vision_order, values, where)))

    if buckets:
        # Images larger than the largest bucket are downscaled into it; none exceeds max_pixels.
        largest = min(max(buckets), family.patch_buckets.max_patches(model))
        most_tokens = family.patch_buckets.bucket_symbols(model, largest)[symbols.VISION_SIZE]
    else:
        most_tokens = max(tokens for _, tokens, _ in image_tokens)
    request_tokens = most_tokens * spec.vision.max_images
    seq_lens = spec.prefill.seq_lens
    whole = None
    if not family.splits_images(model):
        tokens = tuple(count for _, count, _ in image_tokens)
        whole = WholeImages.for_family(family, tokens, spec.vision.max_images)
    prefill_sizes = prefill_vision_sizes(spec.vision.vision_size, seq_lens, request_tokens, whole)
    cache_symbols = family.layer_caches(model)
    if spec.deployment.retain_full_kv:  # ring layers keep ctx_len slots (contract/full_kv.py)
        cache_symbols = full_length_caches(cache_symbols)
    ccl = spec.compile.comp_ctx_lengths
    ccl = ccl.compiled(spec.ctx_len) if ccl is not None else None
    fbs = spec.full_batch_size
    cb = fbs is not None
    # The layer declarations carry every kind (full, ring, shared, recurrent).
    language_io = family.language_io(
        num_layers, cache_symbols, comp_ctx_lengths=ccl is not None, continuous_batching=cb
    )
    sampler = spec.compile.language.sampler
    if sampler is not None:  # the on-device sampler's rows (contract/sampler_io.py)
        language_io = with_sampler(language_io, sampler)
    if is_pooling(spec.task):  # no cache, one output (contract/tasks.py)
        language_io = pooled_io(language_io, spec.task)
    language_order = _graph_order([language_io.input_axes(), language_io.output_axes()])
    # Continuous batching (QEfficient's get_specializations with continuous_batching): prefill at
    # batch_size 1 with full_batch_size and full_batch_exec_size F, decode at batch_size F.
    prefill_batch = {symbols.FULL_BATCH_SIZE: fbs} if cb else {}
    decode_batch = {symbols.BATCH_SIZE: fbs, symbols.FULL_BATCH_SIZE: fbs} if cb else {}
    prefill_extra = {symbols.FULL_BATCH_EXEC_SIZE: str(fbs)} if cb else {}
    common = {
        symbols.BATCH_SIZE: spec.batch_size,
        **family.kv_cache_lengths(model, spec.ctx_len),
        symbols.VISION_BATCH_SIZE: spec.batch_size,
        **family.language_symbols(model),
        **family.request_symbols(model, spec.vision.max_images),
    }
    where = f"family {family.name}, language program"
    # One specialization per (bucket, CCL) when the spec lists compute-context lengths.
    prefill_ccls = [(f"-ccl{c}", {symbols.COMP_CTX_LENGTHS: c}) for c in ccl.prefill] if ccl else [("", {})]
    decode_ccls = [(f"-ccl{c}", {symbols.COMP_CTX_LENGTHS: c}) for c in ccl.decode] if ccl else [("", {})]
    language_specs = [
        Specialization(
            f"Prefill-{seq_len}{suffix}",
            {
                **_bind(
                    language_order,
                    {
                        **common,
                        **prefill_batch,
                        symbols.SEQ_LEN: seq_len,
                        symbols.VISION_SIZE: prefill_sizes[seq_len],
                        **extra,
                    },
                    where,
                ),
                **prefill_extra,
            },
        )
        for seq_len in seq_lens
        for suffix, extra in prefill_ccls
    ]
    decode_size = decode_vision_size(prefill_sizes)
    language_specs += [
        Specialization(
            f"{DECODE}{suffix}",
            _bind(
                language_order,
                {**common, **decode_batch, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: decode_size, **extra},
                where,
            ),
        )
        for suffix, extra in decode_ccls
        if not is_pooling(spec.task)  # a pooling program has no decode step
    ]

    vision_dtype, language_dtype = spec.compute_dtype(VISION), spec.compute_dtype(LANGUAGE)
    kv_dtype = spec.compile.language.kv_cache_dtype
    state_dtype = spec.compile.language.state_dtype
    language_custom_io = language_io.custom_io(
        # The sampler's penalty buffers take the KV dtype: QEfficient's dual-QPC compile gives every
        # retained state but the vision rows kv_cache_dtype (modeling_auto.py, custom_io_lang);
        # their 0/1 values are exact in float16 and mxint8 alike.
        {DType.COMPUTE: language_dtype, DType.KV: kv_dtype, DType.STATE: state_dtype, DType.BOOL: kv_dtype}
    )
    vision_precision = {symbols.PIXEL_VALUES: vision_dtype, symbols.VISION_EMBEDS: vision_dtype}
    for name in family.stacked_vision_rows:  # vision rows in the compute dtype, like vision_embeds
        vision_precision[name] = vision_dtype
    # Vision outputs the language program retains as cache inputs (cross-attention K/V) are
    # produced in the cache's dtype, so they cross between the programs unconverted.
    caches = {row.name for row in language_io.rows(*KV_ROLES)}
    vision_precision.update({name: kv_dtype for name in vision_outputs if name in caches})

    vision = ProgramFiles(
        VISION,
        PROGRAM_DIRS[VISION],
        resolved,
        tuple(vision_specs),
        _custom_io([*vision_inputs, *vision_outputs], vision_precision),
    )
    language = ProgramFiles(
        LANGUAGE,
        PROGRAM_DIRS[LANGUAGE],
        resolved,
        tuple(language_specs),
        tuple(language_custom_io),
    )
    splittable = family.splits_images(model)
    images = tuple(
        ImageChunks(
            image,
            tokens,
            name,
            {
                seq_len: _span(
                    tokens,
                    family.image_extent(model, image) - (family.image_tokens(model, image) - tokens),
                    seq_len,
                    prefill_sizes[seq_len],
                    splittable,
                )
                for seq_len in seq_lens
            },
        )
        for image, tokens, name in image_tokens
    )
    if spec.deployment.table.encoder_inside:  # one program: the encoder composed into the language graph
        on_inputs = {name for axes in family.vision_input_axes.values() for name in axes.values()}
        gate = family.single_program_gate
        count = gate.images_symbol if gate.images_symbol in on_inputs else None
        # A pixel input without the image-count axis (a patch sequence) joins a call's images on
        # its gate axis: that axis's symbol sums over the images.
        pixel_axes = next(iter(family.vision_input_axes.values()), {})
        joined = pixel_axes.get(gate.encode_axis)
        summed = joined if count is not None and count not in pixel_axes.values() else None
        programs = (
            single_program(
                vision,
                language,
                request_tokens,
                spec.vision.max_images,
                family.fixed_pixel_side(model),
                count,
                summed,
            ),
        )
    else:
        programs = (vision, *split_language(language, spec.deployment.mode, spec.deployment.kv_cache_prefix))
    return ProgramSpecializations(spec, vision, language, images, request_tokens, programs)


def write_specializations(result: ProgramSpecializations, out_dir: str | Path) -> list[Path]:
    """Write ``vision/`` and ``lang/`` specializations and custom IO under ``out_dir``.

    Each file goes through a temporary file and a rename, so no file is ever half-written; other
    files in ``out_dir`` are left alone.

    Returns:
        The paths written.
    """
    out_dir = Path(out_dir)
    written = []
    for relative, text in result.files().items():
        atomic_write_text(out_dir / relative, text)
        written.append(out_dir / relative)
    return written
