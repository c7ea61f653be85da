"""The plain-text table ``qeff-vision specialize`` prints."""

from __future__ import annotations

from qeff_vision import symbols
from qeff_vision.contract.tasks import is_pooling
from qeff_vision.families import get_family
from qeff_vision.spec.buckets import admission_lines
from qeff_vision.spec.specializations import ProgramSpecializations


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _span_cell(low: int, high: int) -> str:
    if high == 0:
        return "-"  # cannot hold the whole image, and the family cannot split it
    return f"{low}" if low == high else f"{low}-{high}"


# The language program's own symbols; a single program's others are its image inputs'.
LANGUAGE_SYMBOLS = {
    symbols.BATCH_SIZE,
    symbols.SEQ_LEN,
    symbols.CTX_LEN,
    symbols.VISION_BATCH_SIZE,
    symbols.VISION_SIZE,
    symbols.FULL_BATCH_SIZE,
    symbols.FULL_BATCH_EXEC_SIZE,
    symbols.SLIDING_WINDOW,
    symbols.COMP_CTX_LENGTHS,
}


def specialization_table(result: ProgramSpecializations) -> str:
    """One row per specialization, then one row per image with the chunks each bucket needs.

    Vision rows show every symbol; language rows show ``seq_len`` and ``vision_size``. For each
    image and prefill bucket S, ``a-b`` chunks means its placeholders span ``a`` chunks when the
    image starts on a chunk boundary and ``b`` in the worst unaligned case; ``-`` means the bucket
    cannot hold an image its family cannot split across chunks.
    """
    spec = result.spec
    policy = spec.vision.vision_size
    header = (
        f"{spec.name}: {spec.model} [{spec.family}], layout {result.vision.layout}, vision_size policy "
        f"{policy}, up to {result.request_image_tokens} image tokens per request "
        f"({spec.vision.max_images} image(s))"
    )
    rows: list[tuple[str, ...]] = [("program", "specialization", "symbols")]
    single = bool(result.programs) and result.vision not in result.programs
    if not single:  # a single deployment has no vision program: its encode entries show the images
        for entry in result.vision.specializations:
            rows.append(("vision", entry.name, " ".join(f"{k}={v}" for k, v in entry.symbols.items())))
    # A disaggregated deployment's language programs are named by directory (lang_prefill, ...).
    languages = [files for files in result.programs if files is not result.vision] or [result.language]
    for files in languages:
        label = "language" if len(languages) == 1 and not single else files.directory
        for entry in files.specializations:
            keys = (symbols.SEQ_LEN, symbols.VISION_SIZE) + (
                (symbols.BATCH_SIZE,) if len(languages) > 1 else ()
            )
            if single:  # the image inputs' symbols: which entries run the encoder
                keys += tuple(k for k in entry.symbols if k not in LANGUAGE_SYMBOLS)
            shown = [k for k in keys if k in entry.symbols]
            rows.append((label, entry.name, " ".join(f"{k}={entry.symbols[k]}" for k in shown)))
    seq_lens = spec.prefill.seq_lens
    # A pooling program (task embed/score) runs a prompt in one call: whether the image's rows fit
    # each bucket, not how many chunks it spans.
    pooling = is_pooling(spec.task)
    column = "fits@" if pooling else "chunks@"
    image_rows: list[tuple[str, ...]] = [
        ("image", "tokens", "vision specialization", *(f"{column}{s}" for s in seq_lens))
    ]
    if pooling:  # one prefill specialization per bucket, in bucket order (no decode, no CCL)
        entries = result.language.specializations
        sizes = {s: int(e.symbols.get(symbols.VISION_SIZE, 0)) for s, e in zip(seq_lens, entries)}
    for image in result.images:
        label = f"{image.image.height}x{image.image.width}"
        if image.image.frames != 1:
            label += f"x{image.image.frames}f"
        if pooling:
            spans = ["yes" if image.tokens <= min(s, sizes[s]) else "no" for s in seq_lens]
        else:
            spans = [_span_cell(*image.chunks[s]) for s in seq_lens]
        image_rows.append((label, str(image.tokens), image.vision_specialization, *spans))
    lines = [header, "", *_columns(rows), ""]
    if spec.vision.patch_buckets:
        family = get_family(spec.family)
        lines += admission_lines(family, spec.model_description, spec.vision.patch_buckets)
    else:
        lines += _columns(image_rows)
    lines += [f"warning: {warning}" for warning in result.warnings]
    return "\n".join(lines)
