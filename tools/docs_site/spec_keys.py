"""The spec reference page: every key the spec schema accepts, generated from the schema.

The keys come from the tuples the loader checks a spec against (``qeff_vision/spec/schema.py``,
``compile_options.py``, ``deployment.py``, the sampler's options and every family's declared
image-processor options); each description is the ``Attributes:`` entry of the dataclass that
holds the parsed value. A key the schema gains without a description stops the site build
(:class:`MissingDescription`), so the page cannot fall behind the schema.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from qeff_vision.contract.sampler_io import SamplerOptions
from qeff_vision.families import all_families
from qeff_vision.spec import compile_options as co
from qeff_vision.spec import deployment as dep
from qeff_vision.spec import model as spec_model
from qeff_vision.spec import schema
from qeff_vision.spec.weights import WEIGHTS_KEYS, WeightsSpec


class MissingDescription(RuntimeError):
    """A spec key has no description (its dataclass attribute is undocumented)."""


@dataclass(frozen=True)
class Key:
    """One spec key: its YAML path, the description, and the allowed values when they are a list."""

    path: str
    description: str


def attributes(cls: type) -> dict[str, str]:
    """The Google-style ``Attributes:`` entries of ``cls``'s docstring, as one line each."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    found: dict[str, str] = {}
    inside, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break
        match = re.match(r"^    (\w+)(?: \([^)]*\))?: (.*)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif current and line.startswith("        "):
            found[current] += " " + line.strip()
    return found


#: Keys whose value is parsed into a differently named attribute, or into no dataclass at all;
#: everything else takes its dataclass attribute's documentation.
EXTRA = {
    "config": "Optional pinned `config.json` snapshot (relative to the spec); with it the spec works "
    "offline, and a `preprocessor_config.json` beside it is read too. Without it, `model` must be a "
    "directory or in the local Hugging Face cache for validate and specialize; compile downloads the "
    "id's config.",
    "specialization_layout": attributes(spec_model.Spec)["layout"] + " Default `flat`.",
    "prefill": "Prefill chunk buckets (the mapping holding `seq_lens`).",
    "vision": "Images, clips, images per request and the vision-size policy (a mapping).",
    "compile": "Typed compiler options of both programs (a mapping): top-level keys apply to both "
    "programs, `vision:` and `language:` override them; unknown keys are errors.",
    "prefill.seq_lens": "Chunk buckets: unique, 2..ctx_len; one language specialization each.",
    "vision.videos": "Clips (families with video): one vision specialization per (resolution, frames).",
    "vision.images[].height": "Image height in pixels, before the processor resizes it.",
    "vision.images[].width": "Image width in pixels, before the processor resizes it.",
    "vision.images[].frames": "Frames of the entry (1 for a still image).",
    "vision.videos[].height": "Frame height in pixels, before resizing.",
    "vision.videos[].width": "Frame width in pixels, before resizing.",
    "vision.videos[].frames": "Frames of the clip (even for the Qwen-VL families: 2 per temporal patch).",
    "compile.vision": "Options of the vision program only (overriding the top-level ones).",
    "compile.language": "Options of the language program only (overriding the top-level ones).",
    "compile.comp_ctx_lengths": inspect.cleandoc(co.CompCtxLengths.__doc__ or "").splitlines()[0],
    "compile.calibration": inspect.cleandoc(co.Calibration.__doc__ or "").splitlines()[0],
    "kv_cache_prefix": attributes(dep.Deployment)["kv_cache_prefix"],
    "deployment": attributes(dep.Deployment)["mode"],
}


def _described(path: str, documented: dict[str, str], name: str) -> Key:
    text = EXTRA.get(path) or documented.get(name)
    if not text:
        raise MissingDescription(
            f"spec key {path!r} has no description: document it in its dataclass's Attributes "
            "or in tools/docs_site/spec_keys.py EXTRA"
        )
    return Key(path, text)


def spec_keys() -> list[Key]:
    """Every key a spec may hold, in schema order, with its description."""
    top = attributes(spec_model.Spec) | attributes(dep.Deployment)
    keys = [_described(key, top, key) for key in schema.TOP_KEYS]
    keys += [_described(f"prefill.{key}", {}, key) for key in schema.PREFILL_KEYS]
    vision = attributes(spec_model.VisionSpec)
    keys += [_described(f"vision.{key}", vision, key) for key in schema.VISION_KEYS]
    keys += [_described(f"vision.images[].{key}", {}, key) for key in schema.IMAGE_KEYS]
    keys += [_described(f"vision.videos[].{key}", {}, key) for key in schema.VIDEO_KEYS]
    for family in all_families():
        for option, values in family.image_processor_options.items():
            text = f"{family.title} only: one of {', '.join(map(str, values))}."
            keys.append(Key(f"vision.image_processor.{option}", text))
    weights = attributes(WeightsSpec)
    keys += [_described(f"weights.{key}", weights, key) for key in WEIGHTS_KEYS]
    program = attributes(co.ProgramOptions)
    vision_keys = [key for key in co.PROGRAM_KEYS if key not in co.LANGUAGE_ONLY_KEYS]
    keys += [_described(f"compile.{key}", program, key) for key in co.PROGRAM_KEYS]
    listed = ", ".join(f"`{key}`" for key in vision_keys)
    keys.append(Key(f"compile.{co.VISION}", f"{EXTRA['compile.vision']} Keys: {listed}."))
    keys.append(
        Key(f"compile.{co.LANGUAGE}", f"{EXTRA['compile.language']} Keys: every `compile.*` option above.")
    )
    sampler = attributes(SamplerOptions)
    for key in SamplerOptions().to_dict():
        keys.append(_described(f"compile.language.sampler.{key}", sampler, key))
    keys.append(_described(f"compile.{co.CCL_KEY}", {}, co.CCL_KEY))
    ccl = attributes(co.CompCtxLengths)
    keys += [_described(f"compile.{co.CCL_KEY}.{phase}", ccl, phase) for phase in co.CCL_PHASES]
    keys.append(_described(f"compile.{co.CALIBRATION_KEY}", {}, co.CALIBRATION_KEY))
    calibration = attributes(co.Calibration)
    for key in ("images", "prompts"):
        keys.append(_described(f"compile.{co.CALIBRATION_KEY}.{key}", calibration, key))
    return keys


def _markdown(text: str) -> str:
    # Docstrings use reST roles and double backticks; show both as code.
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    return text.replace("``", "`").replace("|", "\\|")


def spec_keys_page() -> str:
    """The Markdown page listing every spec key."""
    lines = [
        "# Spec keys",
        "",
        "*Generated at build time from the spec schema (`qeff_vision/spec/schema.py`, "
        "`compile_options.py`, `deployment.py`) and the documentation of the dataclasses the values "
        "are read into: every key `qeff-vision validate` accepts is here, and no other.* "
        "How a spec is used: [Specs](specs.md).",
        "",
        "| key | meaning |",
        "| --- | --- |",
    ]
    lines += [f"| `{key.path}` | {_markdown(key.description)} |" for key in spec_keys()]
    lines.append("")
    return "\n".join(lines)
