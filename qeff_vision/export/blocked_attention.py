"""Attention in static blocks: the largest intermediate of an exported attention stays under a bound.

An eager attention over N queries and K keys materializes the scores [heads, N, K] (and the
softmax makes a second tensor of that size): Qwen2.5-VL-3B's full-attention vision layers at a
1080x1920 image hold 16 x 10,764^2 values per tensor, 3.7 GB in fp16. Two blocked forms bound it,
both plain static-shape ONNX (slices, matmuls, softmax; no ``Loop``, no data-dependent shape):

* **Query blocks** (:func:`query_blocked_attention`, vision towers): each query row's softmax
  reads only its own scores, so attending ``blocks`` slices of the query rows one after another
  gives the eager result exactly; only one block's scores are alive at a time.
* **Key blocks with an online softmax** (:func:`key_blocked_attention`, the language program):
  a decode call has one query row, so its blocks must run along the keys (the context): each block
  updates a running maximum, denominator and weighted sum (the "flash" recurrence; QEfficient's
  ``blocked_kv_attention_forward`` in ``QEfficient/transformers/blocked_attention_utils.py`` does
  the same for its language decoders, with ``num_kv_blocks`` fixed at export).

The block *count* is fixed when the graph is traced, because a graph's node list cannot depend on
a specialization; the block *boundaries* are ``floor(i * N / blocks)``, shape arithmetic on the
symbolic length, so every specialization gets blocks of ``ceil(N / blocks)`` rows at most, none
empty while ``N >= blocks``. A smaller N (an image with fewer patches than the count) would leave
blocks empty, which a compiler would have to take as zero-sized tensors: query blocks use
:func:`covering_bounds` instead, where such a block computes one row twice and a gather of each
row's first copy assembles the output (expert blocks never exceed top-k, see export/experts.py). The count
comes from :class:`AttentionBlocking`: the smallest that keeps one block's scores under the bound at
the largest length the policy is sized for (``vision_rows`` rows; ``language_rows`` x
``language_keys`` for the language program). Lengths are fixed per specialization, so the compile
measures every specialization's largest intermediate on the graph
(:mod:`qeff_vision.compile.activation_memory`) and reports one that still exceeds the bound.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from qeff_vision.contract.attention_blocking import UNBLOCKED, AttentionBlocking

__all__ = ["UNBLOCKED", "AttentionBlocking", "blocking", "key_blocked_attention", "query_blocked_attention"]

_active: AttentionBlocking = AttentionBlocking()


@contextlib.contextmanager
def blocking(policy: AttentionBlocking) -> Iterator[AttentionBlocking]:
    """Trace with ``policy`` as the block-count rule of every attention in this module."""
    global _active
    previous, _active = _active, policy
    try:
        yield policy
    finally:
        _active = previous


def active() -> AttentionBlocking:
    """The policy in force (the default one outside :func:`blocking`)."""
    return _active


def symbolic_length(tensor: torch.Tensor, axis: int):
    """``tensor.shape[axis]``, kept symbolic in a trace (the boundaries follow the specialization)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return tensor.shape[axis]


def bounds(length, blocks: int) -> list[tuple]:
    """``blocks`` balanced ``(start, stop)`` ranges covering ``range(length)``: floor(i * length / blocks)."""
    return [((index * length) // blocks, ((index + 1) * length) // blocks) for index in range(blocks)]


def _scalar(value) -> torch.Tensor:
    """A 0-d int64 tensor of ``value`` (a traced size is one already; an eager size is an int)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.int64)


def covering_bounds(length, blocks: int) -> tuple[list[tuple], torch.Tensor]:
    """``blocks`` non-empty row ranges covering ``range(length)`` and where each row lands.

    :func:`bounds` leaves ``blocks - length`` ranges empty when ``length < blocks`` (an image with
    fewer patches than the trace-time block count), and a compiler may refuse a zero-sized tensor.
    Here a range that would be empty takes one row instead (the row at its start, or the last row),
    computed twice; for a query block that is the same output row twice (each row's softmax is its
    own). Concatenating the ranges' outputs gives ``length`` + (empty ranges) rows.

    Returns:
        The ranges ``[(start, stop)]`` (shape arithmetic on the symbolic length, every one at least
        one row while ``length >= 1``), and ``positions`` [length] int64: the row of the
        concatenation holding row r (the first copy): r plus the empty ranges starting at or before
        r. With no empty range it is ``arange(length)``.
    """
    size = _scalar(length)
    last = size - 1
    ranges = []
    for start, stop in bounds(length, blocks):
        first = torch.minimum(_scalar(start), last)
        ranges.append((first, first + torch.clamp(_scalar(stop) - _scalar(start), min=1)))
    starts = torch.div(torch.arange(blocks + 1, dtype=torch.int64) * size, blocks, rounding_mode="floor")
    empty = starts[1:] == starts[:-1]  # [blocks]
    rows = torch.arange(size, dtype=torch.int64)
    before = (starts[:-1].unsqueeze(0) <= rows.unsqueeze(1)) & empty.unsqueeze(0)  # [length, blocks]
    return ranges, rows + before.to(torch.int64).sum(1)


def _rows(tensor: torch.Tensor | None, start, stop, axis: int = -2) -> torch.Tensor | None:
    """Rows ``start:stop`` of ``tensor`` along ``axis`` (a broadcast axis of size 1 stays whole)."""
    if tensor is None or tensor.shape[axis] == 1:
        return tensor
    index = [slice(None)] * tensor.dim()
    index[axis] = slice(start, stop)
    return tensor[tuple(index)]


def key_rows(mask: torch.Tensor, start, stop) -> torch.Tensor:
    """Keys ``start:stop`` of an additive mask [..., K] (a broadcast key axis stays whole)."""
    return _rows(mask, start, stop, axis=-1)


def segment_mask(query_segment: torch.Tensor, key_segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [queries, keys] mask: 0 where the segments match, the dtype's minimum elsewhere."""
    same = query_segment.unsqueeze(-1) == key_segment.unsqueeze(-2)
    return torch.where(same, 0.0, torch.finfo(dtype).min).to(dtype)


def query_blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    *,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    blocks: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v, computed for a block of query rows at a time.

    Args:
        query: [..., N, D]; key, value: [..., K, D] (the leading dims broadcast as in ``matmul``).
        scaling: Score scale.
        mask: Additive mask broadcastable to [..., N, K] (its query axis of size N or 1), or None.
        segments: Instead of ``mask``: [N] segment ids of the queries and keys (N = K); a query
            attends the keys of its own segment. Each block builds its own [rows, K] mask, so the
            whole [N, N] mask never exists either.
        blocks: Query blocks (None: the active policy's count for this attention's heads).

    Returns:
        [..., N, D] in ``value``'s dtype (softmax in float32, as transformers' eager path).
    """
    # Heads, not the batch: the policy sizes one image's attention (a call of b same-size images
    # holds b times one block's scores).
    heads = int(query.shape[-3]) if query.dim() > 2 else 1
    count = blocks if blocks is not None else _active.vision_count(heads)
    length = symbolic_length(query, -2)
    ranges, positions = covering_bounds(length, count) if count > 1 else ([(None, None)], None)
    outputs = []
    for start, stop in ranges:
        rows = query if start is None else query[..., start:stop, :]
        scores = torch.matmul(rows, key.transpose(-1, -2)) * scaling
        if segments is not None:
            own = segments if start is None else segments[start:stop]
            scores = scores + segment_mask(own, segments, scores.dtype)
        elif mask is not None:
            scores = scores + (mask if start is None else _rows(mask, start, stop))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        outputs.append(torch.matmul(weights, value))
    if len(outputs) == 1:
        return outputs[0]
    # Each row's first copy (a block that would be empty repeats a row; none is ever zero-sized).
    return torch.cat(outputs, dim=-2).index_select(-2, positions)


def key_blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scores_of,
    blocks: int,
) -> torch.Tensor:
    """Attention over ``blocks`` blocks of keys with an online softmax (exact up to rounding).

    Args:
        query: [B, KV, G * S, D] (query heads folded onto their key head).
        key, value: [B, KV, K, D].
        scores_of: ``scores_of(start, stop)`` -> the block's final scores [B, KV, G * S, stop - start]
            (scaled, soft-capped, masked), in float32.
        blocks: Key blocks.

    Returns:
        [B, KV, G * S, D] in float32.
    """
    length = symbolic_length(key, -2)
    maximum = total = output = None
    for start, stop in bounds(length, blocks):
        scores = scores_of(start, stop)
        block_max = scores.amax(dim=-1, keepdim=True)
        new_max = block_max if maximum is None else torch.maximum(maximum, block_max)
        weights = torch.exp(scores - new_max)
        block_sum = weights.sum(dim=-1, keepdim=True)
        block_out = torch.matmul(weights.to(value.dtype), value[:, :, start:stop]).float()
        if maximum is None:
            total, output = block_sum, block_out
        else:
            decay = torch.exp(maximum - new_max)
            total = total * decay + block_sum
            output = output * decay + block_out
        maximum = new_max
    return output / total


#: transformers ``AttentionInterface`` name of :func:`interface_attention` (vision towers run by
#: transformers' own layers: Pixtral, Gemma 4).
NAME = "qeff_vision_query_blocked"


def interface_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The eager attention of transformers in query blocks (:func:`query_blocked_attention`).

    Args:
        module: The attention module (inference only: ``dropout`` must be unused).
        query: [B, H, N, D]; key, value: [B, KV, K, D] (KV dividing H: repeated as eager does).
        attention_mask: Additive mask broadcastable to [B, H, N, K], or None.
        scaling: Score scale (``head_dim ** -0.5`` when None).
        dropout: Must be 0 (export runs in eval mode).
        **kwargs: What the layer passes for other implementations; unused.

    Returns:
        (attention output [B, N, H, D], None: the weights are never whole).
    """
    if module.training and dropout:
        raise ValueError("query-blocked attention is for inference export; dropout must be 0")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    rows, batch = _fixed_size
    count = _active.vision_count(int(query.shape[1]), rows, batch)
    output = query_blocked_attention(query, key, value, scaling, mask=attention_mask, blocks=count)
    return output.transpose(1, 2).contiguous(), None


# (rows, batch) of the fixed-size tower in :func:`query_blocked`, or (None, 1): any image.
_fixed_size: tuple[int | None, int] = (None, 1)


@contextlib.contextmanager
def query_blocked(config, rows: int | None = None, batch: int = 1) -> Iterator[None]:
    """Within the block, every attention layer reading ``config`` uses :func:`interface_attention`.

    Set for the encoder's own forward only, and restored after it: the same loaded model's tower
    still runs transformers' eager attention outside (a parity test's reference).

    Args:
        config: The tower's config.
        rows: The attention length when the tower fixes it (its image size's patches); None: any.
        batch: Most same-size attentions one call holds (a tiled image's tiles).
    """
    from transformers import AttentionInterface

    global _fixed_size
    AttentionInterface.register(NAME, interface_attention)
    previous, previous_size = config._attn_implementation, _fixed_size
    config._attn_implementation, _fixed_size = NAME, (rows, batch)
    try:
        yield
    finally:
        config._attn_implementation, _fixed_size = previous, previous_size
