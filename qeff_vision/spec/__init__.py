"""Specs: YAML schema, strict loading, vision-size policy and specialization generation. No torch.

A spec names a checkpoint and the shapes to compile it for; this package checks it (every problem
at once, each with its YAML path) and turns it into the compiler's specialization and custom-IO
files for the vision and the language program::

    from qeff_vision.spec import build_specializations, load_spec, write_specializations

    spec = load_spec("specs/qwen2_5_vl/qwen2_5_vl-3b-instruct.yaml")   # raises SpecError
    result = build_specializations(spec)                              # pure, no I/O
    result.language.specializations[0].symbols                        # {"batch_size": "1", ...}
    write_specializations(result, "out/")   # out/{vision,lang}/{specializations.json,custom_io.yaml}

See docs/guide/specs.md for the file format (docs/guide/spec-keys.md, generated, lists every key).
"""

from qeff_vision.spec.loader import find_specs, load_spec, spec_from_data
from qeff_vision.spec.model import AUTO, DTYPES, FLAT, LAYOUTS, NAMED, PrefillSpec, Spec, VisionSpec
from qeff_vision.spec.policy import VisionSizePolicy, chunk_span, decode_vision_size, prefill_vision_sizes
from qeff_vision.spec.specializations import (
    CUSTOM_IO_FILE,
    SPECIALIZATIONS_FILE,
    ImageChunks,
    ProgramFiles,
    ProgramSpecializations,
    Specialization,
    build_specializations,
    resolve_layout,
    write_specializations,
)
from qeff_vision.spec.table import specialization_table

__all__ = [
    "AUTO",
    "CUSTOM_IO_FILE",
    "DTYPES",
    "FLAT",
    "LAYOUTS",
    "NAMED",
    "SPECIALIZATIONS_FILE",
    "ImageChunks",
    "PrefillSpec",
    "ProgramFiles",
    "ProgramSpecializations",
    "Spec",
    "Specialization",
    "VisionSizePolicy",
    "VisionSpec",
    "build_specializations",
    "chunk_span",
    "decode_vision_size",
    "find_specs",
    "load_spec",
    "prefill_vision_sizes",
    "resolve_layout",
    "spec_from_data",
    "specialization_table",
    "write_specializations",
]
