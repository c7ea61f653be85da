"""Mixture-of-experts in one traceable form that reads min(tokens x top_k, experts) expert slices.

A decode step is bound by the bytes it reads, and a sparse layer's experts are most of a MoE
model's weights. transformers' eager experts loop over the experts the batch's router hit
(``nonzero``), which tracing would freeze to the example's routing. This module writes the same
routed sum with shapes that depend on the call's static shapes only:

* the **slices** read are ``ids`` [n], n = min(T x k, E) for T tokens, top-k of E experts: the
  routed experts, one per (token, choice), when T x k < E (a decode step: QEfficient's gather,
  ``gate_proj = self.gate_proj[idx]``, ref: quic/efficient-transformers
  ``modeling_qwen3_vl_moe.py`` ``QEffQwen3VLMoeTextSparseMoeBlock``), else every expert once in
  order (a prefill chunk: a dense read, never T x k slices);
* the stacked weights stay one tensor per projection; a ``Gather`` on axis 0 reads the slices;
* every token meets every slice read ([n, T, ...] batched matmuls) and a [T, n] weight table keeps
  what the router chose: the router's weight where the slice is the token's own choice (routed
  form: slice j belongs to token j // k) or, in the dense form, the token's weight of that expert
  (zero for experts it did not choose). A slice chosen by two tokens of a decode batch is read
  twice and counted once per owner, so nothing is summed twice.

Both forms are one dataflow: the routed and the dense index lists have the same length n
(``flat[:E]`` and ``arange(E)[:T x k]``) and a ``Where`` on the shape-only condition T x k >= E
picks one. Every specialization has static shapes, so the condition, n and the ``Where`` fold to
constants when the compiler specializes the graph: a decode specialization becomes a gather of
the routed slices, a prefill one a gather of ``arange(E)`` (every expert once). onnxruntime
evaluates the same graph at run time for any shape, with the same result.
"""

from __future__ import annotations

import torch


def expert_slices(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts read for ``top_k_index`` [T, k] and which token owns each slice.

    Returns:
        ``ids`` [n] int64, n = min(T x k, num_experts): the routed experts in token-major order
        when T x k < num_experts, else ``0 .. num_experts - 1``; ``owners`` [n] int64: the token
        of each routed slice, -1 for every slice of the dense form (it serves all tokens).
    """
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).to(torch.int64)
    everyone = torch.arange(num_experts, dtype=torch.int64, device=flat.device)
    # Both lists are min(T x k, E) long; which one is a shape-only condition.
    routed, dense_ids = flat[:num_experts], everyone[: flat.shape[0]]
    positions = torch.arange(flat.shape[0], dtype=torch.int64, device=flat.device)[:num_experts]
    dense = torch.full_like(routed, flat.shape[0]) >= num_experts
    ids = torch.where(dense, dense_ids, routed)
    own_token = torch.div(positions, top_k, rounding_mode="floor")
    owners = torch.where(dense, torch.full_like(routed, -1), own_token)
    return ids, owners


def slice_weights(table: torch.Tensor, ids: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
    """[T, n] weight of each read slice per token from the router's dense ``table`` [T, E].

    A routed slice weighs only for its owner (two tokens choosing one expert read it twice, each
    copy counted once); a dense slice weighs for every token (zero where the token did not choose it).
    """
    tokens = torch.arange(table.shape[0], dtype=torch.int64, device=table.device).unsqueeze(-1)
    mine = (owners.unsqueeze(0) == tokens) | (owners.unsqueeze(0) < 0)
    return table.index_select(1, ids) * mine.to(table.dtype)


def routing_table(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E]: each chosen expert's router weight, zero elsewhere (a row's top-k experts are distinct)."""
    chosen = top_k_index.unsqueeze(-1) == torch.arange(num_experts, device=top_k_index.device)
    return (chosen.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(1)


def weighted_outputs(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn,
    weights: torch.Tensor,
    *,
    scale_inputs: bool = False,
    stored_out_in: bool = True,
) -> torch.Tensor:
    """Sum over the read slices of each slice's SwiGLU-style expert on ``hidden`` [T, H], weighted.

    Args:
        hidden: [T, H] token states.
        gate_up: [n, 2I, H] read slices (``stored_out_in``) or [n, H, 2I]; gate then up halves.
        down: [n, H, I] read slices (``stored_out_in``) or [n, I, H].
        act_fn: The experts' activation (transformers' module, so the same function).
        weights: [T, n] from :func:`slice_weights`.
        scale_inputs: Weigh each slice's input (Llama 4 scales the routed input by its score)
            instead of its output (Qwen-MoE, Gemma 4).
        stored_out_in: Whether the stacked weights are [n, out, in] (transformers' ``linear``
            layout of Qwen-MoE and Gemma 4) rather than [n, in, out] (Llama 4's ``bmm`` layout).
    """
    slice_weight = weights.t().unsqueeze(-1)  # [n, T, 1]
    inputs = hidden.unsqueeze(0)
    if scale_inputs:
        inputs = inputs * slice_weight.to(hidden.dtype)
    if stored_out_in:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = torch.matmul(inputs, gate_up).chunk(2, dim=-1)  # [n, T, I] each
    outputs = torch.matmul(act_fn(gate) * up, down)  # [n, T, H]
    if not scale_inputs:
        outputs = outputs * slice_weight.to(outputs.dtype)
    return outputs.sum(0)


def read_slices(stacked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slices ``ids`` of a stacked [E, ...] expert tensor (one ``Gather`` on axis 0)."""
    return stacked.index_select(0, ids)
