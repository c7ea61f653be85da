"""A spec ``validate`` accepts serves what it declares (issue 53 item 5), over every family.

What a family keeps in one chunk (a whole image when it cannot split one: Gemma 3's and Gemma
4's bidirectional images, mllama's tiles; Molmo2's joined images and the text between them) must
fit one prefill bucket for every combination of up to ``max_images`` listed images, or
``validate`` refuses the spec in one line naming the combination and the bucket it needs.

For each family, from its own spec under specs/ (pinned config, offline):

* a family with such a rule: buckets one token short of what the largest declared combination
  needs are refused, in one line naming it; with a bucket that holds it, the spec validates;
* every family: the spec as validated serves its largest combination (``max_images`` copies of
  the widest listed image): the run-time planner (:func:`qeff_vision.runtime.planner.plan_chunks`)
  plans that prompt on the buckets the specializations compile, where before a spec could
  validate and compile and then refuse the request (Molmo2, buckets [24, 48]).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qeff_vision import api, symbols
from qeff_vision.contract.segments import Segment
from qeff_vision.families import all_families, get_family
from qeff_vision.runtime.planner import PrefillBucket, plan_chunks
from qeff_vision.spec import build_specializations, load_spec
from qeff_vision.spec.schema import ImageSize

SPECS = Path(__file__).resolve().parent.parent / "specs"
TEXT = 6  # text tokens before the images and after them


def _base_spec(family: str) -> dict:
    """The family's plain spec (not single, not a variant), its config path made absolute."""
    paths = sorted((SPECS / family).glob("*.yaml"), key=lambda p: (len(p.stem), p.stem))
    data = yaml.safe_load(paths[0].read_text())
    data["config"] = str((paths[0].parent / data["config"]).resolve())
    data.pop("deployment", None)
    data["vision"]["max_images"] = 2
    data["vision"].pop("videos", None)
    data["vision"].pop("patch_buckets", None)
    data["ctx_len"] = max(int(data["ctx_len"]), 32768)
    return data


def _validate(tmp_path: Path, data: dict) -> list[str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    problems, _ = api.validate(path)
    return problems


def _largest(spec) -> tuple[ImageSize, list[int], int]:
    """(widest listed image, the extents and rows of max_images copies of it, tokens between)."""
    family, model = get_family(spec.family), spec.model_description
    images = [image for image in spec.vision.images if not image.video]
    widest = max(images, key=lambda image: family.image_extent(model, image))
    return widest, family.image_extent(model, widest), family.image_tokens(model, widest)


def _runs(start: int, extent: int, rows: int, splits: bool) -> tuple[tuple[int, int], ...]:
    """The placeholder runs of an image whose span (``extent``) holds tokens other than its rows.

    A family that splits images puts ordinary tokens between runs of placeholders (Mistral 3's
    ``[IMG_BREAK]`` after each row, Llama 4's tile separators): one break token between runs of
    near-equal length here. One that keeps images whole sees one indivisible span.
    """
    if extent == rows:
        return ()
    if not splits:
        return ((start, extent),)
    breaks = extent - rows
    assert breaks < rows, (extent, rows)
    sizes = [rows // (breaks + 1) + (i < rows % (breaks + 1)) for i in range(breaks + 1)]
    runs, position = [], start
    for size in sizes:
        runs.append((position, size))
        position += size + 1
    return tuple(runs)


def _serves(spec) -> None:
    """Plan a prompt holding ``max_images`` of the widest listed image on the compiled buckets."""
    family, model = get_family(spec.family), spec.model_description
    _, extent, rows = _largest(spec)
    count = spec.vision.max_images
    segments, position = [], TEXT
    for number in range(1, count + 1):
        if number > 1:
            position += family.tokens_before_image(model, number)
        runs = _runs(position, extent, rows, family.splits_images(model))
        segments.append(Segment(position, rows, runs, joined=family.joins_images and number > 1))
        position += extent
    language = build_specializations(spec).language.specializations
    buckets = [
        PrefillBucket(int(item.symbols[symbols.SEQ_LEN]), int(item.symbols.get(symbols.VISION_SIZE, 1 << 30)))
        for item in language
        if int(item.symbols[symbols.SEQ_LEN]) > 1
    ]
    plan = plan_chunks(
        position + TEXT, segments, buckets, allow_image_split=family.splits_images(model), protocol="chunk"
    )
    assert plan.chunks


def _loaded(tmp_path: Path, data: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_spec(path)


@pytest.mark.parametrize("family", [f.name for f in all_families()])
def test_declared_images_must_fit_the_chunk_they_share(family, tmp_path):
    data = _base_spec(family)
    assert _validate(tmp_path, data) == [], family
    spec = _loaded(tmp_path, data)
    kind, model = get_family(spec.family), spec.model_description
    _serves(spec)  # the spec as it validates serves its largest combination
    whole = not kind.splits_images(model)
    if not (whole or kind.joins_images):
        return  # no rule: any prompt chunks at any bucket (checked above on the spec's buckets)
    widest, extent, rows = _largest(spec)
    label = f"{widest.height}x{widest.width}"
    if kind.joins_images:
        need = 2 * extent + kind.tokens_before_image(model, 2)
        needle = f"2 images ({label} + {label}) are one run of {need} tokens"
    else:
        need = extent
        needle = f"{label} is {extent} tokens"
    short = {**data, "prefill": {**data["prefill"], "seq_lens": [need - 1]}}
    problems = _validate(tmp_path, short)
    assert len(problems) == 1, problems
    assert needle in problems[0] and f"seq_len >= {need}" in problems[0], problems[0]
    enough = {**data, "prefill": {**data["prefill"], "seq_lens": [need]}}
    assert _validate(tmp_path, enough) == [], family
    _serves(_loaded(tmp_path, enough))


def test_the_issue_molmo2_example_is_refused(tiny_checkpoint, tmp_path):
    """A CB Molmo2 spec, buckets [24, 48], max_images 2, three listed sizes: refused, naming the pair."""
    data = {
        "name": "molmo2-cb",
        "model": str(tiny_checkpoint("molmo2")),
        "ctx_len": 512,
        "full_batch_size": 2,
        "prefill": {"seq_lens": [24, 48]},
        "vision": {
            "images": [
                {"height": 112, "width": 112},
                {"height": 140, "width": 196},
                {"height": 196, "width": 140},
            ],
            "max_images": 2,
            "vision_size": "chunk",
        },
    }
    problems = _validate(tmp_path, data)
    assert len(problems) == 1, problems
    # What run --requests refused before: "the images at tokens [8, 59) ... seq_len >= 51 and
    # vision_size >= 26" (the tiny tokenizer spells "Image 2" in 7 tokens).
    assert "2 images (112x112 + 112x112) are one run of 51 tokens (26 image rows)" in problems[0]
    assert "add a bucket with seq_len >= 51 and vision_size >= 26" in problems[0]
    data["prefill"]["seq_lens"] = [24, 48, 64]
    assert _validate(tmp_path, data) == []


def test_every_spec_in_specs_validates():
    problems = {str(path): api.validate(path)[0] for path in sorted(SPECS.glob("*/*.yaml"))}
    assert {path: found for path, found in problems.items() if found} == {}
