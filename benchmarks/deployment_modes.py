"""Encoder runs and vision bytes per prompt: QEfficient's single QPC vs ours (dual, and single as designed).

    .venv/bin/python benchmarks/deployment_modes.py

Counted, not timed: each prompt is planned into prefill chunks by our real planner
(:func:`qeff_vision.runtime.planner.plan_chunks`) with the real image-token counts of each family's
pinned config (``specs/configs``, token math of :mod:`qeff_vision.families`), chunk buckets as in
the family's pinned spec. Three forms:

- **QEfficient single QPC** (``kv_offload=False``; ref: quic/efficient-transformers
  ``modeling_auto.py`` ``_QEFFAutoModelForImageTextToTextSingleQPC`` and the families'
  ``kv_offload=False`` branches): ``pixel_values`` goes with every prefill chunk and the vision
  encoder runs in every prefill call (the merge is ``where(seq_len == 1, ...)``, so only decode
  skips it). A new turn is a new prompt: the history is prefilled, and its images encoded, again.
- **ours, dual** (built): each image is encoded once by the vision program (the per-image cache
  holds it across turns); each chunk carries only the embedding rows it needs (``chunk``).
- **ours, single as designed** (issue 24; not built): the encoder runs once per image inside the
  one program and its rows are retained; nothing but the pixels crosses, once per image.

Pixel bytes use QEfficient's vision-input shapes in fp16 (one 336x336 image for LLaVA-1.5,
896x896 for Gemma 3, nine 448x448 tiles, thumbnail included, for InternVL 3 at 1080x1920, four
560x560 tiles for Llama 3.2 Vision); embedding bytes are rows x hidden size x 2. Llama 3.2
Vision is a cross-attention model: one token per image and no embedding rows per chunk, so its
"ours, dual" bytes are the cross-attention states sent once per request (8 layers x K and V x 8
heads x 6,404 rows x 128 x 2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qeff_vision.families import get_family
from qeff_vision.families.base import ImageSize, describe_checkpoint
from qeff_vision.runtime.planner import plan_chunks

CONFIGS = Path(__file__).resolve().parents[1] / "specs" / "configs"
FP16 = 2


@dataclass(frozen=True)
class Case:
    """One family with the image it is shown, its buckets and its vision-input size."""

    family: str
    config: str
    image: ImageSize
    buckets: tuple[tuple[int, int], ...]  # (seq_len, vision_size) as the pinned spec compiles them
    pixel_values: int  # elements of one image's vision input (QEfficient's shape)
    cross_state_bytes: int = 0  # cross-attention kind: bytes of one image's K/V states


CASES = (
    Case("llava", "llava-1.5-7b-hf", ImageSize(336, 336), ((128, 128), (512, 512)), 3 * 336 * 336),
    Case("gemma3", "gemma-3-4b-it", ImageSize(896, 896), ((128, 1), (512, 256)), 3 * 896 * 896),
    Case("internvl", "InternVL3-8B-hf", ImageSize(1080, 1920), ((128, 128), (512, 512)), 9 * 3 * 448 * 448),
    Case(
        "mllama",
        "Llama-3.2-11B-Vision-Instruct",
        ImageSize(560, 560),
        ((128, 1), (512, 1)),
        4 * 3 * 560 * 560,
        8 * 2 * 8 * 6404 * 128 * FP16,
    ),
)
TEXT_BEFORE, TEXT_AFTER, TURN_TEXT, ANSWER = 24, 300, 40, 60


def prompts(tokens: int) -> dict[str, list[tuple[int, list[int]]]]:
    """Per prompt kind, its turns: (prompt length, image start positions) of each prefill."""
    one = TEXT_BEFORE + tokens + TEXT_AFTER
    two = TEXT_BEFORE + 2 * tokens + 8 + TEXT_AFTER
    turns, length = [], one
    for _ in range(3):  # each turn prefills the whole history again
        turns.append((length, [TEXT_BEFORE]))
        length += ANSWER + TURN_TEXT
    return {
        "one image": [(one, [TEXT_BEFORE])],
        "two images": [(two, [TEXT_BEFORE, TEXT_BEFORE + tokens + 8])],
        "three turns, one image": turns,
    }


def count(case: Case) -> list[tuple[str, ...]]:
    """Table rows of one family: per prompt kind, the three forms' encoder runs and bytes."""
    family = get_family(case.family)
    model = describe_checkpoint(CONFIGS / case.config)
    tokens = family.image_tokens(model, case.image)
    hidden = family.text_dims(model).hidden_size
    pixel_bytes = case.pixel_values * FP16
    split = family.features.chunk_split.supported
    rows = []
    for kind, turns in prompts(tokens).items():
        images = len(turns[0][1])
        qeff_runs = qeff_bytes = ours_bytes = 0
        for length, starts in turns:
            plan = plan_chunks(length, [(s, tokens) for s in starts], case.buckets, allow_image_split=split)
            qeff_runs += len(plan.chunks) * images
            qeff_bytes += len(plan.chunks) * images * pixel_bytes
            if case.cross_state_bytes:
                ours_bytes += images * case.cross_state_bytes
            else:
                ours_bytes += plan.vision_bytes(hidden, FP16)
        dual_bytes = images * pixel_bytes + ours_bytes
        rows.append(
            (
                case.family,
                kind,
                str(tokens),
                str(qeff_runs),
                f"{qeff_bytes / 2**20:.1f}",
                str(images),
                f"{dual_bytes / 2**20:.1f}",
                str(images),
                f"{images * pixel_bytes / 2**20:.1f}",
                f"{qeff_runs / images:.0f}x",
            )
        )
    return rows


def main() -> None:
    """Print the table."""
    header = (
        "family",
        "prompt",
        "tokens/image",
        "QEff single: encoder runs",
        "MiB in",
        "ours dual: encoder runs",
        "MiB in",
        "ours single (design): runs",
        "MiB in",
        "QEff / ours runs",
    )
    rows = [header] + [row for case in CASES for row in count(case)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    print(
        "MiB in: bytes sent into the programs per prompt (pixels; for ours dual also the embedding rows "
        "each chunk carries, or mllama's cross states once)."
    )


if __name__ == "__main__":
    main()
