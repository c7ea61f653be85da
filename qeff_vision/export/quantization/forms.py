"""Building blocks the format readers share: integer unpacking and scale grids in one-axis form."""

from __future__ import annotations

import math

import torch

from qeff_vision.export.quantized_weight import QuantizedWeight


def unpack_words(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """``bits``-wide unsigned values packed low bits first into int32 words along ``dim``.

    Value ``k`` of a word sits at bits ``[bits * k, bits * (k + 1))``; ``length`` values are kept
    along ``dim`` (the last word may be padded). This is GPTQ's and compressed-tensors' order for
    4 and 8 bits; AWQ permutes within each word afterwards (:func:`awq_order`).
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = words.movedim(dim, -1).unsqueeze(-1)
    values = torch.bitwise_and(torch.bitwise_right_shift(moved, shifts), (1 << bits) - 1)
    values = values.reshape(*moved.shape[:-2], moved.shape[-2] * per_word).narrow(-1, 0, length)
    return values.to(torch.uint8).movedim(-1, dim)


def expand_rows(grid: torch.Tensor, block_rows: int, rows: int) -> torch.Tensor:
    """A grid of one value per ``block_rows`` rows (axis -2) repeated to one per row."""
    if block_rows == 1:
        return grid
    return grid.repeat_interleave(block_rows, dim=-2).narrow(-2, 0, rows)


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight ``shape`` in blocks of ``block`` over its last two axes."""
    rows, cols = shape[-2:]
    return (*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def grid_form(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block: tuple[int, int],
    bits: int,
    scheme: str,
) -> QuantizedWeight:
    """A weight [..., rows, cols] whose scale (and zero point) holds one value per ``block``.

    A single scale value is per-tensor. Otherwise the grid is repeated along the rows (2-D
    blocks become blocks along the last axis, the one ``DequantizeLinear`` blocks on), so
    ``scale`` is [..., rows, ceil(cols / block[1])] with ``axis`` the last axis.
    """
    if scale.numel() == 1 and zero is None:
        return QuantizedWeight(data, bits, scale.reshape(()), None, 0, 0, scheme)
    if tuple(scale.shape) != grid_shape(tuple(data.shape), block):
        raise ValueError(
            f"{scheme}: scale {tuple(scale.shape)} is not the {block} block grid of {tuple(data.shape)}"
        )
    rows = data.shape[-2]
    scale = expand_rows(scale, block[0], rows)
    zero = None if zero is None else expand_rows(zero, block[0], rows)
    return QuantizedWeight(data, bits, scale, zero, data.dim() - 1, block[1], scheme)
