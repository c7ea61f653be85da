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

**Bounded intermediates** (:func:`routed_sum`, issue 54). Read whole, a prefill's slices are a
[E, 2I, H] copy of the stacked weights and its activations [E, T, I]: 560 MiB for Kimi-K2.5's
widths with 10 experts, gigabytes with the published 384. So the n slices are read in ``blocks``
balanced blocks (boundaries ``floor(j * n / blocks)``, shape arithmetic on the symbolic n; at most
top-k blocks, so none is ever empty: n >= top_k at every call), each block's intermediate width
in ``chunks`` static chunks (each projection's chunk gathered from a static slice of the stacked
weight when there are several), and each chunk's expert outputs summed inside one matmul
([T, slices x width] @ [slices x width, H]): no [n, T, H] tensor. The counts come from the active
policy (:meth:`~qeff_vision.contract.attention_blocking.AttentionBlocking.expert_counts`). A
decode step still reads exactly its T x k routed slices (the blocks partition the same list and
the chunks the same rows).
"""

from __future__ import annotations

import torch

from qeff_vision.export.blocked_attention import active, bounds, symbolic_length


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

    Returns:
        [T, H].
    """
    inner = int(down.shape[-1] if stored_out_in else down.shape[1])
    gate, up = _halves(gate_up, 0, inner, inner, stored_out_in)
    return _chunk_sum(hidden, gate, up, down, act_fn, weights, scale_inputs, stored_out_in)


def _halves(gate_up: torch.Tensor, start: int, stop: int, inner: int, stored_out_in: bool):
    """Columns ``start:stop`` of the gate half and of the up half of ``gate_up`` (static slices)."""
    if stored_out_in:
        return gate_up[:, start:stop], gate_up[:, inner + start : inner + stop]
    return gate_up[:, :, start:stop], gate_up[:, :, inner + start : inner + stop]


def _chunk_sum(hidden, gate_w, up_w, down_w, act_fn, weights, scale_inputs: bool, stored_out_in: bool):
    """One width chunk of the read slices' weighted experts on ``hidden`` [T, H], summed: [T, H].

    ``gate_w``, ``up_w``: [n, c, H] (``stored_out_in``) or [n, H, c]; ``down_w``: [n, H, c] or
    [n, c, H]. The slices' outputs are summed inside one matmul ([T, n x c] @ [n x c, H]), so no
    [n, T, H] tensor exists.
    """
    if stored_out_in:
        gate_w, up_w, down_w = gate_w.transpose(1, 2), up_w.transpose(1, 2), down_w.transpose(1, 2)
    slice_weight = weights.t().unsqueeze(-1).to(hidden.dtype)  # [n, T, 1]
    inputs = hidden.unsqueeze(0)  # [1, T, H]
    gate, up = torch.matmul(inputs, gate_w), torch.matmul(inputs, up_w)  # [n, T, c] each
    if scale_inputs:  # expert(x * s) with bias-free projections: act(s * gate) * (s * up)
        gate, up = gate * slice_weight, up * slice_weight
    activated = act_fn(gate) * up
    if not scale_inputs:
        activated = activated * slice_weight
    flat = activated.transpose(0, 1).reshape(hidden.shape[0], -1)  # [T, n x c]
    return torch.matmul(flat, down_w.reshape(-1, hidden.shape[-1]))


def routed_sum(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    top_k: int,
    scale_inputs: bool = False,
    stored_out_in: bool = True,
) -> torch.Tensor:
    """The routed experts' weighted sum on ``hidden`` [T, H], slices read in bounded blocks.

    With one width chunk a block gathers whole slices ([b, 2I, H]) and cuts the gate and up
    halves from them; with more, it gathers each chunk of each projection from a static slice of
    the stacked weight ([b, I / chunks, H]: a slice of a weight is a weight, and the gathered rows
    are the same rows, so the bytes read are unchanged: ``compile/weight_reads.py`` counts views).

    Args:
        hidden: [T, H] token states.
        gate_up: The stacked [E, 2I, H] (``stored_out_in``) or [E, H, 2I] weights.
        down: The stacked [E, H, I] (``stored_out_in``) or [E, I, H] weights.
        act_fn: The experts' activation.
        ids: [n] slices to read, from :func:`expert_slices`.
        weights: [T, n] from :func:`slice_weights`.
        top_k: Experts per token (the block count never exceeds it: no block is empty).
        scale_inputs: As :func:`weighted_outputs`.
        stored_out_in: As :func:`weighted_outputs`.

    Returns:
        [T, H].
    """
    experts = int(gate_up.shape[0])
    inner = int(down.shape[-1] if stored_out_in else down.shape[1])
    blocks, chunks = active().expert_counts(experts, int(top_k), inner, int(hidden.shape[-1]))
    length = symbolic_length(ids, 0)
    total = None
    for start, stop in bounds(length, blocks) if blocks > 1 else [(None, None)]:
        block_ids = ids if start is None else ids[start:stop]
        block_weights = weights if start is None else weights[:, start:stop]
        if chunks == 1:
            part = weighted_outputs(
                hidden,
                read_slices(gate_up, block_ids),
                read_slices(down, block_ids),
                act_fn,
                block_weights,
                scale_inputs=scale_inputs,
                stored_out_in=stored_out_in,
            )
            total = part if total is None else total + part
            continue
        for first, last in bounds(inner, chunks):
            gate_w, up_w = _halves(gate_up, first, last, inner, stored_out_in)
            down_w = down[:, :, first:last] if stored_out_in else down[:, first:last]
            part = _chunk_sum(
                hidden,
                read_slices(gate_w, block_ids),
                read_slices(up_w, block_ids),
                read_slices(down_w, block_ids),
                act_fn,
                block_weights,
                scale_inputs,
                stored_out_in,
            )
            total = part if total is None else total + part
    return total


def read_slices(stacked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slices ``ids`` of a stacked [E, ...] expert tensor (one ``Gather`` on axis 0)."""
    return stacked.index_select(0, ids)


def routed_experts(experts: torch.nn.Module):
    """A forward for stacked ``experts`` (transformers' ``Qwen3VLMoeTextExperts`` layout and its twins).

    Same call as transformers' (states [T, H], the router's ``top_k_index`` and ``top_k_weights``
    [T, k]) and the same stacked layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    reads min(T x k, E) expert slices (:mod:`qeff_vision.export.experts`).
    """

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ids, owners = expert_slices(top_k_index, experts.num_experts)
        weights = slice_weights(routing_table(top_k_index, top_k_weights, experts.num_experts), ids, owners)
        return routed_sum(
            hidden_states,
            experts.gate_up_proj,
            experts.down_proj,
            experts.act_fn,
            ids,
            weights,
            top_k=top_k_index.shape[-1],
        )

    return forward


def route_sparse_experts(layers, path: str) -> None:
    """Give the stacked experts at attribute ``path`` of each of ``layers`` the routed forward.

    ``path`` is dotted from a decoder layer (``mlp.experts``, Gemma 4's ``experts``); a layer
    without that module (a dense MLP layer) keeps its own forward.
    """
    for layer in layers:
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if module is not None:
            module.forward = routed_experts(module)
