"""Load and check a spec file: schema first (unknown keys, types, ranges), then the model's token math.

Every problem is collected with its YAML path and raised at once as one
:class:`~qeff_vision.errors.SpecError`; nothing here raises any other exception for bad input.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qeff_vision.contract.tasks import GENERATE, TASKS
from qeff_vision.errors import SpecError, UserError
from qeff_vision.families.base import Family, ModelDescription
from qeff_vision.spec.buckets import check_patch_buckets
from qeff_vision.spec.ccl_lists import CCL_UNIQUE_STEP
from qeff_vision.spec.checks import check_images, check_model, describe_model, resolve_family
from qeff_vision.spec.compile_options import NODE_PRECISION_AUTO, NODE_PRECISION_NONE, parse_compile_options
from qeff_vision.spec.deployment import check_deployment, check_sampler, check_single_vision, read_deployment
from qeff_vision.spec.hardware import AI200, detect_for_spec
from qeff_vision.spec.model import DTYPES, FLAT, LAYOUTS, PrefillSpec, Spec
from qeff_vision.spec.schema import (
    MAX_BATCH_SIZE,
    MAX_CTX_LEN,
    MISSING,
    NAME_PATTERN,
    TOP_KEYS,
    Reader,
    read_prefill,
    read_vision,
)
from qeff_vision.spec.strict_yaml import MAX_BYTES, load_strict_yaml, shown
from qeff_vision.spec.tasks import check_task
from qeff_vision.spec.weights import read_weights


def check_compile_files(reader, options, section, spec_dir: Path) -> None:
    """Files the compile section names (node precision plans, calibration images) exist."""
    section = section if isinstance(section, dict) else {}
    missing = {}
    for program in ("vision", "language"):
        value = options.program(program).node_precision
        if value in (NODE_PRECISION_AUTO, NODE_PRECISION_NONE) or (spec_dir / value).is_file():
            continue
        own = isinstance(section.get(program), dict) and "node_precision" in section[program]
        missing[f"compile.{program + '.' if own else ''}node_precision"] = value
    for where, value in missing.items():  # a shared value is reported once
        reader.add(where, f"no such plan file {value!r}")
    for image in options.calibration.images if options.calibration else ():
        if not (spec_dir / image).is_file():
            reader.add("compile.calibration.images", f"no such image {image!r}")


def with_image_processor_options(
    reader: Reader, family: Family, description: ModelDescription, options: tuple[tuple[str, int], ...]
) -> ModelDescription:
    """``description`` with the spec's image-processor options over its processor config.

    Each option must be one the family declares (``Family.image_processor_options``) with one of
    its allowed values; otherwise a problem is reported and ``description`` is returned unchanged.
    """
    allowed = family.image_processor_options
    good = {}
    for name, value in options:
        here = f"vision.image_processor.{name}"
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            reader.add(here, f"{family.title} has no image-processor option {name!r} (options: {known})")
        elif value not in allowed[name]:
            reader.add(here, f"must be one of {', '.join(map(str, allowed[name]))} (got {value})")
        else:
            good[name] = value
    if len(good) != len(options):
        return description
    # A fresh views cache: views read before the options (the family's typed config views) are stale.
    return replace(description, processor={**description.processor, **good}, views={})


def load_spec(path: str | Path, *, revision: str | None = None, fetch_model: bool = False) -> Spec:
    """Read, validate and check a spec file against its model's config.

    Args:
        path: The YAML spec. Relative ``model:`` directories and ``config:`` paths in it are
            resolved against the spec file's directory.
        revision: Replaces the spec's ``revision:`` (``compile --revision``).
        fetch_model: A Hub id without ``config:`` or a cached config has its config downloaded
            (``compile``); otherwise the check never touches the network.

    Returns:
        The checked :class:`Spec`; its ``warnings`` list non-fatal findings.

    Raises:
        SpecError: Listing every problem, each prefixed by its YAML path.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:  # at most one byte past the bound: /dev/zero ends too
            raw = handle.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise SpecError(str(path), [f"the file is larger than {MAX_BYTES:,} bytes; a spec is a few KB"])
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), ["file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), [f"cannot read the file ({exc.__class__.__name__}: {exc})"]) from None
    data, problems = load_strict_yaml(text)
    if problems:
        raise SpecError(str(path), problems)
    return spec_from_data(data, path, revision=revision, fetch_model=fetch_model)


def spec_from_data(
    data: object, source: Path, *, revision: str | None = None, fetch_model: bool = False
) -> Spec:
    """Validate already-parsed spec ``data`` as if read from ``source`` (see :func:`load_spec`)."""
    if data is None:
        raise SpecError(str(source), ["<top level>: the spec is empty"])
    reader = Reader()
    top = reader.mapping(data, "", TOP_KEYS, required=("model", "ctx_len", "prefill", "vision"))
    name = reader.text(top, "name", "", default=source.stem)
    if name is not None and not NAME_PATTERN.fullmatch(name):
        reader.add(
            "name",
            f"must be letters, digits, '.', '_' or '-' (it names the golden directory); got {shown(name)}",
        )
    model = reader.text(top, "model", "")
    written_revision = reader.text(top, "revision", "", default=None)
    revision = revision or written_revision  # --revision wins over the spec's
    family_name = reader.text(top, "family", "", default=None)
    config = reader.text(top, "config", "", default=None)
    dtype = reader.text(top, "dtype", "", choices=DTYPES, default=DTYPES[0])
    batch_size = reader.integer(top, "batch_size", "", default=1, maximum=MAX_BATCH_SIZE)
    full_batch_size = reader.integer(top, "full_batch_size", "", maximum=MAX_BATCH_SIZE)
    if full_batch_size is not None and batch_size is not None and batch_size > 1:
        reader.add(
            "full_batch_size",
            f"continuous batching prefills one sequence at a time (batch_size 1) and decodes "
            f"full_batch_size {full_batch_size} at once; it cannot be combined with batch_size {batch_size}",
        )
    deployment = read_deployment(reader, top, batch_size, full_batch_size)
    weights = read_weights(reader, top)
    ctx_len = reader.integer(top, "ctx_len", "", maximum=MAX_CTX_LEN)
    task = reader.text(top, "task", "", choices=TASKS, default=GENERATE)
    layout = reader.text(top, "specialization_layout", "", choices=LAYOUTS, default=FLAT)
    seq_lens = read_prefill(reader, top.get("prefill", MISSING), ctx_len)
    vision = read_vision(reader, top.get("vision", MISSING), ctx_len)
    compile_options, compile_problems = parse_compile_options(top.get("compile"), "compile", detect_for_spec)
    reader.problems += compile_problems
    if compile_options.hardware == AI200 and dtype == "float16":
        reader.add(
            "dtype",
            "ai200 computes in bfloat16: export float32 graphs (the default; weights are stored "
            "bfloat16) rather than float16 ones",
        )
    ccl = compile_options.comp_ctx_lengths
    if ccl is not None and ctx_len is not None:
        for phase, values in (("prefill", ccl.prefill), ("decode", ccl.decode)):
            if values[-1] > ctx_len:
                reader.add(f"compile.comp_ctx_lengths.{phase}", f"{values[-1]} exceeds ctx_len {ctx_len}")
        if ctx_len <= CCL_UNIQUE_STEP:
            # QEfficient's rules move the one prefill CCL (ctx_len, also a decode CCL) down to 0.
            reader.add(
                "compile.comp_ctx_lengths",
                f"ctx_len {ctx_len} leaves no prefill length: QEfficient keeps prefill CCLs apart from "
                f"decode ones in steps of {CCL_UNIQUE_STEP} (use ctx_len above {CCL_UNIQUE_STEP})",
            )
    check_compile_files(reader, compile_options, top.get("compile"), source.parent)

    description = model_dir = config_path = None
    family = None
    warnings: list[str] = []
    if model is not None:
        description, model_dir, config_path = describe_model(
            reader, source.parent, model, config, revision, fetch=fetch_model
        )
    if description is not None:
        family = resolve_family(reader, description, family_name, "config" if config else "model")
    if family is not None and description is not None:
        check_model(reader, warnings, family, description, ctx_len)
    if (
        family is not None
        and full_batch_size is not None
        and not family.features.continuous_batching.supported
    ):
        note = family.features.continuous_batching.note
        reader.add("full_batch_size", f"{family.title} cannot do continuous batching: {note}")
    if family is not None and ccl is not None and not family.features.comp_ctx_lengths.supported:
        note = family.features.comp_ctx_lengths.note
        reader.add("compile.comp_ctx_lengths", f"{family.title} cannot use compute-context lengths: {note}")
    if family is not None and deployment is not None and description is not None:
        check_deployment(reader, family, deployment, description)
    if family is not None and task is not None:
        check_task(reader, family, task, deployment, full_batch_size, compile_options)
    if deployment is not None:
        check_single_vision(reader, deployment, vision)
        vocab = (
            family.text_dims(description).vocab_size
            if family is not None and description is not None
            else None
        )
        check_sampler(reader, deployment, compile_options.language.sampler, vocab)
    if family is not None and description is not None and vision is not None and vision.image_processor:
        description = with_image_processor_options(reader, family, description, vision.image_processor)
    if family is not None and description is not None and vision is not None:
        check_images(reader, warnings, family, description, vision, seq_lens, ctx_len)
        if vision.patch_buckets:
            check_patch_buckets(
                reader, warnings, family, description, vision.patch_buckets, vision.max_images, ctx_len
            )

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
        full_batch_size=full_batch_size,
        deployment=deployment,
        revision=revision,
        weights=weights,
        task=task,
    )


GOLDEN_DIR = "golden"  # the golden files of ``specialize --check`` (qeff_vision.compile.golden)
SPEC_SUFFIXES = (".yaml", ".yml")


def find_specs(root: str | Path) -> list[Path]:
    """Every spec file under ``root``, recursively, sorted; skips ``root/golden`` and hidden directories."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise UserError(f"{root}: no such file or directory")
    golden = root / GOLDEN_DIR
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.suffix not in SPEC_SUFFIXES or not path.is_file():
            continue
        if path.is_relative_to(golden) or any(part.startswith(".") for part in relative.parts[:-1]):
            continue
        found.append(path)
    return found
