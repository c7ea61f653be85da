"""Retained state of recurrent (linear-attention) layers, with the state rules in the graph.

A recurrent layer keeps ``conv_state.{i}`` [slots, conv_dim, kernel] (the last ``kernel`` inputs
of its causal depthwise convolution, as transformers' ``LinearAttentionLayer`` keeps them) and
``recurrent_state.{i}`` [slots, heads, key_dim, value_dim]. The family's layer reads and writes
them through :class:`RecurrentStates`, which applies the rules every state kind keeps
(docs/design.md, "Contract v3"):

* a padding token or an idle batch row (position -1) changes nothing: its convolution input is not
  kept, and the caller zeroes its decay and beta (:meth:`RecurrentStates.inert_gates`), so the
  gated delta rule leaves the state as it was;
* a row whose first text position is 0 starts a sequence: it reads zero states, so a reused slot
  never sees its previous occupant's;
* any other chunk continues from the retained state, whatever the bucket sizes.

With ``batch_index`` (continuous batching) row ``r`` of the call reads slot ``batch_index[r]``
(wrapped into range: vLLM's filler rows carry -1) and each slot takes the new state of the row
with valid tokens that names it, if any, else keeps its own (a Gather of the writer row and a
Where over the slots, not a ScatterND: an all-padding row may name the slot a valid row of the
same call writes, and duplicate scatter indices have no defined order; see
:mod:`qeff_vision.export.kv_writes`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class RecurrentStates:
    """The recurrent layers' conv and recurrent states for one call of the language program.

    Args:
        conv: Layer -> conv state input.
        recurrent: Layer -> recurrent state input.
        positions: [batch, seq] text positions of the call (-1 for padding and idle rows).
        batch_index: [batch, 1] slot of each row (continuous batching), else None.
    """

    def __init__(
        self,
        conv: Mapping[int, torch.Tensor],
        recurrent: Mapping[int, torch.Tensor],
        positions: torch.Tensor,
        batch_index: torch.Tensor | None = None,
    ):
        self.conv = dict(conv)
        self.recurrent = dict(recurrent)
        self.valid = positions >= 0
        self.count = self.valid.to(torch.int64).sum(dim=1)
        self.continues = positions[:, 0] != 0  # False: the row starts its sequence here
        self.row_valid = self.valid.any(dim=1)
        self.batch_index = None if batch_index is None else batch_index.reshape(-1)

    def _read(self, state: torch.Tensor) -> torch.Tensor:
        rows = state if self.batch_index is None else state[torch.remainder(self.batch_index, state.shape[0])]
        keep = self.continues.view(-1, *[1] * (rows.dim() - 1))
        return torch.where(keep, rows, torch.zeros_like(rows))

    def _write(self, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(state.dtype)
        if self.batch_index is None:
            return rows
        slots = torch.arange(state.shape[0]).view(-1, 1)
        writer = (self.batch_index.view(1, -1) == slots) & self.row_valid.view(1, -1)  # [slots, rows]
        source = torch.argmax(writer.to(torch.int64), dim=1)  # the one valid row naming each slot
        written = writer.any(dim=1).view(-1, *[1] * (state.dim() - 1))
        return torch.where(written, rows[source], state)

    def conv_window(self, layer: int, inputs: torch.Tensor) -> torch.Tensor:
        """The convolution's input window [batch, channels, kernel + seq]: retained inputs, then the call's.

        ``inputs`` is [batch, channels, seq]. The output for token t reads window positions
        t + 1 .. t + kernel. The new
        conv state is the last ``kernel`` inputs of the row's valid tokens (the old state's tail
        when the row has fewer, all of it for an idle row).
        """
        previous = self._read(self.conv[layer]).to(inputs.dtype)
        window = torch.cat([previous, inputs], dim=-1)
        kernel = previous.shape[-1]
        index = self.count.view(-1, 1, 1) + torch.arange(kernel).view(1, 1, -1)
        kept = torch.gather(window, 2, index.expand(-1, window.shape[1], -1))
        self.conv[layer] = self._write(self.conv[layer], kept)
        return window

    def inert_gates(self, decay: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decay and beta [batch, seq, heads] with padding tokens' set to 0: they leave the state as it is."""
        valid = self.valid.unsqueeze(-1)
        return torch.where(valid, decay, torch.zeros_like(decay)), torch.where(
            valid, beta, torch.zeros_like(beta)
        )

    def state(self, layer: int) -> torch.Tensor:
        """The recurrent state each row continues from, in float32 (zero for a row starting its sequence)."""
        return self._read(self.recurrent[layer]).float()

    def update_state(self, layer: int, state: torch.Tensor) -> None:
        """Keep the layer's new recurrent state (per row) for the retained output."""
        self.recurrent[layer] = self._write(self.recurrent[layer], state)

    def retained(self, layer: int, conv: bool) -> torch.Tensor:
        """The layer's conv (or recurrent) state to return as retained state."""
        return self.conv[layer] if conv else self.recurrent[layer]
