"""Mixture-of-experts layouts the tiny defaults lack, every MoE family, every deployment (issue 35).

Each variant rewrites its family's tiny checkpoint with many experts (64), top-1 or top-8 routing,
a shared expert (Qwen3.5-MoE, Llama 4) or a dense MLP beside the experts (Gemma 4), and dense and
sparse layers mixed (Qwen3-VL-MoE ``mlp_only_layers``, Llama 4 ``interleave_moe_layer_step``).
Against transformers' ``generate`` (tokens identical, logits within the harness' tolerance):

* ``dual``: chunked prefill over an image, then decode, on the plain export;
* ``single``: the composed program (encoder inside), same prompt;
* ``disaggregated``: five staggered requests, prefill on ``lang_prefill`` (batch 1), decode on
  ``lang_decode`` (``full_batch_size`` 4), each prefill's KV handed over;
* continuous batching: the same five requests through four slots of one program.

The exports read the experts in forced blocks (``EXPERT_BLOCKS``). The graph test counts the
expert slices each specialization reads (``compile/weight_reads.py``:
the specialization's shapes bound, shape arithmetic folded as a compiler does): min(tokens x
top_k, experts) per sparse layer, so a decode step reads the routed experts and a prefill chunk
each expert once. The router's top-k near a tie could flip on float32 rounding; the seeds used
have none (a flip would show as different tokens, not pass silently).
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest

from qeff_vision import symbols
from qeff_vision.compile.single_program import write_single_program
from qeff_vision.compile.weight_reads import weight_reads
from qeff_vision.contract.attention_blocking import AttentionBlocking
from qeff_vision.export_record import read_export
from qeff_vision.exporter import export_model, load_adapter
from qeff_vision.runtime.disaggregated import phase_programs
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.generate import make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.runtime.single import SingleGenerator
from tests import helpers
from tests.family_runtime import CTX_LEN, NEW_TOKENS, FamilyRuntime
from tests.test_batched_engine import SLOTS, check_against_transformers, five_requests

SEQ_LENS = (16, 64)
# The expert slices in blocks and the intermediate width in chunks even at tiny widths (issue 54:
# export/experts.py ``routed_sum``; top-1 layouts keep one block, never an empty one), so every
# case below runs the bounded form.
EXPERT_BLOCKS = AttentionBlocking(expert_blocks=3, expert_chunks=2)


@dataclass(frozen=True)
class Variant:
    """A family's tiny checkpoint with its text config's MoE keys replaced.

    Attributes:
        family: The registered family.
        module: The family's tiny module (its text dict is patched while the checkpoint is written).
        table: Name of the module's dict of text keys; ``key`` picks an entry of it (Gemma 4's layouts).
        overrides: Keys replaced in that dict.
        key: The entry of ``table`` to patch, None to patch the dict itself.
    """

    family: str
    module: str
    table: str
    overrides: dict
    key: str | None = None

    def write(self, out_dir):
        """Write the checkpoint with the overrides in place."""
        import importlib

        tiny = importlib.import_module(self.module)
        table = getattr(tiny, self.table)
        target = table[self.key] if self.key else table
        with mock.patch.dict(target, self.overrides):
            if self.key:
                return tiny.write_tiny_checkpoint(out_dir, 0, self.key)
            return tiny.write_tiny_checkpoint(out_dir, 0)


VARIANTS = {
    # 64 experts, top 8; layer 1 a dense MLP.
    "qwen3_vl_moe-64x8": Variant(
        "qwen3_vl_moe",
        "qeff_vision.families.qwen3_vl_moe.tiny",
        "MOE_TEXT",
        {"num_experts": 64, "num_experts_per_tok": 8},
    ),
    # 64 experts, top 1, a gated shared expert; linear-attention and full layers.
    "qwen3_5_moe-64x1": Variant(
        "qwen3_5_moe",
        "qeff_vision.families.qwen3_5_moe.tiny",
        "MOE_TEXT",
        {"num_experts": 64, "num_experts_per_tok": 1},
    ),
    # Gemma 4's 26B layout: 64 experts, top 8, beside the dense MLP of every layer.
    "gemma4-moe-64x8": Variant(
        "gemma4",
        "qeff_vision.families.gemma4.tiny",
        "LAYOUTS",
        {"num_experts": 64, "top_k_experts": 8},
        key="moe",
    ),
    # Maverick's layout: 64 experts, top 1, a shared expert, MoE every second layer.
    "llama4-64x1": Variant(
        "llama4",
        "qeff_vision.families.llama4.tiny",
        "TEXT",
        {"num_local_experts": 64, "num_experts_per_tok": 1},
    ),
}


class Built:
    """One variant's checkpoint, exports (plain and continuous batching) and transformers model."""

    def __init__(self, variant: Variant, root):
        self.variant = variant
        self.checkpoint = variant.write(root / "model")
        self.plain, self.batching = root / "export", root / "cb-export"
        export_model(self.checkpoint, self.plain, progress=None, attention_blocking=EXPERT_BLOCKS)
        export_model(
            self.checkpoint,
            self.batching,
            continuous_batching=True,
            progress=None,
            attention_blocking=EXPERT_BLOCKS,
        )
        self.model, self.processor = helpers.load_hf(self.checkpoint)
        self.runtime = FamilyRuntime(variant.family, self.plain, self.model, self.processor)

    def text_config(self):
        """The checkpoint's text config (transformers')."""
        return self.model.config.get_text_config()

    def experts(self) -> tuple[int, int]:
        """(experts, top_k) of the variant, read from the loaded config."""
        config = self.text_config().to_dict()
        experts = config.get("num_experts") or config["num_local_experts"]
        return experts, config.get("num_experts_per_tok") or config["top_k_experts"]

    def language_path(self, export_dir):
        """The language graph of ``export_dir``."""
        return export_dir / read_export(export_dir)["programs"]["lang"]["path"]


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request, tmp_path_factory):
    return Built(VARIANTS[request.param], tmp_path_factory.mktemp(request.param))


def _prompt(runtime: FamilyRuntime):
    size = load_adapter(runtime.family).test_image_sizes[0]
    return runtime.inputs(["<image>", "Describe this picture in detail."], [helpers.image(*size, 7)])


def _expert_slices(path, values) -> list[int]:
    """Slices read per stacked expert tensor of the graph at ``values`` (sorted by tensor name)."""
    reads = sorted(weight_reads(path, values), key=lambda read: read.name)
    return [read.rows_read for read in reads if "experts" in read.name and len(read.shape) == 3]


def _values(batch: int, seq_len: int, slots: int | None = None) -> dict:
    values = {
        symbols.BATCH_SIZE: batch,
        symbols.SEQ_LEN: seq_len,
        "ctx_len": CTX_LEN,
        symbols.VISION_SIZE: max(seq_len, 16),
    }
    if slots is not None:
        values[symbols.FULL_BATCH_SIZE] = slots
    return values


def test_each_specialization_reads_min_tokens_times_top_k_expert_slices(built):
    experts, top_k = built.experts()
    plain = built.language_path(built.plain)
    batching = built.language_path(built.batching)
    # Two stacked tensors (gate/up and down) per sparse layer, each read the same number of slices.
    sparse = len(_expert_slices(plain, _values(1, 1))) // 2
    assert sparse >= 1
    cases = [
        (plain, _values(1, 1), 1 * top_k),  # dual / single decode
        *[(plain, _values(1, s), min(s * top_k, experts)) for s in SEQ_LENS],  # dual prefill chunks
        (batching, _values(1, 16, 1), min(16 * top_k, experts)),  # lang_prefill: batch 1, one slot
        (batching, _values(SLOTS, 1, SLOTS), min(SLOTS * top_k, experts)),  # lang_decode / CB decode
        (batching, _values(16, 1, 16), min(16 * top_k, experts)),  # F = 16: dense where 16 x k >= E
    ]
    for path, values, expected in cases:
        slices = _expert_slices(path, values)
        assert slices == [expected] * (2 * sparse), (built.variant.family, values, slices)
    # A decode step at batch 1 reads k slices (far below the experts); a prefill chunk each expert once.
    assert top_k < experts and min(SEQ_LENS[-1] * top_k, experts) == experts


def test_dual_chunked_prefill_and_decode_match_transformers(built):
    runtime = built.runtime
    processed = _prompt(runtime)
    plan, result = runtime.run(processed, SEQ_LENS)
    assert len(plan.chunks) >= 2  # the prompt takes several chunks
    assert len(result.tokens) >= 2  # at least one decode step (a random model may stop at EOS early)


def test_single_program_matches_transformers(built):
    runtime = built.runtime
    manifest = read_export(built.plain)
    path = write_single_program(
        built.plain,
        built.plain / manifest["programs"]["vision"]["path"],
        built.plain / manifest["programs"]["lang"]["path"],
    )
    processed = _prompt(runtime)
    rows = int(sum(runtime.checkpoint.host.placeholder_counts(processed)))
    shape = LanguageShape(tuple(PrefillBucket(s, rows) for s in SEQ_LENS), rows, CTX_LEN)
    generator = SingleGenerator(runtime.checkpoint, OnnxProgram(path), shape)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, keep_logits=True)
    runtime.check(result, processed, f"{built.variant.family} single")
    assert result.images_encoded == 1


def _batching_runtime(built) -> FamilyRuntime:
    return FamilyRuntime(built.variant.family, built.batching, built.model, built.processor)


def test_continuous_batching_five_requests_match_transformers(built):
    runtime = _batching_runtime(built)
    runtime._references = built.runtime._references  # same model: share the memoized references
    generator = runtime.generator((32, 128), cache=EmbeddingCache(64 * 2**20))
    requests = five_requests(runtime)
    engine = BatchedEngine(generator, full_batch_size=SLOTS)
    report = engine.run([EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True)
    assert report.batched and max(report.decode_batches) >= 2
    check_against_transformers(runtime, requests, report)


def test_disaggregated_prefill_and_decode_programs_match_transformers(built):
    runtime = _batching_runtime(built)
    runtime._references = built.runtime._references
    seq_lens = (32, 128)
    prefill = [
        {symbols.BATCH_SIZE: 1, symbols.FULL_BATCH_SIZE: 1, symbols.SEQ_LEN: s, symbols.VISION_SIZE: s}
        for s in seq_lens
    ]
    decode = [{symbols.BATCH_SIZE: SLOTS, symbols.FULL_BATCH_SIZE: SLOTS, symbols.SEQ_LEN: 1}]
    router = phase_programs(runtime.language, prefill, decode)
    shape = LanguageShape(tuple(PrefillBucket(s, s) for s in seq_lens), max(seq_lens), CTX_LEN)
    generator = make_generator(runtime.checkpoint, runtime.vision, router, shape, EmbeddingCache(64 * 2**20))
    requests = five_requests(runtime)
    report = BatchedEngine(generator).run(
        [EngineRequest(p, new, arrival) for p, new, arrival in requests], keep_logits=True
    )
    check_against_transformers(runtime, requests, report)
    assert router.prefill.calls == report.prefill_calls and router.decode.calls == len(report.decode_batches)
    assert router.handoffs == len(requests)


def test_routed_form_equals_transformers_experts_on_duplicate_choices():
    """Two tokens of one decode batch choosing the same expert: each copy counted for its owner only."""
    import torch

    from qeff_vision.export.experts import (
        expert_slices,
        read_slices,
        routing_table,
        slice_weights,
        weighted_outputs,
    )

    generator = torch.Generator().manual_seed(0)
    experts, hidden, inner = 6, 8, 4
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator)
    down = torch.randn(experts, hidden, inner, generator=generator)
    states = torch.randn(3, hidden, generator=generator)
    index = torch.tensor([[2, 5], [5, 0], [2, 5]])  # 3 x 2 = 6 >= 6 experts: the dense form
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    reference = torch.zeros_like(states)
    for token in range(3):
        for choice in range(2):
            e = index[token, choice]
            gate, up = (states[token] @ gate_up[e].T).chunk(2)
            reference[token] += weights[token, choice] * ((torch.nn.functional.silu(gate) * up) @ down[e].T)
    for rows in (1, 2, 3):  # routed (2, 4 slices) and dense (6)
        ids, owners = expert_slices(index[:rows], experts)
        assert len(ids) == min(rows * 2, experts)
        table = slice_weights(routing_table(index[:rows], weights[:rows], experts), ids, owners)
        ours = weighted_outputs(
            states[:rows], read_slices(gate_up, ids), read_slices(down, ids), torch.nn.functional.silu, table
        )
        assert np.allclose(ours.numpy(), reference[:rows].numpy(), atol=1e-5)
