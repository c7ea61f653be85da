"""KV-cache update and read as ONNX functions ``CtxScatter`` / ``CtxGather`` in domain ``com.qualcomm.cloud``.

Continuous batching uses ``CtxScatterCB`` / ``CtxGatherCB`` (QEfficient's names, pinned
quic/efficient-transformers ``QEfficient/customop/ctx_scatter_gather_cb.py``): the cache's dim 0
holds ``full_batch_size`` slots and an extra ``batch_index`` [batch, 1] input says which slot each
row of the call writes and reads, so a batch-1 prefill and a batch-F decode share one cache.

The AI 100 compiler maps these function names to native kernels; any other runtime (onnxruntime)
inlines their bodies, which use only standard ops. Indices are int64 and always in range — padding
tokens are redirected by the caller, never encoded as an out-of-range sentinel — so onnxruntime
runs the exported graph unpatched.

Torch side: :class:`CtxScatterFunction` and :class:`CtxGatherFunction` are autograd functions whose
eager ``forward`` computes the same result and whose ``symbolic`` emits the custom-domain node;
:func:`attach_functions` adds the function definitions to the exported model.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import torch
from onnx import TensorProto, helper

from qeff_vision.graph_file import model_nodes

DOMAIN = "com.qualcomm.cloud"
DOMAIN_VERSION = 1
SCATTER = "CtxScatter"
GATHER = "CtxGather"
SCATTER_CB = "CtxScatterCB"
GATHER_CB = "CtxGatherCB"


class CtxScatterFunction(torch.autograd.Function):
    """Write ``updates`` [B, H, S, D] into ``cache`` [B, H, C, D] at slots ``positions`` [B, S]."""

    @staticmethod
    def forward(cache: torch.Tensor, positions: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        """Eager result (also what tracing records as the example output)."""
        batch = torch.arange(cache.shape[0]).view(-1, 1, 1)
        heads = torch.arange(cache.shape[1]).view(1, -1, 1)
        result = cache.clone()
        result[batch, heads, positions.unsqueeze(1)] = updates
        return result

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, cache, positions, updates):  # noqa: D102 - ONNX emission
        return g.op(f"{DOMAIN}::{SCATTER}", cache, positions, updates).setType(cache.type())


class CtxGatherFunction(torch.autograd.Function):
    """Read ``cache`` [B, H, C, D] at slots ``indices`` [B, K] -> [B, H, K, D]."""

    @staticmethod
    def forward(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Eager result (also what tracing records as the example output)."""
        batch = torch.arange(cache.shape[0]).view(-1, 1, 1)
        heads = torch.arange(cache.shape[1]).view(1, -1, 1)
        return cache[batch, heads, indices.unsqueeze(1)]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, cache, indices):  # noqa: D102 - ONNX emission
        # [B, H, K, D]: K is the read's length, not the cache's (a padding write-back reads S slots).
        return g.op(f"{DOMAIN}::{GATHER}", cache, indices).setType(cache.type().with_sizes([None] * 4))


class CtxScatterCBFunction(torch.autograd.Function):
    """Write ``updates`` [B, H, S, D] into ``cache`` [F, H, C, D] at slots (``batch_index``, ``positions``).

    ``batch_index`` [B, 1] names each row's sequence slot, ``positions`` [B, S] its cache positions.
    """

    @staticmethod
    def forward(
        cache: torch.Tensor, batch_index: torch.Tensor, positions: torch.Tensor, updates: torch.Tensor
    ) -> torch.Tensor:
        """Eager result (also what tracing records as the example output)."""
        heads = torch.arange(cache.shape[1]).view(1, -1, 1)
        result = cache.clone()
        result[batch_index.view(-1, 1, 1), heads, positions.unsqueeze(1)] = updates
        return result

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, cache, batch_index, positions, updates):  # noqa: D102 - ONNX emission
        return g.op(f"{DOMAIN}::{SCATTER_CB}", cache, batch_index, positions, updates).setType(cache.type())


class CtxGatherCBFunction(torch.autograd.Function):
    """Read ``cache`` [F, H, C, D] at (``batch_index`` [B, 1], ``indices`` [B, K]) -> [B, H, K, D]."""

    @staticmethod
    def forward(cache: torch.Tensor, batch_index: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Eager result (also what tracing records as the example output)."""
        heads = torch.arange(cache.shape[1]).view(1, -1, 1)
        return cache[batch_index.view(-1, 1, 1), heads, indices.unsqueeze(1)]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, cache, batch_index, indices):  # noqa: D102 - ONNX emission
        out = g.op(f"{DOMAIN}::{GATHER_CB}", cache, batch_index, indices)
        return out.setType(cache.type().with_sizes([None] * 4))


def _const(name: str, values: list[int], shape: list[int] | None = None):
    """An int64 Constant node named ``name`` (a scalar when ``shape`` is [])."""
    dims = [len(values)] if shape is None else shape
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, dims, values)
    )


def _scatter_function(opset: int) -> onnx.FunctionProto:
    # indices[b, h, s] = (b, h, positions[b, s]) -> ScatterND(cache, indices, updates)
    nodes = [
        helper.make_node("Shape", ["cache"], ["cache_shape"]),
        helper.make_node("Shape", ["positions"], ["pos_shape"]),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("o", TensorProto.INT64, [], [1])),
        helper.make_node(
            "Constant", [], ["ax0"], value=helper.make_tensor("a0", TensorProto.INT64, [1], [0])
        ),
        helper.make_node(
            "Constant", [], ["ax1"], value=helper.make_tensor("a1", TensorProto.INT64, [1], [1])
        ),
        helper.make_node(
            "Constant", [], ["one_1d"], value=helper.make_tensor("o1", TensorProto.INT64, [1], [1])
        ),
        helper.make_node(
            "Constant", [], ["ax_123"], value=helper.make_tensor("a", TensorProto.INT64, [3], [1, 2, 3])
        ),
        helper.make_node(
            "Constant", [], ["ax_023"], value=helper.make_tensor("b", TensorProto.INT64, [3], [0, 2, 3])
        ),
        helper.make_node(
            "Constant", [], ["ax_13"], value=helper.make_tensor("c", TensorProto.INT64, [2], [1, 3])
        ),
        helper.make_node("Gather", ["cache_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Gather", ["cache_shape", "one"], ["heads"], axis=0),
        helper.make_node("Gather", ["cache_shape", "ax0"], ["batch_1d"], axis=0),
        helper.make_node("Gather", ["cache_shape", "ax1"], ["heads_1d"], axis=0),
        helper.make_node("Gather", ["pos_shape", "ax1"], ["seq_1d"], axis=0),
        helper.make_node("Concat", ["batch_1d", "heads_1d", "seq_1d", "one_1d"], ["index_shape"], axis=0),
        helper.make_node("Range", ["zero", "batch", "one"], ["batch_range"]),
        helper.make_node("Range", ["zero", "heads", "one"], ["head_range"]),
        helper.make_node("Unsqueeze", ["batch_range", "ax_123"], ["batch_col"]),
        helper.make_node("Unsqueeze", ["head_range", "ax_023"], ["head_col"]),
        helper.make_node("Unsqueeze", ["positions", "ax_13"], ["pos_col"]),
        helper.make_node("Expand", ["batch_col", "index_shape"], ["batch_idx"]),
        helper.make_node("Expand", ["head_col", "index_shape"], ["head_idx"]),
        helper.make_node("Expand", ["pos_col", "index_shape"], ["pos_idx"]),
        helper.make_node("Concat", ["batch_idx", "head_idx", "pos_idx"], ["indices"], axis=3),
        helper.make_node("ScatterND", ["cache", "indices", "updates"], ["output"]),
    ]
    return helper.make_function(
        DOMAIN,
        SCATTER,
        ["cache", "positions", "updates"],
        ["output"],
        nodes,
        [helper.make_opsetid("", opset)],
    )


def _gather_function(opset: int) -> onnx.FunctionProto:
    # output[b, h, k] = cache[b, h, indices[b, k]]. A leading run 0..K-1 on every row (every
    # full-context read the decoder emits) is a Slice of the first K positions; anything else is
    # GatherND over the position axis with batch_dims=2 (indices [B, H, K, 1] from [B, K]).
    general = [
        _const("nd_ax1", [1]),
        _const("nd_last", [-1]),
        _const("nd_s0", [0]),
        _const("nd_s2", [2]),
        helper.make_node("Slice", ["cache_shape", "nd_s0", "nd_s2"], ["batch_heads"]),
        helper.make_node("Gather", ["index_shape", "nd_ax1"], ["slots"], axis=0),
        helper.make_node("Concat", ["batch_heads", "slots"], ["target"], axis=0),
        helper.make_node("Unsqueeze", ["indices", "nd_ax1"], ["with_heads"]),
        helper.make_node("Expand", ["with_heads", "target"], ["expanded"]),
        helper.make_node("Unsqueeze", ["expanded", "nd_last"], ["nd_indices"]),
        helper.make_node("GatherND", ["cache", "nd_indices"], ["nd_out"], batch_dims=2),
    ]
    leading = _leading_slice_nodes("lead_out")
    return helper.make_function(
        DOMAIN,
        GATHER,
        ["cache", "indices"],
        ["output"],
        _leading_run_branches(leading, "lead_out", general, "nd_out"),
        [helper.make_opsetid("", opset)],
    )


def _leading_run_branches(
    leading: list,
    leading_out: str,
    general: list,
    general_out: str,
    condition: Sequence[onnx.NodeProto] = (),
    condition_out: str = "is_leading_run",
) -> list:
    """Nodes computing ``output`` by ``leading`` when ``indices`` is 0..K-1 on every row, else ``general``.

    Defines ``zero``, ``one``, ``cache_shape``, ``index_shape``, ``length`` (K) and ``ctx`` (C) for
    both branches. The leading branch also requires K <= C, so an out-of-range read fails in the
    general branch as it would without the fast path. ``condition`` nodes may narrow the leading
    branch further: they read ``is_leading_run`` and define ``condition_out``, the If's condition.
    """
    return [
        _const("zero", [0], []),
        _const("one", [1], []),
        _const("two", [2], []),
        helper.make_node("Shape", ["cache"], ["cache_shape"]),
        helper.make_node("Shape", ["indices"], ["index_shape"]),
        helper.make_node("Gather", ["index_shape", "one"], ["length"], axis=0),
        helper.make_node("Gather", ["cache_shape", "two"], ["ctx"], axis=0),
        helper.make_node("Range", ["zero", "length", "one"], ["leading"]),
        helper.make_node("Equal", ["indices", "leading"], ["in_order"]),
        helper.make_node("Cast", ["in_order"], ["in_order_int"], to=TensorProto.INT64),
        helper.make_node("ReduceMin", ["in_order_int"], ["all_in_order"], keepdims=0),
        helper.make_node("Cast", ["all_in_order"], ["all_in_order_bool"], to=TensorProto.BOOL),
        helper.make_node("LessOrEqual", ["length", "ctx"], ["fits"]),
        helper.make_node("And", ["all_in_order_bool", "fits"], ["is_leading_run"]),
        *condition,
        helper.make_node(
            "If",
            [condition_out],
            ["output"],
            then_branch=_branch("leading_run", leading, leading_out),
            else_branch=_branch("any_positions", general, general_out),
        ),
    ]


def _leading_slice_nodes(out: str) -> list:
    """Positions 0..length-1 of every cache row: ``out`` = cache[:, :, :length]."""
    return [
        _const("lead_start", [0]),
        _const("lead_axis", [2]),
        helper.make_node("Unsqueeze", ["length", "lead_start"], ["lead_end"]),
        helper.make_node("Slice", ["cache", "lead_start", "lead_end", "lead_axis"], [out]),
    ]


def _slot_indices(batch: str, cache: str, positions: str, out: str) -> list:
    """Nodes building ``out`` [B, H, S, 3] = (batch[b], h, positions[b, s]); B and S from ``positions``."""
    return [
        helper.make_node("Shape", [cache], ["cache_shape"]),
        helper.make_node("Shape", [positions], ["pos_shape"]),
        _const("zero", [0], []),
        _const("one", [1], []),
        _const("ax0", [0]),
        _const("ax1", [1]),
        _const("one_1d", [1]),
        _const("ax_23", [2, 3]),
        _const("ax_023", [0, 2, 3]),
        _const("ax_13", [1, 3]),
        helper.make_node("Gather", ["cache_shape", "one"], ["num_heads"], axis=0),
        helper.make_node("Gather", ["pos_shape", "ax0"], ["rows_1d"], axis=0),
        helper.make_node("Gather", ["cache_shape", "ax1"], ["heads_1d"], axis=0),
        helper.make_node("Gather", ["pos_shape", "ax1"], ["seq_1d"], axis=0),
        helper.make_node("Concat", ["rows_1d", "heads_1d", "seq_1d", "one_1d"], ["index_shape"], axis=0),
        helper.make_node("Range", ["zero", "num_heads", "one"], ["head_range"]),
        helper.make_node("Unsqueeze", [batch, "ax_23"], ["batch_col"]),
        helper.make_node("Unsqueeze", ["head_range", "ax_023"], ["head_col"]),
        helper.make_node("Unsqueeze", [positions, "ax_13"], ["pos_col"]),
        helper.make_node("Expand", ["batch_col", "index_shape"], ["batch_idx"]),
        helper.make_node("Expand", ["head_col", "index_shape"], ["head_idx"]),
        helper.make_node("Expand", ["pos_col", "index_shape"], ["pos_idx"]),
        helper.make_node("Concat", ["batch_idx", "head_idx", "pos_idx"], [out], axis=3),
    ]


def _scatter_cb_function(opset: int) -> onnx.FunctionProto:
    # indices[b, h, s] = (batch_index[b], h, positions[b, s]) -> ScatterND(cache, indices, updates)
    nodes = [
        *_slot_indices("batch_index", "cache", "positions", "indices"),
        helper.make_node("ScatterND", ["cache", "indices", "updates"], ["output"]),
    ]
    return helper.make_function(
        DOMAIN,
        SCATTER_CB,
        ["cache", "batch_index", "positions", "updates"],
        ["output"],
        nodes,
        [helper.make_opsetid("", opset)],
    )


def _gather_cb_function(opset: int) -> onnx.FunctionProto:
    # output[b, h, k] = cache[batch_index[b], h, indices[b, k]]. Every read our decoder emits is
    # the leading run 0..K-1 on every row (K = ctx_len or the compute-context length) for slots
    # that follow each other (a decode call's 0..F-1, a prefill chunk's one slot), so the body
    # branches: such a read is one Slice over the slot and position axes, a single block copy;
    # anything else (slots out of order, any positions) takes the general row Gather. Both give
    # the tensor GatherND over (slot, head, position) triples gives (tests/test_kv_ops_cb.py).
    condition = [
        *_consecutive_slot_nodes("consecutive", "slot_first", "slot_end"),
        helper.make_node("And", ["is_leading_run", "consecutive"], ["is_block"]),
    ]
    block = [
        _const("block_axes", [0, 2]),
        _const("block_zero", [0]),
        helper.make_node("Unsqueeze", ["length", "block_zero"], ["block_length"]),
        helper.make_node("Concat", ["slot_first", "block_zero"], ["block_starts"], axis=0),
        helper.make_node("Concat", ["slot_end", "block_length"], ["block_ends"], axis=0),
        helper.make_node("Slice", ["cache", "block_starts", "block_ends", "block_axes"], ["block_out"]),
    ]
    return helper.make_function(
        DOMAIN,
        GATHER_CB,
        ["cache", "batch_index", "indices"],
        ["output"],
        _leading_run_branches(block, "block_out", _row_gather_nodes(), "rows_out", condition, "is_block"),
        [helper.make_opsetid("", opset)],
    )


def _consecutive_slot_nodes(out: str, first: str, end: str) -> list:
    """Whether ``batch_index`` [B, 1] is s, s+1, .., s+B-1 inside the cache's F slots: ``out``.

    Also defines ``first`` = [s] and ``end`` = [s + B] (1-D), the slot Slice's bounds. B is read
    from ``indices`` [B, K] (same rows as ``batch_index``). Only the last two checks read the
    cache's shape: the rest is the same for every read of a call, which onnxruntime computes once
    when the functions are inlined (:mod:`qeff_vision.numerics.ort_graph`).
    """
    return [
        _const("slot_ax1", [1]),
        helper.make_node("Gather", ["index_shape", "zero"], ["call_rows"], axis=0),
        helper.make_node("Range", ["zero", "call_rows", "one"], ["row_range"]),
        helper.make_node("Unsqueeze", ["row_range", "slot_ax1"], ["row_col"]),  # [B, 1]
        helper.make_node("Sub", ["batch_index", "row_col"], ["slot_offset"]),  # s on every row
        helper.make_node("ReduceMin", ["slot_offset"], ["offset_min"], keepdims=0),
        helper.make_node("ReduceMax", ["slot_offset"], ["offset_max"], keepdims=0),
        helper.make_node("Equal", ["offset_min", "offset_max"], ["one_offset"]),
        helper.make_node("GreaterOrEqual", ["offset_min", "zero"], ["from_a_slot"]),
        helper.make_node("And", ["one_offset", "from_a_slot"], ["consecutive_from_a_slot"]),
        helper.make_node("Add", ["offset_min", "call_rows"], ["offset_end"]),
        helper.make_node("Reshape", ["offset_min", "slot_ax1"], [first]),
        helper.make_node("Reshape", ["offset_end", "slot_ax1"], [end]),
        helper.make_node("Gather", ["cache_shape", "zero"], ["slot_count"], axis=0),
        helper.make_node("LessOrEqual", ["offset_end", "slot_count"], ["to_a_slot"]),
        helper.make_node("And", ["consecutive_from_a_slot", "to_a_slot"], [out]),
    ]


def _branch(name: str, nodes: list, output: str) -> onnx.GraphProto:
    """An If branch reading the function's values from the enclosing scope.

    Its output is untyped: the cache's float type, whichever the export dtype is.
    """
    return helper.make_graph(nodes, name, [], [helper.make_value_info(output, onnx.TypeProto())])


def _row_gather_nodes() -> list:
    """Any in-range positions: one Gather over the cache viewed as [F * H * C, D] rows.

    Row ``(batch_index[b] * H + h) * C + indices[b, k]``; onnxruntime's GatherND resolves each
    D-wide slice through a per-triple offset loop, several times slower.
    """
    return [
        _const("rows_width_at", [3]),
        _const("rows_minus_one", [-1]),
        _const("rows_ax1", [1]),
        _const("rows_ax2", [2]),
        _const("rows_ax_02", [0, 2]),
        helper.make_node("Gather", ["cache_shape", "one"], ["num_heads"], axis=0),
        helper.make_node("Gather", ["cache_shape", "rows_width_at"], ["width"], axis=0),
        helper.make_node("Concat", ["rows_minus_one", "width"], ["rows_shape"], axis=0),
        helper.make_node("Reshape", ["cache", "rows_shape"], ["rows"]),
        helper.make_node("Range", ["zero", "num_heads", "one"], ["head_range"]),
        helper.make_node("Mul", ["batch_index", "num_heads"], ["slot_heads"]),  # [B, 1]
        helper.make_node("Unsqueeze", ["slot_heads", "rows_ax2"], ["slot_col"]),  # [B, 1, 1]
        helper.make_node("Unsqueeze", ["head_range", "rows_ax_02"], ["head_col"]),  # [1, H, 1]
        helper.make_node("Add", ["slot_col", "head_col"], ["slot_head"]),  # [B, H, 1]
        helper.make_node("Mul", ["slot_head", "ctx"], ["row_base"]),
        helper.make_node("Unsqueeze", ["indices", "rows_ax1"], ["index_col"]),  # [B, 1, K]
        helper.make_node("Add", ["row_base", "index_col"], ["row_index"]),  # [B, H, K]
        helper.make_node("Gather", ["rows", "row_index"], ["rows_out"], axis=0),
    ]


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the CtxScatter/CtxGather(CB) definitions (and the domain import) when the graph uses them."""
    opset = next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))
    used = {node.op_type for node in model_nodes(model) if node.domain == DOMAIN}
    defined = {(f.domain, f.name) for f in model.functions}
    builders = (
        (SCATTER, _scatter_function),
        (GATHER, _gather_function),
        (SCATTER_CB, _scatter_cb_function),
        (GATHER_CB, _gather_cb_function),
    )
    for name, build in builders:
        if name in used and (DOMAIN, name) not in defined:
            model.functions.append(build(opset))
    if used and not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
