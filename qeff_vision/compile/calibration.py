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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.tasks import GENERATE, is_pooling
from qeff_vision.runtime.session import CompiledProgram, int_specializations

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


class RecordingProgram(CompiledProgram):
    """An fp32 program that records the largest magnitude of every float node output it computes.

    It runs the graph slice by slice (:class:`~qeff_vision.numerics.recording.SlicedRecorder`):
    no session holds the whole graph's weights, and each value is reduced to its peak as it is
    produced, so memory does not grow with depth.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        specializations=None,
        slice_bytes: int | None = None,
        deferred: bool = False,
    ):
        from onnx.helper import tensor_dtype_to_np_dtype

        from qeff_vision.numerics.device import float_outputs, value_types
        from qeff_vision.numerics.layer_functions import load_flat_graph
        from qeff_vision.numerics.recording import DEFAULT_SLICE_BYTES, SlicedRecorder

        super().__init__()
        self.path = Path(onnx_path)
        model = load_flat_graph(self.path)  # every call of a layer function recorded on its own
        graph = model.graph
        self.input_dims = {value.name: _dims(value) for value in graph.input}
        self.input_dtypes = {
            value.name: tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type) for value in graph.input
        }
        self.output_names = [value.name for value in graph.output]
        self.output_dims = {value.name: _dims(value) for value in graph.output}
        self.specializations = int_specializations(specializations)
        types = value_types(model)
        self.recorder = SlicedRecorder(
            model,
            self.path.parent,
            float_outputs(model, types),
            types,
            self.output_names,
            slice_bytes=slice_bytes or DEFAULT_SLICE_BYTES,
        )
        self.tape = None
        if deferred:
            from qeff_vision.numerics.deferred import Tape

            self.tape = Tape(self.recorder)

    @property
    def ranges(self) -> dict[str, float]:
        """Node output -> largest magnitude recorded so far."""
        return self.recorder.ranges

    def _execute(self, feeds, bound):
        if self.tape is not None:  # outputs computed when first read, many calls in one pass
            return self.tape.add(feeds, self.output_names)
        return self.recorder.run(feeds)


def _dims(value) -> list:
    """A graph value's dims as a session reports them: ints, symbol names, None when unknown."""
    dims = []
    for dim in value.type.tensor_type.shape.dim:
        dims.append(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None))
    return dims


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
    """
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.export_record import read_export
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
    vision = RecordingProgram(export_dir / manifest["programs"]["vision"]["path"], vision_specializations)
    language_specializations = [single_sequence(values) for values in language_specializations]
    language = RecordingProgram(
        export_dir / manifest["programs"]["lang"]["path"], language_specializations, deferred=True
    )
    vision.recorder.on_slice = language.recorder.on_slice = on_slice
    shape = LanguageShape.from_specializations(language_specializations)
    # No end-of-sequence ids: every calibration prompt runs its DECODE_STEPS, whatever it generates.
    generator = make_generator(checkpoint, vision, language, shape, eos_token_ids=())
    checks = _defer_chunk_checks(generator)
    processor = checkpoint.processor
    for name, value in (processor_options or {}).items():
        setattr(processor.image_processor, name, value)
    pictures = _pictures(images, resolutions)
    fitting = _Fitting(shape.ctx_len)
    total = len(prompts or [DEFAULT_PROMPT]) * (len(pictures) + 1)
    runs = progress_bar("calibration runs", total=total, unit="run")  # on a terminal, unless -q
    for text in prompts or [DEFAULT_PROMPT]:
        for picture in [*pictures, None]:  # each image with the prompt, then the prompt alone
            # Every prompt token's activations are recorded: no prefix kept from the last run.
            chat = Conversation(generator, processor, keep_prefix=False)
            shown = [] if picture is None else [picture]
            fitted = fitting.fit(chat, shown, text)
            if fitted is not None:
                chat.ask(shown, fitted[0], max_new_tokens=fitted[1])
            runs.update()
    if language.tape is not None:
        language.tape.run()
    checks.run()
    runs.close()
    if fitting.note() and say is not None:
        say(fitting.note())
    return {"vision": vision.ranges, "lang": language.ranges}


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

    def fit(self, chat: Any, images: Sequence[Any], text: str) -> tuple[str, int] | None:
        """(the longest leading words of ``text`` that fit, decode steps), or None when nothing fits.

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
        return " ".join(words[:kept]), min(DECODE_STEPS, self.ctx_len - length(kept))

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
