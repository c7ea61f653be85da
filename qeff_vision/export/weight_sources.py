"""Where a model parameter's values come from in a checkpoint, by transformers' own loading rules.

Checkpoint keys are mapped to model parameters with transformers' weight renamings and
base-model-prefix handling (ref: transformers v5 core_model_loading.py
``convert_and_load_state_dict_in_model``). Two value conversions are done: an axis swap (a
``WeightConverter`` whose only operation is ``Transpose``, Qwen3-VL-MoE's experts) and a stack of
per-module tensors (``MergeModulelist``, optionally then ``Concatenate``: Qwen3.5-MoE's
per-expert tensors, ref: transformers conversion_mapping.py ``qwen2_moe``). Fused tensors are cut
and split tensors joined as transformers does (a ``WeightConverter`` whose only operation is
``Split`` / ``Chunk``: one checkpoint tensor into several parameters, Molmo2's ``att_proj`` into
q/k/v and ``ff_proj`` into up/gate; or ``Concatenate`` of several keys into one parameter, Molmo2's
base and additional vocabulary ``wte`` tables; ref: conversion_mapping.py ``Molmo2TextModel``):
each parameter reads only its slice. A cut may be followed by ``PermuteForRope`` (Kimi-K2.5's
vision ``wqkv``: q/k/v chunks, q and k rows reordered from interleaved rotary pairs to split
halves per head); the permutation is applied to the slice. Any other conversion is refused with
one clear line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from qeff_vision.errors import UserError

if TYPE_CHECKING:
    from qeff_vision.export.weights import Checkpoint


@dataclass(frozen=True)
class Source:
    """A parameter's checkpoint tensor and the axis swap transformers applies to it on load.

    Attributes:
        key: The checkpoint key.
        swap: ``(dim0, dim1)`` of a ``Transpose`` conversion, or None.
        always: Swap even when the stored shape already equals the parameter's (``check_dims`` off).
    """

    key: str
    swap: tuple[int, int] | None = None
    always: bool = False

    def load(self, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``tensor`` as the parameter holds it (transformers' ``Transpose.convert`` rule)."""
        if self.swap is not None and (self.always or tuple(tensor.shape) != tuple(shape)):
            return tensor.transpose(*self.swap)
        return tensor

    def values(self, read: Callable[[str], torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The parameter's values, reading checkpoint tensors with ``read``."""
        return self.load(read(self.key), shape)


@dataclass(frozen=True)
class MergedSource:
    """A parameter stacked from per-module checkpoint tensors (``MergeModulelist`` [+ ``Concatenate``]).

    Attributes:
        parts: Per source pattern, the checkpoint keys in module (expert) order.
        merge_dim: Axis the modules are stacked on.
        concat_dim: Axis the patterns' stacks are concatenated on, None for a single pattern.
    """

    parts: tuple[tuple[str, ...], ...]
    merge_dim: int
    concat_dim: int | None

    @property
    def key(self) -> str:
        """The first checkpoint key (for messages)."""
        return self.parts[0][0]

    def values(self, read: Callable[[str], torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """Stack each pattern's tensors, then concatenate the stacks (transformers' order)."""
        stacks = [torch.stack([read(key) for key in keys], dim=self.merge_dim) for keys in self.parts]
        return stacks[0] if self.concat_dim is None else torch.cat(stacks, dim=self.concat_dim)


@dataclass(frozen=True)
class SlicedSource:
    """A parameter cut from a fused checkpoint tensor (``Split`` / ``Chunk``): ``length`` rows from ``start``.

    Attributes:
        key: The checkpoint key of the fused tensor.
        dim: The axis it is cut along.
        start: The first index of this parameter's slice.
        length: The slice's extent (the parameter's size on ``dim``).
        rope_heads: Heads of a ``PermuteForRope`` applied to the slice, 0 for none.
        rope_inverse: That permutation's ``inverse`` flag (split halves back to interleaved pairs).
    """

    key: str
    dim: int
    start: int
    length: int
    rope_heads: int = 0
    rope_inverse: bool = False

    def values(self, read: Callable[[str], torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The parameter's slice of the fused tensor, rotary rows reordered when the cut says so."""
        piece = read(self.key).narrow(self.dim, self.start, self.length)
        return permute_for_rope(piece, self.rope_heads, self.rope_inverse) if self.rope_heads else piece


def permute_for_rope(tensor: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """Rows of each head reordered from interleaved rotary pairs to split halves (``inverse``: back).

    transformers' ``PermuteForRope`` rule on a weight [rows, in] or a bias [rows]: per head, the
    ``(half, 2)`` row grid is transposed to ``(2, half)``.
    """
    rows = tensor.shape[0]
    half = rows // heads // 2
    grid = (2, half) if inverse else (half, 2)
    return tensor.reshape(heads, *grid, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


@dataclass(frozen=True)
class JoinedSource:
    """A parameter concatenated from several checkpoint tensors (``Concatenate`` of its source patterns).

    Attributes:
        keys: The checkpoint keys in source-pattern order (transformers' order).
        dim: The axis they are concatenated on.
    """

    keys: tuple[str, ...]
    dim: int

    @property
    def key(self) -> str:
        """The first checkpoint key (for messages)."""
        return self.keys[0]

    def values(self, read: Callable[[str], torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The tensors joined in order."""
        return torch.cat([read(key) for key in self.keys], dim=self.dim)


def _cut_of(converters, pattern: str):
    """(converter, dim, rope) when the converter for ``pattern`` only cuts one tensor or joins several keys.

    ``rope`` is the ``PermuteForRope`` that may follow a cut (None when there is none).
    """
    from transformers.core_model_loading import Chunk, Concatenate, PermuteForRope, Split

    for converter in converters:
        if pattern in converter.source_patterns:
            operations = list(converter.operations)
            rope = None
            if len(operations) == 2 and isinstance(operations[1], PermuteForRope):
                rope = operations.pop()
            if len(operations) != 1:
                return None
            operation = operations[0]
            cuts = isinstance(operation, (Split, Chunk)) and len(converter.source_patterns) == 1
            joins = (
                rope is None
                and isinstance(operation, Concatenate)
                and len(converter.target_patterns) == 1
                and not getattr(operation, "num_shards_attribute", None)
            )
            return (converter, operation.dim, rope) if cuts or joins else None
    return None


def _rope_heads(rope, config, target: str) -> int:
    """Heads of ``rope`` (a ``PermuteForRope``) for the cut piece ``target``, 0 when it is not permuted."""
    if rope is None or (rope.permute_layer_names and not any(n in target for n in rope.permute_layer_names)):
        return 0
    section = getattr(config, rope.subconfig_key, config) if rope.subconfig_key else config
    return int(getattr(section, "num_attention_heads", 1))


def _merge_of(converters, pattern: str) -> tuple[list[str], int, int | None] | None:
    """(source patterns, merge dim, concat dim) of the converter for ``pattern`` when it stacks modules."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    for converter in converters:
        if pattern in converter.source_patterns:
            ops = list(converter.operations)
            if not ops or not isinstance(ops[0], MergeModulelist) or len(ops) > 2:
                return None
            if len(ops) == 2 and not isinstance(ops[1], Concatenate):
                return None
            return list(converter.source_patterns), ops[0].dim, ops[1].dim if len(ops) == 2 else None
    return None


def _module_index(pattern: str, key: str) -> int | None:
    """The module number the ``*`` of ``pattern`` matches in ``key``."""
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else None


def _swap_of(converters, pattern: str) -> tuple[tuple[int, int], bool] | None:
    """The (dims, always) of the converter for ``pattern`` when a single ``Transpose`` is all it does."""
    from transformers.core_model_loading import Transpose

    for converter in converters:
        if pattern in converter.source_patterns:
            operations = list(converter.operations)
            if len(operations) == 1 and isinstance(operations[0], Transpose):
                operation = operations[0]
                return (operation.dim0, operation.dim1), not operation.check_dims
            return None
    return None


def checkpoint_keys_for(model: nn.Module, checkpoint: Checkpoint) -> dict[str, Source]:
    """Model state-dict key -> its checkpoint source, by transformers' loading rules.

    Raises:
        UserError: A weight the model needs is absent, or a key needs a value conversion other
            than an axis swap.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, Source | MergedSource | SlicedSource | JoinedSource] = {}
    merged: dict[str, tuple[list[str], int, int | None, dict[tuple[int, int], str]]] = {}
    joined: dict[str, tuple[list[str], int, dict[str, str]]] = {}
    for key in checkpoint.location:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if renamed not in wanted and key in wanted:
            renamed, pattern = rename_source_key(key, [], [], prefix, wanted)
        if renamed not in wanted:
            continue
        if pattern is None:
            found[renamed] = Source(key)
            continue
        cut = _cut_of(converters, pattern)
        if cut is not None:
            converter, dim, rope = cut
            if len(converter.source_patterns) > 1:  # several keys joined into one parameter
                joined.setdefault(renamed, (list(converter.source_patterns), dim, {}))[2][pattern] = key
                continue
            heads = {t: _rope_heads(rope, model.config, t) for t in converter.target_patterns}
            inverse = bool(rope is not None and rope.inverse)
            found.update(_slices(key, renamed, converter.target_patterns, dim, wanted, heads, inverse))
            continue
        swap = _swap_of(converters, pattern)
        merge = _merge_of(converters, pattern) if swap is None else None
        index = _module_index(pattern, key) if merge is not None else None
        if swap is None and index is None:
            raise UserError(
                f"{checkpoint.model_dir}: weight {key!r} needs a conversion that streaming export does not do"
            )
        if swap is not None:
            found[renamed] = Source(key, *swap)
            continue
        patterns, merge_dim, concat_dim = merge
        entry = merged.setdefault(renamed, (patterns, merge_dim, concat_dim, {}))
        entry[3][(patterns.index(pattern), index)] = key
    for renamed, (patterns, merge_dim, concat_dim, keys) in merged.items():
        modules = sorted({module for _, module in keys})
        try:
            parts = tuple(tuple(keys[(p, m)] for m in modules) for p in range(len(patterns)))
        except KeyError:
            raise UserError(f"{checkpoint.model_dir}: {renamed}: a module of {patterns} is missing") from None
        found[renamed] = MergedSource(parts, merge_dim, concat_dim)
    for renamed, (patterns, dim, keys) in joined.items():
        if set(keys) != set(patterns):
            raise UserError(f"{checkpoint.model_dir}: {renamed}: a part of {patterns} is missing")
        found[renamed] = JoinedSource(tuple(keys[p] for p in patterns), dim)
    return found


def _slices(
    key: str, renamed: str, targets, dim: int, wanted, heads: dict[str, int], inverse: bool
) -> dict[str, SlicedSource]:
    """Each target parameter's slice of the fused tensor ``key``, sized like the parameter (``Split``).

    ``renamed`` is the first target's parameter name (transformers renames a one-to-many source
    to its first target); the others replace that target pattern in it. ``Chunk``'s equal pieces
    are the same slices, its targets being equally sized. ``heads``: per target, the heads of the
    rotary permutation its slice gets (0: none).
    """
    slices, start = {}, 0
    for target in targets:
        name = renamed.replace(targets[0], target, 1)
        length = wanted[name].shape[dim]
        slices[name] = SlicedSource(key, dim, start, length, heads[target], inverse)
        start += length
    return slices
