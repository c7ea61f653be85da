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
- **ours, single** (issue 24; built for LLaVA, LLaVA-NeXT, Gemma 3, InternVL, Mistral 3, Llama
  3.2 Vision, Llama 4, the Qwen-VL families and Gemma 4; Qwen2.5-VL and Gemma 4 shown): the encoder
  runs once per image inside the one program and its rows (mllama: its cross-attention K/V) are
  retained; nothing but the pixels crosses, once per image. For the built families the column is
  the runtime's own count: the same four prompt kinds run through the decoder kind's single
  runner (:func:`~qeff_vision.runtime.generate.make_generator` in mode single) on the family's tiny random
  checkpoint (exported and composed here, onnxruntime), which counts the images its program's
  encoder ran on; the other families show the design's count, marked ``(design)``. The second
  table lists those measured runs with QEfficient's form on the same chunk plans.

Pixel bytes use QEfficient's vision-input shapes in fp16 (one 336x336 image for LLaVA-1.5,
896x896 for Gemma 3, nine 448x448 tiles, thumbnail included, for InternVL 3 at 1080x1920, four
560x560 tiles for Llama 3.2 Vision, five 384x384 tiles for Granite Vision at 768x768, one
1540x1540 image for Mistral Small 3.1, five 336x336 tiles for Llama 4 Scout at 672x672);
embedding bytes are rows x hidden size x 2. Llama 3.2 Vision is a cross-attention model: one
token per image and no embedding rows per chunk, so its "ours, dual" bytes are the
cross-attention states sent once per request (8 layers x K and V x 8 heads x 6,404 rows x 128 x
2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

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


#: What ``--smoke`` measures: one family per decoder kind.
SMOKE_FAMILIES = ("llava", "mllama")
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
    Case(
        "llava_next",
        "granite-vision-3.2-2b",
        ImageSize(768, 768),
        ((128, 128), (512, 512)),
        5 * 3 * 384 * 384,
    ),
    Case(
        "mistral3",
        "Mistral-Small-3.1-24B-Instruct-2503",
        ImageSize(1540, 1540),
        ((128, 128), (512, 512)),
        3 * 1540 * 1540,
    ),
    Case(
        "llama4",
        "Llama-4-Scout-17B-16E-Instruct",
        ImageSize(672, 672),
        ((128, 128), (512, 512)),
        5 * 3 * 336 * 336,
    ),
    # Patch sequences: Qwen2.5-VL's 988 patches x 1176 of a 354x536 image, Gemma 4's 2,304 x 768.
    Case("qwen2_5_vl", "Qwen2.5-VL-3B-Instruct", ImageSize(354, 536), ((128, 128), (512, 512)), 988 * 1176),
    Case("gemma4", "gemma-4-E2B-it", ImageSize(896, 896), ((128, 128), (512, 512)), 2304 * 768),
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
    # The third turn shows a second image, at the start of its user text.
    new_image = turns[:2] + [(length - TURN_TEXT + tokens, [TEXT_BEFORE, length - ANSWER - TURN_TEXT + 8])]
    return {
        "one image": [(one, [TEXT_BEFORE])],
        "two images": [(two, [TEXT_BEFORE, TEXT_BEFORE + tokens + 8])],
        "three turns, one image": turns,
        "three turns, new image in 3": new_image,
    }


def measure_single(family: str, work: Path) -> dict[str, tuple[int, ...]]:
    """Per prompt kind: (QEff-form encoder runs, encoder calls, images encoded, tokens, tokens
    prefilled, tokens the dual deployment prefilled).

    The tiny random checkpoint of ``family`` is exported, its two graphs composed into the single
    program, and the prompt kinds of :func:`prompts` (one image, two images, three turns over one
    image, three turns with a new image in the third) run through the decoder kind's single
    runner (:func:`~qeff_vision.runtime.generate.make_generator` in mode single); a turn prefills only what
    the program does not hold, and encodes only its new images. The same conversations run on the
    export's two programs (dual, :func:`~qeff_vision.runtime.generate.make_generator`), whose
    language program keeps the prefix it holds as well.
    """
    from PIL import Image

    from qeff_vision import api
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.compile.single_program import write_single_program
    from qeff_vision.exporter import export_model
    from qeff_vision.families.base import CROSS_ATTENTION
    from qeff_vision.runtime.conversation import Conversation
    from qeff_vision.runtime.deployment import DEPLOYMENTS
    from qeff_vision.runtime.generate import make_generator
    from qeff_vision.runtime.language_shape import LanguageShape
    from qeff_vision.runtime.planner import PrefillBucket
    from qeff_vision.runtime.session import OnnxProgram
    from qeff_vision.spec.deployment import SINGLE

    checkpoint_dir = work / family
    api.tiny(family, checkpoint_dir)
    exported = export_model(checkpoint_dir, work / f"{family}-export", progress=None)
    composed = write_single_program(
        exported.out_dir, exported.program_path("vision"), exported.program_path("lang")
    )
    program = OnnxProgram(composed)
    vision, language = (OnnxProgram(exported.program_path(name)) for name in ("vision", "lang"))
    checkpoint = Checkpoint.open(checkpoint_dir, family)
    # Two widths; on the tiny checkpoints both land on one tile grid (LLaVA-NeXT) and one resized
    # size (Mistral 3), so those encode the two in one call; Qwen2.5-VL's and Gemma 4's patch grids
    # differ, so theirs are two calls (one per resolution), each image still encoded once.
    widths = [64, 72]
    images = [Image.new("RGB", (width, 64), (40 * i, 90, 160)) for i, width in enumerate(widths)]
    # The retained buffer holds two of the larger image's rows (mllama: no rows, its K/V slots).
    model, kind_of = checkpoint.description, get_family(family)
    tiny_rows = max(1, *(kind_of.image_tokens(model, ImageSize(64, width)) for width in widths))
    tiny_rows = 1 if family == "mllama" else tiny_rows
    kinds = {
        "one image": [(images[:1], "Describe it.")],
        "two images": [(images, "Compare them.")],
        "three turns, one image": [(images[:1], "Describe it."), ([], "And the colours?"), ([], "Thanks.")],
        "three turns, new image in 3": [
            (images[:1], "Describe it."),
            ([], "And the colours?"),
            (images[1:], "Compare."),
        ],
    }
    measured = {}
    for kind, turns in kinds.items():
        # A 24-token bucket cuts the prompts into several chunks; the buffer holds two images' rows.
        shape = LanguageShape((PrefillBucket(24, 2 * tiny_rows),), 2 * tiny_rows, 512)
        # mllama's program keeps two images' cross K/V (its image slots).
        slots = {"image_slots": 2} if family == "mllama" else {}
        single = DEPLOYMENTS[SINGLE]
        generator = make_generator(checkpoint, None, program, shape, deployment=single, **slots)
        chat = Conversation(generator, checkpoint.processor, max_new_tokens=2)
        chunks = calls = encoded = tokens = prefilled = 0
        for pictures, text in turns:
            result = chat.ask(pictures, text)
            # QEfficient's form: every chunk of the whole rendered conversation, every image (ours
            # prefills only what the program does not hold; plan() outside generate plans it all).
            processed = chat.last_inputs.processed
            plan = generator.plan(processed["input_ids"].reshape(-1), processed, "chunk")
            chunks += len(plan.chunks) * (result.images or 0)
            calls += result.encoder_calls
            encoded += result.images_encoded
            tokens += result.prompt_tokens  # what a re-prefilling form prefills
            prefilled += result.prefilled_tokens
        # Dual: 24-token chunks carrying their own rows (chunk protocol; mllama sends none).
        rows = 1 if kind_of.decoder_kind == CROSS_ATTENTION else 24
        dual_shape = LanguageShape((PrefillBucket(24, rows),), rows, 512)
        dual = Conversation(make_generator(checkpoint, vision, language, dual_shape), checkpoint.processor)
        dual.max_new_tokens = 2
        dual_prefilled = sum(dual.ask(pictures, text).prefilled_tokens for pictures, text in turns)
        measured[kind] = (chunks, calls, encoded, tokens, prefilled, dual_prefilled)
    return measured


def count(case: Case, measured: dict[str, tuple[int, ...]] | None = None) -> list[tuple[str, ...]]:
    """Table rows of one family: per prompt kind, the three forms' encoder runs and bytes."""
    family = get_family(case.family)
    model = describe_checkpoint(CONFIGS / case.config)
    tokens = family.image_tokens(model, case.image)
    hidden = family.text_dims(model).hidden_size
    pixel_bytes = case.pixel_values * FP16
    split = family.features.chunk_split.supported
    rows = []
    for kind, turns in prompts(tokens).items():
        images = len(turns[-1][1])  # the conversation's images
        qeff_runs = qeff_bytes = ours_bytes = 0
        for length, starts in turns:
            plan = plan_chunks(length, [(s, tokens) for s in starts], case.buckets, allow_image_split=split)
            qeff_runs += len(plan.chunks) * len(starts)
            qeff_bytes += len(plan.chunks) * len(starts) * pixel_bytes
            if case.cross_state_bytes:
                ours_bytes += len(starts) * case.cross_state_bytes
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
                str(measured[kind][2]) if measured else f"{images} (design)",
                f"{images * pixel_bytes / 2**20:.1f}",
                f"{qeff_runs / (measured[kind][2] if measured else images):.0f}x",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Measure the built families' single programs on their tiny checkpoints; print both tables."""
    import argparse
    import tempfile

    from qeff_vision.families import get_family as family_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="Measure only tiny LLaVA and Llama 3.2 Vision (both decoder kinds; the others from the design).",
    )
    add_docs_arguments(parser)
    args = parser.parse_args(argv)
    with recording(args, "deployment_modes", argv):
        with tempfile.TemporaryDirectory() as work:
            measured = {
                case.family: measure_single(case.family, Path(work))
                for case in CASES
                if family_of(case.family).features.deployment("single").supported
                and (not args.smoke or case.family in SMOKE_FAMILIES)
            }
        header = (
            "family",
            "prompt",
            "tokens/image",
            "QEff single: encoder runs",
            "MiB in",
            "ours dual: encoder runs",
            "MiB in",
            "ours single: images encoded",
            "MiB in",
            "QEff / ours runs",
        )
        rows = [header] + [row for case in CASES for row in count(case, measured.get(case.family))]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        print(
            "MiB in: bytes sent into the programs per prompt (pixels; for ours dual also the embedding rows "
            "each chunk carries, or mllama's cross states once). ours single: the runtime's count on the "
            "tiny checkpoint for the same prompt kind, or (design) where the mode is not built."
        )
        print()
        table = [
            (
                "family (tiny)",
                "prompt",
                "QEff form: encoder runs",
                "tokens prefilled",
                "ours single: encoder calls",
                "images encoded",
                "tokens prefilled",
                "ours dual: tokens prefilled",
            )
        ]
        for family, kinds in measured.items():
            table += [
                (family, kind, str(q), str(t), str(c), str(e), str(f), str(d))
                for kind, (q, c, e, t, f, d) in kinds.items()
            ]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        print(
            "Measured on the tiny checkpoints (24-token chunks): QEff form = the chunks of each prefill x "
            "its images (QEfficient's single QPC encodes in every prefill call) and every turn's whole "
            "conversation prefilled; ours = what the runtime counted (a turn prefills what the program "
            "does not hold, single program or dual language program; mllama prefills a turn's text again "
            "when it adds an image)."
        )


if __name__ == "__main__":
    main()
