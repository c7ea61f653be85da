"""Qwen2.5-VL patch-bucket host math: per-patch ids and the window layout of a packed encoder call.

A patch-bucket vision program takes ``pixel_values`` padded to the bucket's patch count plus the
ids the graph would otherwise derive from a grid shape (transformers derives them with Python
loops over ``grid_thw``; ref: transformers v5 models/qwen2_5_vl/modeling_qwen2_5_vl.py,
``get_window_index`` and ``rot_pos_emb``):

``patch_ids`` [patches, 5] int64, one row per patch in the processor's order (images one after
another, padding last): rotary row, rotary column, image number (-1: padding), window number
(unique over the call; -1: padding) and the patch's slot in the window layout (padding patches
point one past the layout, at a zero row).

``window_layout`` [window_blocks, block] int64: window blocks of ``block`` slots (one full window:
window side^2 merged tokens x merge^2 patches = 64 in the published checkpoints). Each slot holds
a patch number, or ``patches`` (the zero row) when empty. A window never straddles two blocks;
partial windows at the right and bottom edges share blocks (first-fit decreasing), so a block
count of ``ceil(patches / 48) + 1`` holds any one image that fits the patch count (a block is at
least three quarters full, except the last). The graph masks attention to same-window slots.

Pure numpy; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROW, COL, IMAGE, WINDOW, SLOT = range(5)
ID_COLUMNS = 5


@dataclass(frozen=True)
class Geometry:
    """The tower's patch geometry: merge side (2) and window side in merged tokens (4)."""

    merge: int = 2
    window: int = 4

    @property
    def block(self) -> int:
        """Slots of one window block: a full window's patches."""
        return self.window * self.window * self.merge * self.merge

    def window_blocks(self, patches: int) -> int:
        """Blocks a bucket of ``patches`` patches gets: enough for any one image that fits it.

        A window holds a x b merged tokens (a, b <= window side); only edge windows are partial,
        and first-fit decreasing leaves at most a quarter of a block empty (3 x 4 windows alone)
        except one block for a corner window.
        """
        return math.ceil(patches * 4 / (3 * self.block)) + 1


def image_patch_ids(grid_h: int, grid_w: int, geometry: Geometry) -> tuple[np.ndarray, ...]:
    """(row, column, window) of each patch of one image, in the processor's patch order.

    The processor emits merged tokens row-major, each as its merge x merge patches row-major
    (ref: image_processing_qwen2_vl.py, the ``transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)`` flattening).
    """
    merge, side = geometry.merge, geometry.window
    merged_w = grid_w // merge
    patch = np.arange(grid_h * grid_w)
    token, inner = patch // (merge * merge), patch % (merge * merge)
    token_row, token_col = token // merged_w, token % merged_w
    row = token_row * merge + inner // merge
    col = token_col * merge + inner % merge
    windows_w = -(-merged_w // side)
    window = (token_row // side) * windows_w + token_col // side
    return row, col, window


def windows_needed(grids: Sequence[tuple[int, int]], geometry: Geometry) -> int:
    """Window blocks first-fit decreasing needs for images of these (grid_h, grid_w) patch grids."""
    sizes = []
    for grid_h, grid_w in grids:
        _, _, window = image_patch_ids(grid_h, grid_w, geometry)
        sizes += np.bincount(window).tolist()
    return len(_first_fit(sizes, geometry.block))


def _first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Window numbers per block, first-fit decreasing: largest first, into the first block with room."""
    blocks: list[list[int]] = []
    room: list[int] = []
    for number in sorted(range(len(sizes)), key=lambda n: -sizes[n]):
        size = sizes[number]
        for index, free in enumerate(room):
            if size <= free:
                blocks[index].append(number)
                room[index] -= size
                break
        else:
            blocks.append([number])
            room.append(capacity - size)
    return blocks


def pack_patch_ids(
    grids: Sequence[tuple[int, int]], patches: int, window_blocks: int, geometry: Geometry
) -> tuple[np.ndarray, np.ndarray] | None:
    """``patch_ids`` and ``window_layout`` for images of these grids packed into one call, or None.

    Args:
        grids: (grid_h, grid_w) patch grid of each image, in the order of their pixel rows.
        patches: The bucket's patch count (rows of ``pixel_values``).
        window_blocks: The bucket's window blocks.
        geometry: The tower's merge and window sides.

    Returns:
        (patch_ids [patches, 5], window_layout [window_blocks, block]), or None when the images'
        patches or windows do not fit the bucket.
    """
    if sum(h * w for h, w in grids) > patches:
        return None
    ids = np.zeros((patches, ID_COLUMNS), dtype=np.int64)
    ids[:, IMAGE] = ids[:, WINDOW] = -1
    ids[:, SLOT] = window_blocks * geometry.block  # padding: the zero row past the layout
    members: list[np.ndarray] = []  # patch numbers of each window, over the call
    start = 0
    for number, (grid_h, grid_w) in enumerate(grids):
        row, col, window = image_patch_ids(grid_h, grid_w, geometry)
        count = grid_h * grid_w
        stop = start + count
        ids[start:stop, ROW], ids[start:stop, COL], ids[start:stop, IMAGE] = row, col, number
        ids[start:stop, WINDOW] = window + len(members)
        order = np.argsort(window, kind="stable")
        bounds = np.cumsum(np.bincount(window))[:-1]
        members += [start + part for part in np.split(order, bounds)]
        start = stop
    blocks = _first_fit([len(m) for m in members], geometry.block)
    if len(blocks) > window_blocks:
        return None
    layout = np.full((window_blocks, geometry.block), patches, dtype=np.int64)
    for block, numbers in enumerate(blocks):
        offset = 0
        for number in numbers:
            patch_numbers = members[number]
            layout[block, offset : offset + len(patch_numbers)] = patch_numbers
            ids[patch_numbers, SLOT] = block * geometry.block + offset + np.arange(len(patch_numbers))
            offset += len(patch_numbers)
    return ids, layout
