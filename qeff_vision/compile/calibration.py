"""Calibration runs for the precision plan: real prompts through the runtime, every node output recorded.

Each program runs in fp32 recording every float node output's peak (:class:`RecordingProgram`), inside
the ordinary chunk-aware generation loop, on one prompt per (image, prompt) pair: the spec's
resolutions as synthetic images (or the user's ``compile.calibration.images``) with a default
prompt (or ``compile.calibration.prompts``), chunked over the compiled buckets and followed by a few
decode steps. Each prompt is fitted to the compiled ``ctx_len``: its longest leading run of words
that leaves room for a decode step (fewer decode steps when that is all that fits); an image whose
prompt cannot fit even without words is skipped, and one note says what was shortened or skipped,
so a small valid ``ctx_len`` never stops a compile over a prompt the user did not write. Token ids,
image rows and positions are then those a user's request produces; the
generated inputs of :func:`qeff_vision.compile.precision.calibration_feeds` (zero token ids, which
are padding with a zero embedding in some families) complement them with every specialization's
shape.

The work is slice-major (decision 047): every call of a program (each prompt's prefill chunks and
decode steps, every image, every generated input) runs in one pass over the graph's slices, each
slice's session built once and each weight read once. The decode steps are teacher-forced: each
prompt continues with the first :data:`DECODE_STEPS` tokens of its own text (not the tokens the
fp32 logits would choose), so no call waits for an earlier call's logits and a prompt's whole call
sequence is known before anything runs. The images are encoded in a first collecting round (each
run stops where it first reads an image's rows; the language calls it queued are dropped), all in
one vision pass; the prompts then run against those outputs with every language call queued for
one language pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.compile.recording_program import RecordingProgram, call_shapes
from qeff_vision.contract.tasks import GENERATE, is_pooling

DEFAULT_PROMPT = "Describe this image in detail, then tell a short story about it."
DECODE_STEPS = 3


def single_sequence(values: Mapping[str, int]) -> dict[str, int]:
    """A continuous-batching specialization as one sequence in one KV slot runs it (others as given).

    Calibration drives the single-sequence generator; the graph and its node values per sequence
    are the same whatever ``full_batch_size``, so one slot and batch 1 measure the same peaks.
    """
    if symbols.FULL_BATCH_SIZE not in values:
        return dict(values)
    single = {k: v for k, v in values.items() if k not in symbols.SPECIALIZATION_ONLY}
    return {**single, symbols.BATCH_SIZE: 1, symbols.FULL_BATCH_SIZE: 1}


def prompt_ranges(
    export_dir: Path,
    vision_specializations: Sequence[Mapping[str, int]],
    language_specializations: Sequence[Mapping[str, int]],
    resolutions: Sequence[tuple[int, int]],
    *,
    images: Sequence[Path] = (),
    prompts: Sequence[str] = (),
    say: Callable[[str], None] | None = None,
    processor_options: Mapping[str, int] | None = None,
    on_slice: Callable[[int, int], None] | None = None,
    generated: Mapping[str, Sequence[Mapping[str, np.ndarray]]] | None = None,
    one_pass: bool = True,
    max_prompt_tokens: int | None = None,
) -> dict[str, dict[str, float]]:
    """Per program (``vision``, ``lang``): node output -> largest magnitude over the calibration prompts.

    Args:
        export_dir: The export (its ``export.json`` names the checkpoint and its processor).
        vision_specializations: Compiled vision symbol values.
        language_specializations: Compiled language symbol values.
        resolutions: (height, width) of the spec's images; a synthetic image each unless ``images``.
        images: The user's calibration images (replace the synthetic ones).
        prompts: The user's calibration prompts (default: one descriptive prompt).
        say: Called with one note when a prompt was shortened or a run skipped to fit ``ctx_len``.
        processor_options: The spec's image-processor options (``vision.image_processor``), set on
            the checkpoint's image processor so the prompts' images match the compiled shapes.
        on_slice: Called after each slice of each pass over a graph (progress).
        generated: Per program (``vision``, ``lang``), more inputs recorded in the same pass (the
            generated input of each specialization, :func:`~qeff_vision.compile.precision.calibration_feeds`).
        one_pass: Every call of a program in one pass over its slices (False: each call on its
            own, one pass per call, as the reference for the tests).
        max_prompt_tokens: Longest prompt the language program runs (None: no bound); a longer
            image prompt's image is still encoded (see :func:`within_budget`).
    """
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.export_record import read_export
    from qeff_vision.numerics.deferred import TapeFrozen
    from qeff_vision.progress import bar as progress_bar
    from qeff_vision.runtime.conversation import Conversation
    from qeff_vision.runtime.generate import make_generator
    from qeff_vision.runtime.language_shape import LanguageShape

    manifest = read_export(export_dir)
    if is_pooling(manifest.get("task", GENERATE)):  # one call per whole prompt, no generation
        from qeff_vision.compile.pooling_calibration import pooling_ranges

        pictures = _pictures(images, resolutions)
        prompts = list(prompts or [DEFAULT_PROMPT])
        return pooling_ranges(
            export_dir,
            vision_specializations,
            language_specializations,
            pictures,
            prompts,
            say,
            processor_options,
            on_slice,
        )
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    vision = RecordingProgram(
        export_dir / manifest["programs"]["vision"]["path"], vision_specializations, deferred=one_pass
    )
    language_specializations = [single_sequence(values) for values in language_specializations]
    language = RecordingProgram(
        export_dir / manifest["programs"]["lang"]["path"], language_specializations, deferred=one_pass
    )
    vision.recorder.on_slice = language.recorder.on_slice = on_slice
    shape = LanguageShape.from_specializations(language_specializations)
    processor = checkpoint.processor
    for name, value in (processor_options or {}).items():
        setattr(processor.image_processor, name, value)
    pictures = _pictures(images, resolutions)
    fitting = _Fitting(shape.ctx_len)
    texts = prompts or [DEFAULT_PROMPT]
    runs = [(text, picture) for text in texts for picture in [*pictures, None]]  # the prompt alone last

    def generator():
        # No end-of-sequence ids: every calibration prompt runs its DECODE_STEPS, whatever it generates.
        made = make_generator(checkpoint, vision, language, shape, eos_token_ids=())
        return made, _defer_chunk_checks(made)

    # Each run's fitted prompt (a Conversation's processor does the fitting; no program runs).
    collector, _ = generator()
    fitted = []
    for text, picture in runs:
        shown = [] if picture is None else [picture]
        fitted.append(fitting.fit(Conversation(collector, processor, keep_prefix=False), shown, text))
    budget = within_budget(runs, fitted, max_prompt_tokens)
    generated = generated or {}
    if one_pass:
        # Round 1: every image's vision call queued (the language program refuses to run), then
        # one vision pass with the generated vision inputs.
        vision.remember, vision.tape.frozen, language.tape.frozen = True, True, True
        for (text, picture), fit in zip(runs, fitted):
            if picture is not None and fit is not None:
                with contextlib.suppress(TapeFrozen):  # ends the run at its first encoded image
                    _ask(collector, processor, picture, text, fit)
        vision.tape.frozen = language.tape.frozen = False
        language.tape.discard()  # the language calls before each image run again in round 2
    if one_pass:  # in the images' pass; one by one, after the prompts have run their images
        _queue_uncovered(vision, generated.get("vision", ()))
    vision.settle()
    # Round 2: the prompts, every language call queued (tokens teacher-forced), one language pass.
    runner, checks = generator()
    bar = progress_bar("calibration runs", total=len(runs), unit="run")  # on a terminal, unless -q
    for (text, picture), fit, runs_language in zip(runs, fitted, budget):
        if fit is not None and runs_language:
            _ask(runner, processor, picture, text, fit)
        bar.update()
    if not one_pass:
        _queue_uncovered(vision, generated.get("vision", ()))
    _queue_uncovered(language, generated.get("lang", ()))
    language.settle()
    checks.run()
    bar.close()
    if fitting.note() and say is not None:
        say(fitting.note())
    left = [fit[2] for fit, runs_language in zip(fitted, budget) if fit is not None and not runs_language]
    if left and say is not None:
        say(
            f"note: {len(left)} calibration prompt(s) longer than {max_prompt_tokens} tokens left out of the "
            f"language program (up to {max(left)} tokens; their images were encoded): "
            "compile.calibration.max_prompt_tokens"
        )
    return {"vision": vision.ranges, "lang": language.ranges}


def within_budget(runs, fitted, max_prompt_tokens: int | None) -> list[bool]:
    """Per run, whether its prompt goes through the language program.

    Every prompt of at most ``max_prompt_tokens`` tokens does; of the longer ones, only the
    shortest image prompt, and only when no image prompt is within the bound, so that image rows
    always reach the language program. The prompts left out still have their images encoded: each
    vision specialization keeps its real image. A 1080x1920 image can be 2,700 tokens, 22
    prefill chunks of 128 that repeat the specializations the shorter prompts already run (at full
    depth, ~0.8 TFLOP each).
    """
    if max_prompt_tokens is None:
        return [True] * len(runs)
    chosen = [fit is not None and fit[2] <= max_prompt_tokens for fit in fitted]
    images = [i for i, ((_, picture), fit) in enumerate(zip(runs, fitted)) if picture is not None and fit]
    if images and not any(chosen[i] for i in images):
        chosen[min(images, key=lambda i: fitted[i][2])] = True
    return chosen


def _queue_uncovered(program, generated) -> None:
    """Queue each generated input whose shapes no prompt call ran.

    A generated input (:func:`~qeff_vision.compile.onnxruntime_backend.generated_input`: floats of
    standard deviation 0.1, zero token ids) is there to give a specialization no prompt reaches its
    ranges; where a prompt's call already ran the same shapes, its processed image and real tokens
    record larger peaks than the noise would, and the duplicate call would only repeat the
    arithmetic (at 1080x1920 a full-depth 0.67 B-parameter tower is ~16 TFLOP a call).
    """
    for feeds in generated:
        if call_shapes(feeds) not in program.shapes_run:
            program.queue(feeds)


def _ask(generator, processor, picture, text: str, fitted: tuple[str, int, int]) -> None:
    """One calibration run: ``fitted`` (prompt, decode steps, length) with ``picture``, teacher-forced."""
    from qeff_vision.runtime.conversation import Conversation

    words, steps, _ = fitted
    generator.token_sampler = lambda _params, prompt_ids: ForcedTokens(
        continuation_ids(processor, text, prompt_ids)
    )
    # Every prompt token's activations are recorded: no prefix kept from the last run.
    chat = Conversation(generator, processor, keep_prefix=False)
    chat.ask([] if picture is None else [picture], words, max_new_tokens=steps)


def continuation_ids(processor, text: str, prompt_ids) -> list[int]:
    """The tokens a calibration prompt is continued with: the first of its own text's tokens.

    Text tokens the model reads in the prompt, so the decode steps see ordinary embedding rows;
    the prompt's last token when the text has none.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:DECODE_STEPS] if text else []
    return [int(i) for i in ids] or [int(np.asarray(prompt_ids).reshape(-1)[-1])]


class ForcedTokens:
    """A request's token choice in calibration: a fixed continuation, the logits never read.

    Teacher forcing: the decode steps' inputs do not depend on the fp32 logits, so every call of
    a prompt is known before any runs and they all share one pass over the weights.
    """

    reads_logits = False

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.count = 0

    def next_token(self, _logits=None) -> int:
        """The next token of the continuation (its last one repeated past its end)."""
        token = self.tokens[min(self.count, len(self.tokens) - 1)]
        self.count += 1
        return token


def _pictures(images: Sequence[Path], resolutions: Sequence[tuple[int, int]]) -> list:
    """The user's calibration images, else a seeded random picture per resolution."""
    from PIL import Image

    from qeff_vision.media import load_image

    if images:
        return [load_image(path) for path in images]
    rng = np.random.default_rng(0)
    return [
        Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))
        for height, width in resolutions
    ]


class _DeferredChecks:
    """The generator's per-chunk output check, run once the deferred calls ran.

    The check reads the chunk's image cursor; reading it at once would run each chunk alone. Only
    the small outputs are held for it (not the caches, not the logits).
    """

    def __init__(self, check, skipped: set[str]):
        self.check, self.skipped = check, skipped
        self.pending: list[tuple[Any, dict]] = []

    def __call__(self, chunk, outputs) -> None:
        self.pending.append((chunk, {k: v for k, v in outputs.items() if k not in self.skipped}))

    def run(self) -> None:
        pending, self.pending = self.pending, []
        for chunk, outputs in pending:
            self.check(chunk, outputs)


def _defer_chunk_checks(generator) -> _DeferredChecks:
    """Replace ``generator``'s chunk check (on this instance) by one that runs after the pass."""
    from qeff_vision import symbols

    skipped = {name for name in generator.language.output_names if name.endswith(symbols.RETAINED_SUFFIX)}
    if generator.logits_name:
        skipped.add(generator.logits_name)
    checks = _DeferredChecks(generator.check_chunk_outputs, skipped)
    generator.check_chunk_outputs = checks
    return checks


class _Fitting:
    """Fits calibration prompts to ``ctx_len`` and remembers what it changed, for one note."""

    def __init__(self, ctx_len: int):
        self.ctx_len = ctx_len
        self.runs = 0
        self.shortened = 0
        self.skipped: list[int] = []  # prompt lengths (tokens, without words) that did not fit

    def fit(self, chat: Any, images: Sequence[Any], text: str) -> tuple[str, int, int] | None:
        """(the longest leading words of ``text`` that fit, decode steps, prompt tokens), or None.

        None when nothing fits.

        A prompt of L tokens fits when L + 1 <= ctx_len (one generated token at least); it then
        runs ``min(DECODE_STEPS, ctx_len - L)`` new tokens.
        """
        self.runs += 1
        words = text.split()

        def length(count: int) -> int:
            return int(chat.prepare(images, " ".join(words[:count])).processed["input_ids"].shape[-1])

        kept = len(words)
        if length(kept) >= self.ctx_len:
            shortest = length(0)
            if shortest >= self.ctx_len:
                self.skipped.append(shortest)
                return None
            low, high = 0, kept - 1  # length(low) fits, length(kept) does not
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if length(middle) < self.ctx_len else (low, middle - 1)
            kept = low
            self.shortened += 1
        tokens = length(kept)
        return " ".join(words[:kept]), min(DECODE_STEPS, self.ctx_len - tokens), tokens

    def note(self) -> str:
        """One line on what was shortened or skipped ('' when every prompt ran whole)."""
        if not self.shortened and not self.skipped:
            return ""
        parts = []
        if self.shortened:
            parts.append(f"{self.shortened} of {self.runs} calibration prompts shortened")
        if self.skipped:
            parts.append(
                f"{len(self.skipped)} skipped (an image's prompt needs {min(self.skipped)}+ tokens "
                "before any words)"
            )
        return f"note: to fit the compiled ctx_len {self.ctx_len}, " + ", ".join(parts)
