"""The gated delta rule (Gated DeltaNet linear attention) as an exact, exportable ONNX function.

transformers computes a multi-token call with ``torch_chunk_gated_delta_rule`` (ref: transformers
v5.23 models/qwen3_5/modeling_qwen3_5.py): 64-token chunks, a unit lower-triangular system per
chunk solved with ``torch.linalg.solve_triangular`` (no ONNX export), then a Python loop over the
chunks that tracing unrolls to the count of the example, so a graph traced at 8 tokens is wrong for
a 128-token bucket. Here the chunk count is data:

* the chunk length is ``c = min(seq_len, 64)`` and the sequence is padded to ``n = ceil(seq_len / c)``
  chunks inside the graph, so a one-token decode step is a single 1x1 chunk, which is algebraically
  the one-token recurrence of ``torch_recurrent_gated_delta_rule`` (no padding to 64);
* the unit lower-triangular inverse ``(I - M) ** -1`` (``M`` strictly lower, order c <= 64) is
  built by doubling blocks instead of a solve: ``X`` starts as the inverse of the 1x1 diagonal
  blocks (the identity) and each of 6 levels turns the inverse of the aligned s x s diagonal
  blocks into that of the 2s x 2s ones, ``X <- X + X (M * cross_s) X``, where ``cross_s`` selects
  the entries joining the two s-blocks of one 2s-block (exact: the block inverse
  [[A, 0], [C, B]] ** -1 = [[A ** -1, 0], [-B ** -1 C A ** -1, B ** -1]]). Every intermediate is
  the inverse of a principal block, bounded as the inverse itself is. (The power product
  ``(I + M)(I + M ** 2)...(I + M ** 32)`` is the same matrix algebraically, but its powers grow
  like binomial coefficients when keys repeat and decay is slow, e.g. 64 equal tokens: entries
  near 1e8 cancel and fp32 keeps no correct digit of the state);
* the scan over chunks is an ONNX ``Scan`` whose iteration count is the chunk count of the call:
  nothing depends on the trace length, and the work is linear in ``seq_len`` (each chunk costs
  c ** 2 (d_k + d_v) + c d_k d_v multiply-adds per head).

The function ``GatedDeltaRule`` (domain ``com.qeff_vision``) takes fp32 ``query``, ``key``
[batch, heads, seq, d_k] (already L2-normalized, query scaled by d_k ** -0.5, key heads repeated to
the value heads), ``value`` [batch, heads, seq, d_v], ``decay`` (log-space gate g) and ``beta``
[batch, heads, seq], and the ``state`` [batch, heads, d_k, d_v]; it returns the output
[batch, heads, seq, d_v] and the final state. A token with ``decay == 0`` and ``beta == 0`` leaves
the state unchanged, which is how callers make padding and idle rows inert.
"""

from __future__ import annotations

import warnings

import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from qeff_vision.graph_file import model_nodes

DOMAIN = "com.qeff_vision"
DOMAIN_VERSION = 1
NAME = "GatedDeltaRule"
CHUNK = 64
# Block doubling from 1x1 to 2^DOUBLINGS x 2^DOUBLINGS blocks inverts a chunk of order <= 2^DOUBLINGS.
DOUBLINGS = 6
assert 2**DOUBLINGS >= CHUNK


def unit_lower_inverse(strict: torch.Tensor) -> torch.Tensor:
    """``(I - strict) ** -1`` for a strictly lower ``strict`` [..., c, c], c <= 64, by block doubling."""
    chunk = strict.shape[-1]
    index = torch.arange(chunk)
    rows, cols = index.unsqueeze(-1), index.unsqueeze(0)
    inverse = torch.eye(chunk)
    for level in range(DOUBLINGS):
        size = 2**level
        cross = (rows // (2 * size) == cols // (2 * size)) & (rows // size != cols // size)
        inverse = inverse + inverse @ (strict * cross) @ inverse
    return inverse


def gated_delta_rule(query, key, value, decay, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager gated delta rule with exactly the graph's algebra (see the module docstring)."""
    batch, heads, seq_len, _ = query.shape
    chunk = min(seq_len, CHUNK)
    chunks = -(-seq_len // chunk)
    pad = chunks * chunk - seq_len
    query, key, value = (
        F.pad(x, (0, 0, 0, pad)).reshape(batch, heads, chunks, chunk, -1) for x in (query, key, value)
    )
    decay, beta = (F.pad(x, (0, pad)).reshape(batch, heads, chunks, chunk) for x in (decay, beta))
    key_beta, value_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)
    cum = decay.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    strict = -((key_beta @ key.transpose(-1, -2)) * pairwise).tril(-1)
    inverse = unit_lower_inverse(strict)
    new_values = inverse @ value_beta
    state_read = inverse @ (key_beta * cum.exp().unsqueeze(-1))
    intra = (query @ key.transpose(-1, -2)) * pairwise
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(chunks):
        corrected = new_values[:, :, i] - state_read[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra[:, :, i] @ corrected)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ corrected
    output = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk, -1)[:, :, :seq_len]
    return output, state


class GatedDeltaRuleFunction(torch.autograd.Function):
    """:func:`gated_delta_rule` that exports as one ``GatedDeltaRule`` node."""

    @staticmethod
    def forward(query, key, value, decay, beta, state):
        """Eager result (also what tracing records as the example output)."""
        with warnings.catch_warnings():  # the eager body's Python ints are not what the graph records
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return gated_delta_rule(query, key, value, decay, beta, state)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102 - inference only
        pass

    @staticmethod
    def symbolic(g, query, key, value, decay, beta, state):  # noqa: D102 - ONNX emission
        output, final = g.op(f"{DOMAIN}::{NAME}", query, key, value, decay, beta, state, outputs=2)
        return output.setType(value.type()), final.setType(state.type())


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def _scalar(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value])
    )


def _int_scalar(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value])
    )


def _doubling_level(level: int) -> list[onnx.NodeProto]:
    """``inverse{level + 1} = X + X (M * cross) X``, ``X = inverse{level}``: blocks of 2**level doubled."""
    size, at = 2**level, f"_l{level}"
    nodes = []
    for span, name in ((2 * size, "pair"), (size, "block")):
        nodes += [
            _int_scalar(f"{name}_span{at}", span),
            helper.make_node("Div", ["index_rows", f"{name}_span{at}"], [f"{name}_row{at}"]),
            helper.make_node("Div", ["index_cols", f"{name}_span{at}"], [f"{name}_col{at}"]),
            helper.make_node("Equal", [f"{name}_row{at}", f"{name}_col{at}"], [f"same_{name}{at}"]),
        ]
    x, nxt = f"inverse{level}", f"inverse{level + 1}"
    return nodes + [
        helper.make_node("Not", [f"same_block{at}"], [f"other_block{at}"]),
        helper.make_node("And", [f"same_pair{at}", f"other_block{at}"], [f"cross{at}"]),
        helper.make_node("Cast", [f"cross{at}"], [f"cross_f{at}"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["strict_m", f"cross_f{at}"], [f"joining{at}"]),
        helper.make_node("MatMul", [x, f"joining{at}"], [f"left{at}"]),
        helper.make_node("MatMul", [f"left{at}", x], [f"term{at}"]),
        helper.make_node("Add", [x, f"term{at}"], [nxt]),
    ]


def _scan_body() -> onnx.GraphProto:
    """One chunk: read the state, correct the chunk's values (delta rule), emit, update the state."""
    names = (
        "step_state",
        "step_state_read",
        "step_new_values",
        "step_query",
        "step_intra",
        "step_key",
        "step_chunk_decay",
    )
    nodes = [
        helper.make_node("MatMul", ["step_state_read", "step_state"], ["step_predicted"]),
        helper.make_node("Sub", ["step_new_values", "step_predicted"], ["step_corrected"]),
        helper.make_node("MatMul", ["step_query", "step_state"], ["step_inter_out"]),
        helper.make_node("MatMul", ["step_intra", "step_corrected"], ["step_intra_out"]),
        helper.make_node("Add", ["step_inter_out", "step_intra_out"], ["step_chunk_out"]),
        helper.make_node("Mul", ["step_state", "step_chunk_decay"], ["step_decayed"]),
        helper.make_node("Transpose", ["step_key"], ["step_key_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["step_key_t", "step_corrected"], ["step_written"]),
        helper.make_node("Add", ["step_decayed", "step_written"], ["step_next_state"]),
    ]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
        for name in ("step_next_state", "step_chunk_out")
    ]
    return helper.make_graph(nodes, "gated_delta_chunk", inputs, outputs)


def _chunked(nodes: list, source: str, out: str, shape: str, pads: str) -> None:
    nodes.append(helper.make_node("Pad", [source, pads], [f"{out}_padded"]))
    nodes.append(helper.make_node("Reshape", [f"{out}_padded", shape], [out]))


def gated_delta_function(opset: int) -> onnx.FunctionProto:
    """The ``GatedDeltaRule`` definition from standard ops (Pad, CumSum, Trilu, MatMul, Scan)."""
    nodes = [
        helper.make_node("Shape", ["query"], ["seq_len"], start=2, end=3),
        _ints("max_chunk", [CHUNK]),
        _ints("one", [1]),
        _ints("zero", [0]),
        _ints("keep2", [0, 0]),
        _ints("minus_one", [-1]),
        _ints("zeros6", [0] * 6),
        _ints("zeros5", [0] * 5),
        helper.make_node("Min", ["seq_len", "max_chunk"], ["chunk"]),
        helper.make_node("Sub", ["chunk", "one"], ["chunk_less_one"]),
        helper.make_node("Add", ["seq_len", "chunk_less_one"], ["rounded_up"]),
        helper.make_node("Div", ["rounded_up", "chunk"], ["chunks"]),
        helper.make_node("Mul", ["chunks", "chunk"], ["padded_len"]),
        helper.make_node("Sub", ["padded_len", "seq_len"], ["pad"]),
        helper.make_node("Concat", ["zeros6", "pad", "zero"], ["pads4"], axis=0),
        helper.make_node("Concat", ["zeros5", "pad"], ["pads3"], axis=0),
        helper.make_node("Concat", ["keep2", "chunks", "chunk", "minus_one"], ["shape5"], axis=0),
        helper.make_node("Concat", ["keep2", "chunks", "chunk"], ["shape4"], axis=0),
    ]
    for name in ("query", "key", "value"):
        _chunked(nodes, name, f"{name}_c", "shape5", "pads4")
    for name in ("decay", "beta"):
        _chunked(nodes, name, f"{name}_c", "shape4", "pads3")
    _ints_axis = _ints("last_axis", [-1])
    nodes += [
        _ints_axis,
        _ints("second_last_axis", [-2]),
        _scalar("minus_inf", float("-inf")),
        helper.make_node("Unsqueeze", ["beta_c", "last_axis"], ["beta_u"]),
        helper.make_node("Mul", ["key_c", "beta_u"], ["key_beta"]),
        helper.make_node("Mul", ["value_c", "beta_u"], ["value_beta"]),
        helper.make_node(
            "Constant", [], ["axis"], value=helper.make_tensor("axis", TensorProto.INT64, [], [-1])
        ),
        helper.make_node("CumSum", ["decay_c", "axis"], ["cum"]),
        helper.make_node("Unsqueeze", ["cum", "last_axis"], ["cum_rows"]),
        helper.make_node("Unsqueeze", ["cum", "second_last_axis"], ["cum_cols"]),
        helper.make_node("Sub", ["cum_rows", "cum_cols"], ["pair_log"]),
        helper.make_node("Concat", ["chunk", "chunk"], ["square"], axis=0),
        helper.make_node(
            "ConstantOfShape",
            ["square"],
            ["ones"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        helper.make_node("Trilu", ["ones"], ["lower"], upper=0),
        helper.make_node(
            "Constant", [], ["below"], value=helper.make_tensor("below", TensorProto.INT64, [], [-1])
        ),
        helper.make_node("Trilu", ["ones", "below"], ["strict"], upper=0),
        helper.make_node("Cast", ["lower"], ["lower_mask"], to=TensorProto.BOOL),
        helper.make_node("Where", ["lower_mask", "pair_log", "minus_inf"], ["pair_masked"]),
        helper.make_node("Exp", ["pair_masked"], ["pairwise"]),
        helper.make_node("Transpose", ["key_c"], ["key_t"], perm=[0, 1, 2, 4, 3]),
        helper.make_node("MatMul", ["key_beta", "key_t"], ["kk"]),
        helper.make_node("Mul", ["kk", "pairwise"], ["kk_decayed"]),
        helper.make_node("Mul", ["kk_decayed", "strict"], ["kk_strict"]),
        helper.make_node("Neg", ["kk_strict"], ["strict_m"]),
        helper.make_node("EyeLike", ["ones"], ["inverse0"]),
        helper.make_node("Squeeze", ["chunk"], ["chunk_scalar"]),
        _int_scalar("index_start", 0),
        _int_scalar("index_step", 1),
        helper.make_node("Range", ["index_start", "chunk_scalar", "index_step"], ["index"]),
        helper.make_node("Unsqueeze", ["index", "last_axis"], ["index_rows"]),
        helper.make_node("Unsqueeze", ["index", "zero"], ["index_cols"]),
    ]
    for level in range(DOUBLINGS):
        nodes += _doubling_level(level)
    inverse = f"inverse{DOUBLINGS}"
    nodes += [
        helper.make_node("MatMul", [inverse, "value_beta"], ["new_values"]),
        helper.make_node("Exp", ["cum"], ["cum_exp"]),
        helper.make_node("Unsqueeze", ["cum_exp", "last_axis"], ["cum_exp_u"]),
        helper.make_node("Mul", ["key_beta", "cum_exp_u"], ["key_beta_decayed"]),
        helper.make_node("MatMul", [inverse, "key_beta_decayed"], ["state_read"]),
        helper.make_node("MatMul", ["query_c", "key_t"], ["qk"]),
        helper.make_node("Mul", ["qk", "pairwise"], ["intra"]),
        helper.make_node("Mul", ["query_c", "cum_exp_u"], ["query_decayed"]),
        helper.make_node("Slice", ["cum", "minus_one", "max_int", "last_axis"], ["cum_last"]),
        helper.make_node("Sub", ["cum_last", "cum"], ["to_end"]),
        helper.make_node("Exp", ["to_end"], ["to_end_exp"]),
        helper.make_node("Unsqueeze", ["to_end_exp", "last_axis"], ["to_end_u"]),
        helper.make_node("Mul", ["key_c", "to_end_u"], ["key_decayed"]),
        helper.make_node("Exp", ["cum_last"], ["chunk_decay_3"]),
        helper.make_node("Unsqueeze", ["chunk_decay_3", "last_axis"], ["chunk_decay"]),
        helper.make_node(
            "Scan",
            ["state", "state_read", "new_values", "query_decayed", "intra", "key_decayed", "chunk_decay"],
            ["final_state", "chunk_outputs"],
            body=_scan_body(),
            num_scan_inputs=6,
            scan_input_axes=[2] * 6,
            scan_output_axes=[2],
        ),
        helper.make_node("Concat", ["keep2", "padded_len", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["chunk_outputs", "flat_shape"], ["padded_output"]),
        _ints("seq_axis", [2]),
        helper.make_node("Slice", ["padded_output", "zero", "seq_len", "seq_axis"], ["output"]),
    ]
    nodes.insert(0, _ints("max_int", [2**62]))
    return helper.make_function(
        DOMAIN,
        NAME,
        ["query", "key", "value", "decay", "beta", "state"],
        ["output", "final_state"],
        nodes,
        [helper.make_opsetid("", opset)],
    )


def attach_gated_delta(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the ``GatedDeltaRule`` definition (and the domain import) when the graph uses it."""
    used = any(node.domain == DOMAIN and node.op_type == NAME for node in model_nodes(model))
    if not used:
        return model
    opset = next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))
    if not any(f.domain == DOMAIN and f.name == NAME for f in model.functions):
        model.functions.append(gated_delta_function(opset))
    if not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
