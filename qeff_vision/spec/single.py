"""Specializations of ``deployment: single``: one ``lang`` program holding the encoder.

The program is the vision graph composed into the language graph
(:mod:`qeff_vision.compile.single_program`). Its ``vision_embeds`` is a retained buffer of the
most image rows one request carries (``max_images`` x the largest image), so every
specialization binds that one ``vision_size``. Three kinds of entries, all batch 1:

- ``Encode-<S>-<n>x<image>``: a first prefill chunk of S tokens that encodes the request's n
  images (n = 1 .. ``max_images``, one per vision specialization's resolution) and writes their
  rows at the front of the buffer;
- ``Prefill-<S>``: a later chunk (or a text-only prompt): the image symbols bound to 1, the
  buffer kept, rows read by ``image_idx``;
- ``Decode``: one token, no encoder.

A cross-attention family (mllama) has no ``vision_size``: its retained buffers are the cross
layers' K/V, whose rows the language entries already bind (``cross_states``, ``max_images`` x one
image's states), and its encode entries bind the encoded image count ``num_images`` beside the
language's ``max_num_images`` (the mask's image slots).

A compiler folds the encoder's If per specialization (its condition is a shape), so only the
``Encode`` entries hold the vision tower. Pure; no torch, no onnx.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations_with_replacement
from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.deployment_programs import KEEP_SIDE
from qeff_vision.symbols import NUM_IMAGES, PIXEL_SIDE

ENCODE = "Encode"
KEEP = str(KEEP_SIDE)  # the keep entries' image symbols


def _image_symbols(
    vision_entry: Any, images_symbol: str | None = symbols.BATCH_SIZE, language: Any = ()
) -> dict[str, str]:
    """The composed graph's image-input symbols of one vision specialization (outputs dropped).

    ``images_symbol`` (the vision graph's image count) becomes ``num_images``; symbols the
    language entries bind (mllama's ``batch_size``, and its ``cross_states``, the vision output's
    rows there but the retained K/V's in the composed graph) take the language's values.
    """
    renamed = {
        (NUM_IMAGES if name == images_symbol else name): value
        for name, value in vision_entry.symbols.items()
        if name != symbols.VISION_SIZE  # the vision output's rows: internal to the composed graph
    }
    return {name: value for name, value in renamed.items() if name not in language}


def single_program(
    vision: Any,
    language: Any,
    request_rows: int,
    max_images: int,
    pixel_side: int | None = None,
    images_symbol: str | None = symbols.BATCH_SIZE,
    summed: str | None = None,
) -> Any:
    """The ``lang`` program files of a single deployment from the dual pair's files.

    Args:
        vision: The dual vision ``ProgramFiles`` (one entry per resolution).
        language: The dual language ``ProgramFiles`` (prefill buckets, then decode).
        request_rows: The retained buffer's rows: the most image rows one request carries.
        max_images: The most images one request carries.
        pixel_side: The vision graph's fixed pixel side, or None when its side is a symbol. The
            composed graph names a fixed side ``pixel_side``: encode entries bind it, keep
            entries 1.
        images_symbol: The vision graph's symbol counting the images of one call (the family's
            ``vision_images_symbol``), ``num_images`` in the composed graph. None: the graph
            has no such axis and takes images as batches of tiles (InternVL); one encode call
            takes the tiles of every image of the prompt, so an encode entry exists per
            combination of resolutions, its tile count their sum.
        summed: The pixel input's patch-axis symbol when that input concatenates a call's images
            on it (a patch sequence, Qwen-VL's [patches, patch_dim]: the family's
            ``single_encode_axis``); an entry of n images binds it to n times one image's.

    Returns:
        One ``ProgramFiles`` (directory ``lang``) with the language custom IO.
    """
    buffer = {symbols.VISION_SIZE: str(request_rows)}
    entries = []
    bound = {name for entry in language.specializations for name in entry.symbols}
    keep_images = {name: KEEP for name in _image_symbols(vision.specializations[0], images_symbol, bound)}
    side = {} if pixel_side is None else {PIXEL_SIDE: str(pixel_side)}
    tiled = images_symbol is None
    if pixel_side is not None:
        keep_images[PIXEL_SIDE] = KEEP
    for entry in language.specializations:
        base = dict(entry.symbols)
        decode = entry.name.startswith("Decode")
        if not decode and tiled:
            entries += _tile_entries(entry, vision.specializations, max_images, pixel_side, buffer)
        elif not decode:
            for image in vision.specializations:
                pixels = {**_image_symbols(image, images_symbol, bound), **side}
                for count in range(1, max_images + 1):
                    joined = {summed: str(count * int(pixels[summed]))} if summed in pixels else {}
                    encode = _ordered(base, {**pixels, **joined, NUM_IMAGES: str(count)}, buffer)
                    name = f"{ENCODE}-{base[symbols.SEQ_LEN]}-{count}x{image.name.removeprefix('Vision-')}"
                    entries.append(replace(entry, name=name, symbols=encode))
        entries.append(replace(entry, symbols=_ordered(base, keep_images, buffer)))
    # The image inputs keep the vision program's precision (its custom IO, outputs dropped: the
    # rows stay inside the program); the language's entries follow, vision_embeds among them.
    named = {name for name, _ in language.custom_io}
    images = tuple((name, kind) for name, kind in vision.custom_io if name not in named)
    return replace(language, specializations=tuple(entries), custom_io=images + tuple(language.custom_io))


def _tile_entries(entry: Any, images: Any, max_images: int, side: int, buffer: dict[str, str]) -> list[Any]:
    """Encode entries of a fixed-side (tiled) vision graph: one per distinct tile total.

    Each is ``entry`` (a prefill entry) renamed and given the images' symbols (built from the
    entry, so this module needs no import of the specialization type's module, which imports it).
    """
    base = dict(entry.symbols)
    entries, seen = [], []
    for count in range(1, max_images + 1):
        for combo in combinations_with_replacement(images, count):
            tiles = [_image_symbols(image) for image in combo]
            summed = {name: str(sum(int(t[name]) for t in tiles)) for name in tiles[0] if name != NUM_IMAGES}
            symbols_ = {**summed, PIXEL_SIDE: str(side)}
            if symbols_ in seen:  # another combination of the same tile total
                continue
            seen.append(symbols_)
            shapes = "+".join(image.name.removeprefix("Vision-") for image in combo)
            name = f"{ENCODE}-{base[symbols.SEQ_LEN]}-{count}x{shapes}"
            entries.append(replace(entry, name=name, symbols=_ordered(base, symbols_, buffer)))
    return entries


def _ordered(base: dict[str, str], images: dict[str, str], buffer: dict[str, str]) -> dict[str, str]:
    """Symbols in graph order: the language's up to ``seq_len``, the image inputs', then the rest."""
    out: dict[str, str] = {}
    for name, value in base.items():
        out[name] = buffer.get(name, value)
        if name == symbols.SEQ_LEN:
            out.update(images)
    return out
