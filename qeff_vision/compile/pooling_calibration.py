"""Calibration prompts through a pooling export (spec ``task: embed | score``).

The same prompts and pictures as the generate calibration (:func:`qeff_vision.compile.calibration.
prompt_ranges`: each image with each prompt, then each prompt alone), each pooled once by
:class:`~qeff_vision.runtime.pooling.Pooler` on recording programs, so the precision plan sees the
activations of the very calls the device will run. A prompt longer than the largest bucket is
skipped (it could never run) and counted in one note.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np


def pooling_ranges(
    export_dir: Path,
    vision_specializations: Sequence[Mapping[str, int]],
    language_specializations: Sequence[Mapping[str, int]],
    pictures: Sequence,
    prompts: Sequence[str],
    say: Callable[[str], None] | None = None,
    processor_options: Mapping[str, int] | None = None,
    on_slice: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Per program (``vision``, ``lang``): node output -> largest magnitude over the prompts."""
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.compile.recording_program import RecordingProgram
    from qeff_vision.errors import UserError
    from qeff_vision.export_record import read_export
    from qeff_vision.runtime.pooling import Pooler

    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    vision = RecordingProgram(export_dir / manifest["programs"]["vision"]["path"], vision_specializations)
    language = RecordingProgram(export_dir / manifest["programs"]["lang"]["path"], language_specializations)
    vision.recorder.on_slice = language.recorder.on_slice = on_slice
    pooler = Pooler(checkpoint, vision, language, manifest["task"])
    processor = checkpoint.processor
    for name, value in (processor_options or {}).items():
        setattr(processor.image_processor, name, value)
    skipped = 0
    for text in prompts:
        for picture in [*pictures, None]:
            shown = [] if picture is None else [picture]
            content = [{"type": "image"}] * len(shown) + [{"type": "text", "text": text}]
            chat = processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True
            )
            processed = processor(text=[chat], images=shown or None, return_tensors="np")
            try:
                pooler.pool({k: np.asarray(v) for k, v in processed.items()})
            except UserError:  # longer than the largest bucket: a call the device never runs
                skipped += 1
    if skipped and say is not None:
        say(f"calibration: {skipped} prompt(s) longer than the largest bucket skipped")
    return {"vision": vision.ranges, "lang": language.ranges}
