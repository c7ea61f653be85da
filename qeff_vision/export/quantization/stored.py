"""A parameter's stored (quantized) form after its source's conversions, for ``WeightPlan.stored``.

The conversions of :mod:`qeff_vision.export.weight_sources` (axis swap, stack of per-expert
tensors, concatenation, slice, rotary row permutation) move values without changing them. Done
on the quantized values and, alongside, on scales and zero points held one per block along one
axis (scale shaped like the values with that axis counted in blocks), they give the parameter's
stored form; its ``dequantize()`` equals the dequantized parameter exactly. A conversion that
would cut through a block (a slice not on block boundaries, a rotary permutation of the blocked
axis), or parts stored in different forms, has no such form: None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from qeff_vision.export.quantized_weight import QuantizedWeight
from qeff_vision.export.weight_sources import (
    JoinedSource,
    MergedSource,
    SlicedSource,
    Source,
    permute_for_rope,
)

# key -> (stored form, expressible) for a quantized checkpoint tensor, None for a plain one
StoredOf = Callable[[str], "tuple[QuantizedWeight, bool] | None"]


class _Inexpressible(Exception):
    """A conversion leaves no one-axis block form."""


def stored_form(source, stored_of: StoredOf, shape: torch.Size) -> QuantizedWeight | None:
    """``source``'s parameter in its stored form, or None (plain weights, forms DequantizeLinear lacks)."""
    keys = _keys(source)
    forms = [stored_of(key) for key in keys]
    if any(form is None or not form[1] for form in forms):
        return None
    blocked = {key: _blocked(form[0]) for key, form in zip(keys, forms)}
    try:
        return _simplest(_convert(source, blocked, shape))
    except _Inexpressible:
        return None


def _keys(source) -> tuple[str, ...]:
    if isinstance(source, MergedSource):
        return tuple(key for part in source.parts for key in part)
    if isinstance(source, JoinedSource):
        return source.keys
    return (source.key,)


def _convert(source, forms: dict[str, QuantizedWeight], shape: torch.Size) -> QuantizedWeight:
    """The conversions of ``Source.values`` & co, on blocked forms."""
    if isinstance(source, Source):
        form = forms[source.key]
        if source.swap is not None and (source.always or tuple(form.data.shape) != tuple(shape)):
            return _swap(form, *source.swap)
        return form
    if isinstance(source, MergedSource):
        stacks = [_stack([forms[key] for key in keys], source.merge_dim) for keys in source.parts]
        return stacks[0] if source.concat_dim is None else _cat(stacks, source.concat_dim)
    if isinstance(source, JoinedSource):
        return _cat([forms[key] for key in source.keys], source.dim)
    if isinstance(source, SlicedSource):
        piece = _narrow(forms[source.key], source.dim, source.start, source.length)
        if source.rope_heads:
            if piece.axis == 0:
                raise _Inexpressible
            piece = _map(piece, lambda t: permute_for_rope(t, source.rope_heads, source.rope_inverse))
        return piece
    raise _Inexpressible


def _blocked(form: QuantizedWeight) -> QuantizedWeight:
    """``form`` with a scale shaped like the values except along ``axis`` (counted in blocks)."""
    data = form.data
    if form.scale.dim() == 0:  # per tensor: one block spanning axis 0, the same scale everywhere
        shape = (1, *data.shape[1:])
        zero = None if form.zero_point is None else form.zero_point.reshape(()).expand(shape)
        return dataclasses.replace(
            form, scale=form.scale.expand(shape), zero_point=zero, axis=0, block_size=data.shape[0]
        )
    if form.block_size:
        return dataclasses.replace(form, axis=form.axis % data.dim())
    axis = form.axis % data.dim()  # per channel along ``axis``: one block spanning another axis
    other = data.dim() - 1 if axis != data.dim() - 1 else 0
    shape = [1] * data.dim()
    shape[axis] = -1
    target = list(data.shape)
    target[other] = 1
    zero = None if form.zero_point is None else form.zero_point.reshape(shape).expand(target)
    return dataclasses.replace(
        form,
        scale=form.scale.reshape(shape).expand(target),
        zero_point=zero,
        axis=other,
        block_size=data.shape[other],
    )


def _map(form: QuantizedWeight, fn: Callable[[torch.Tensor], torch.Tensor], scale_fn=None) -> QuantizedWeight:
    scale_fn = scale_fn or fn
    zero = None if form.zero_point is None else scale_fn(form.zero_point)
    return dataclasses.replace(form, data=fn(form.data), scale=scale_fn(form.scale), zero_point=zero)


def _swap(form: QuantizedWeight, dim0: int, dim1: int) -> QuantizedWeight:
    rank = form.data.dim()
    dim0, dim1 = dim0 % rank, dim1 % rank
    axis = {dim0: dim1, dim1: dim0}.get(form.axis, form.axis)
    return dataclasses.replace(_map(form, lambda t: t.transpose(dim0, dim1)), axis=axis)


def _same_kind(forms: list[QuantizedWeight]) -> None:
    first = forms[0]
    for form in forms[1:]:
        same = (form.bits, form.axis, form.block_size, form.data.dtype, form.scale.dtype) == (
            first.bits,
            first.axis,
            first.block_size,
            first.data.dtype,
            first.scale.dtype,
        )
        if not same or (form.zero_point is None) != (first.zero_point is None):
            raise _Inexpressible


def _stack(forms: list[QuantizedWeight], dim: int) -> QuantizedWeight:
    _same_kind(forms)
    first = forms[0]
    dim = dim % (first.data.dim() + 1)
    zero = None if first.zero_point is None else torch.stack([f.zero_point for f in forms], dim)
    return dataclasses.replace(
        first,
        data=torch.stack([f.data for f in forms], dim),
        scale=torch.stack([f.scale for f in forms], dim),
        zero_point=zero,
        axis=first.axis + (1 if dim <= first.axis else 0),
    )


def _cat(forms: list[QuantizedWeight], dim: int) -> QuantizedWeight:
    _same_kind(forms)
    first = forms[0]
    dim = dim % first.data.dim()
    if dim == first.axis and any(f.data.shape[dim] % f.block_size for f in forms[:-1]):
        raise _Inexpressible  # a part ending inside a block
    zero = None if first.zero_point is None else torch.cat([f.zero_point for f in forms], dim)
    return dataclasses.replace(
        first,
        data=torch.cat([f.data for f in forms], dim),
        scale=torch.cat([f.scale for f in forms], dim),
        zero_point=zero,
    )


def _narrow(form: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
    dim = dim % form.data.dim()
    if dim != form.axis:
        return _map(form, lambda t: t.narrow(dim, start, length))
    block, total = form.block_size, form.data.shape[dim]
    if form.scale.shape[dim] == 1:  # one block spans the axis: it spans the slice too
        piece = _map(form, lambda t: t.narrow(dim, start, length), lambda t: t)
        return dataclasses.replace(piece, block_size=length)
    if start % block or (length % block and start + length != total):
        raise _Inexpressible  # the slice starts or ends inside a block
    first, count = start // block, -(-length // block)
    return _map(form, lambda t: t.narrow(dim, start, length), lambda t: t.narrow(dim, first, count))


def _simplest(form: QuantizedWeight) -> QuantizedWeight:
    """Per tensor when every scale is equal, per channel when a block spans a 2-D weight's axis."""
    scale = form.scale.contiguous()
    zero = None if form.zero_point is None else form.zero_point.contiguous()
    data = form.data.contiguous()
    if zero is None and scale.numel() and bool((scale == scale.reshape(-1)[0]).all()):
        return dataclasses.replace(
            form, data=data, scale=scale.reshape(-1)[0].clone(), zero_point=None, axis=0, block_size=0
        )
    if data.dim() == 2 and scale.shape[form.axis] == 1:
        other = 1 - form.axis
        zero = None if zero is None else zero.reshape(-1)
        return dataclasses.replace(
            form, data=data, scale=scale.reshape(-1), zero_point=zero, axis=other, block_size=0
        )
    return dataclasses.replace(form, data=data, scale=scale, zero_point=zero)
