"""Where each row of a call writes the KV cache, so that padding writes nothing anyone reads.

The IO contract gives padding position -1: a padded prefill tail, a runtime's idle decode row, and
vLLM's Cloud AI plugin's filler rows (``input_ids``, ``position_ids`` and ``batch_index`` all -1,
qualcomm/vllm-qaic ``model_loader/qaic.py``). Such a token must change nothing a later call reads,
whatever its ``batch_index`` — -1 (the last slot once wrapped) or a slot another row of the same
call writes — and it must not race with that row: ScatterND with duplicate indices is undefined.

The design forbids an out-of-range sentinel (QEfficient's ``INT32_MAX`` position, which the
device kernel skips and onnxruntime rejects), so every padding token writes an in-range index
with the value already there (an identity write) at an index no other token of the call writes:

* each row owns a block of ``seq_len`` consecutive positions from ``start``: a row with valid
  tokens its own (they run ``first .. first+count-1``, its padded tail continues the block); an
  all-padding row the block after the valid row of its slot (if any) and after the padding rows
  of that slot before it;
* a full-context cache writes each token at its block position mod ``ctx_len`` (valid tokens at
  their own position), padding tokens with the value already there;
* a ring of ``R`` slots writes the ring slots of the last ``min(seq_len, R)`` positions of the
  block: they hold every slot the valid tokens change, and the other slots get their own values.

Blocks of rows that share a slot are disjoint, so their writes are too as long as they fit the
cache: (rows sharing a slot) x ``seq_len`` <= ``ctx_len`` and <= ``R`` for rings. Calls are a
prefill chunk (batch 1) or a decode step (``seq_len`` 1, one valid row per slot), so that holds
whenever fewer padding rows share a slot than the ring has slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WritePlan:
    """Where a call's tokens write (shared by every layer of the call).

    Attributes:
        batch_index: [batch, 1] slot of each row (an all-padding row's wrapped into range), or
            None without continuous batching.
        starts: [batch, 1] first position of each row's block.
        fresh: [batch, seq] tokens that write their own key/value (the valid ones); the others
            write back the value already at their index.
    """

    batch_index: torch.Tensor | None
    starts: torch.Tensor
    fresh: torch.Tensor

    def full_slots(self, positions: torch.Tensor, ctx_len) -> torch.Tensor:
        """[batch, seq] position each token writes in a ``ctx_len``-slot cache (valid: its own)."""
        offsets = torch.arange(self.fresh.shape[1]).view(1, -1)
        return torch.where(self.fresh, positions, torch.remainder(self.starts + offsets, ctx_len))

    def ring_slots(self, ring_len) -> torch.Tensor:
        """[batch, min(seq, ring_len)] ring slots each row writes: those of its block's last positions."""
        offsets = torch.arange(self.fresh.shape[1]).view(1, -1)[:, -ring_len:]
        return torch.remainder(self.starts + offsets, ring_len)


def write_plan(positions: torch.Tensor, batch_index: torch.Tensor | None, slots) -> WritePlan:
    """The :class:`WritePlan` of a call with text ``positions`` [batch, seq] (padding -1).

    Args:
        positions: Cache position of each token; a row's valid tokens come first and count up.
        batch_index: [batch, 1] slot of each row (continuous batching), else None.
        slots: Slots of the cache (``full_batch_size``); unused without ``batch_index``.
    """
    fresh = positions >= 0
    row_valid = positions.max(dim=1, keepdim=True).values >= 0
    first = torch.clamp(positions[:, :1], min=0)
    if batch_index is None:  # every row has its own cache row: a padding row starts anywhere
        return WritePlan(None, torch.where(row_valid, first, torch.zeros_like(first)), fresh)
    seq = torch.ones_like(positions).sum(dim=1, keepdim=True)  # a tensor, so tracing keeps it
    slot = torch.where(row_valid, batch_index, torch.remainder(batch_index, slots))
    rows = torch.arange(positions.shape[0])
    same = slot.view(-1, 1) == slot.view(1, -1)  # [r, v]: rows r and v write one slot
    valid_there = (same & row_valid.view(1, -1)).to(torch.int64)
    has_valid = valid_there.max(dim=1, keepdim=True).values
    valid_first = (valid_there * first.view(1, -1)).sum(dim=1, keepdim=True)
    padding_before = same & ~row_valid.view(1, -1) & (rows.view(1, -1) < rows.view(-1, 1))
    rank = padding_before.to(torch.int64).sum(dim=1, keepdim=True)
    padding_start = has_valid * (valid_first + seq) + rank * seq
    return WritePlan(slot, torch.where(row_valid, first, padding_start), fresh)
