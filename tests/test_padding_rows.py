"""A padding row (position -1) writes nothing anyone reads, whatever its ``batch_index`` (issue 31).

vLLM's Cloud AI plugin pads a continuous-batching decode call with rows whose ``input_ids``,
``position_ids`` and ``batch_index`` are all -1 (qualcomm/vllm-qaic ``model_loader/qaic.py``):
``batch_index`` -1 is the last slot, which another row of the call writes. For every
continuous-batching family, on its session export with every cache (window rings included)
filled with random values: one decode step for every slot, with and without such a row, leaves
the same caches and logits, and a dozen more steps from each result give identical logits. The
same when the padding row names a slot whose request is mid-prefill (not in the decode call):
its next prefill chunk and the steps after are identical too.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.compile.graph_io import read_graph_io
from qeff_vision.compile.onnxruntime_backend import bound_shape, generated_input
from qeff_vision.contract.slot_names import is_kv_name
from qeff_vision.export_record import read_export
from qeff_vision.families import all_families, get_family

CB_FAMILIES = [f.name for f in all_families() if f.features.continuous_batching.supported]
SLOTS = 3
CTX_LEN = 48
STEPS = 12
PREFILL = 5  # tokens of the mid-prefill request's next chunk
# Decode positions of the slots: past the tiny window (8) so every ring slot is live and wraps.
STARTS = (17, 9, 23)


class Calls:
    """The language program on onnxruntime with feeds generated for any batch and chunk length."""

    def __init__(self, export_dir):
        manifest = read_export(export_dir)
        path = export_dir / manifest["programs"]["lang"]["path"]
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.graph = read_graph_io(path)
        family = get_family(manifest["family"])
        description = Checkpoint.open(manifest["model"], manifest["family"]).description
        self.symbols = {
            symbols.FULL_BATCH_SIZE: SLOTS,
            symbols.VISION_BATCH_SIZE: 1,
            symbols.VISION_SIZE: PREFILL,
            "max_num_images": 1,
            **family.kv_cache_lengths(description, CTX_LEN),
            **family.language_symbols(description),
        }
        self.names = [tensor.name for tensor in self.graph.outputs]
        self.rng = np.random.default_rng(0)

    def caches(self) -> dict[str, np.ndarray]:
        """Every KV input at random values (a device's resident state after earlier requests)."""
        feeds = self.feeds(np.zeros((SLOTS, 1), np.int64), np.zeros((SLOTS, 1), np.int64), np.arange(SLOTS))
        return {name: value for name, value in feeds.items() if is_kv_name(name)}

    def feeds(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Generated inputs for rows ``ids`` / ``positions`` [batch, seq] in KV ``slots`` [batch]."""
        batch, seq = ids.shape
        values = {**self.symbols, symbols.BATCH_SIZE: batch, symbols.SEQ_LEN: seq}
        rng = np.random.default_rng(1)  # the same vision rows and extra inputs in every call
        feeds = {
            tensor.name: generated_input(tensor, bound_shape(tensor, values, "padding test"), rng, SLOTS)
            for tensor in self.graph.inputs
        }
        feeds[symbols.INPUT_IDS] = ids
        position_ids = feeds[symbols.POSITION_IDS]
        feeds[symbols.POSITION_IDS] = np.broadcast_to(positions, position_ids.shape).copy()  # M-RoPE too
        feeds[symbols.BATCH_INDEX] = slots.reshape(-1, 1).astype(np.int64)
        if symbols.CROSS_ATTENTION_MASK in feeds:  # padding rows use no image slot
            mask = feeds[symbols.CROSS_ATTENTION_MASK]
            mask[positions.max(axis=1) < 0] = -1
        return feeds

    def run(self, caches, ids, positions, slots) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(logits, updated caches) of one call."""
        outputs = dict(
            zip(self.names, self.session.run(self.names, {**self.feeds(ids, positions, slots), **caches}))
        )
        return outputs[symbols.LOGITS], {name: outputs[symbols.retained(name)] for name in caches}


def _decode_rows(slots: list[int], step: int, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = tokens[slots, step].reshape(-1, 1)
    positions = np.array([[STARTS[slot] + step] for slot in slots], np.int64)
    return ids, positions


def _with_padding(ids, positions, slots, padding_slot: int):
    """The rows plus vLLM's padding row: token and position -1, ``batch_index`` ``padding_slot``."""
    return (
        np.concatenate([ids, [[-1]]]),
        np.concatenate([positions, [[-1]]]),
        np.concatenate([slots, [padding_slot]]),
    )


def _assert_same(label: str, ours, theirs) -> None:
    logits, caches = ours
    ref_logits, ref_caches = theirs
    assert np.array_equal(logits, ref_logits), (
        f"{label}: logits differ by {np.abs(logits - ref_logits).max()}"
    )
    changed = [name for name in caches if not np.array_equal(caches[name], ref_caches[name])]
    assert not changed, f"{label}: the padding row changed {changed}"


@pytest.mark.parametrize("family", CB_FAMILIES)
def test_a_padding_row_on_the_last_slot_changes_nothing(family, cb_exported):
    """Every slot decodes; the extra row's batch_index -1 names the last one, which row 2 writes."""
    calls = Calls(cb_exported(family))
    caches = calls.caches()
    tokens = calls.rng.integers(1, 50, size=(SLOTS, STEPS + 1))
    slots = np.arange(SLOTS)
    ids, positions = _decode_rows(list(slots), 0, tokens)
    plain = calls.run(caches, ids, positions, slots)
    logits, padded_caches = calls.run(caches, *_with_padding(ids, positions, slots, -1))
    _assert_same(f"{family} step 0", (logits[:SLOTS], padded_caches), plain)
    states = {"plain": plain[1], "padded": padded_caches}
    for step in range(1, STEPS + 1):
        ids, positions = _decode_rows(list(slots), step, tokens)
        results = {name: calls.run(state, ids, positions, slots) for name, state in states.items()}
        _assert_same(f"{family} step {step}", results["padded"], results["plain"])
        states = {name: result[1] for name, result in results.items()}


@pytest.mark.parametrize("family", CB_FAMILIES)
def test_a_padding_row_naming_a_slot_mid_prefill_changes_nothing(family, cb_exported):
    """Slots 0-1 decode while slot 2's request is between prefill chunks; the padding row names slot 2."""
    calls = Calls(cb_exported(family))
    caches = calls.caches()
    tokens = calls.rng.integers(1, 50, size=(SLOTS, STEPS + 1))
    decoding = np.arange(SLOTS - 1)
    ids, positions = _decode_rows(list(decoding), 0, tokens)
    plain = calls.run(caches, ids, positions, decoding)
    logits, padded_caches = calls.run(caches, *_with_padding(ids, positions, decoding, SLOTS - 1))
    _assert_same(f"{family} decode", (logits[: SLOTS - 1], padded_caches), plain)
    # Slot 2's next chunk: PREFILL tokens from its position STARTS[2] (a batch-1 call), then all decode.
    chunk_ids = calls.rng.integers(1, 50, size=(1, PREFILL))
    chunk_positions = np.arange(STARTS[2], STARTS[2] + PREFILL).reshape(1, -1)
    states = {"plain": plain[1], "padded": padded_caches}
    results = {
        name: calls.run(state, chunk_ids, chunk_positions, np.array([2])) for name, state in states.items()
    }
    _assert_same(f"{family} prefill", results["padded"], results["plain"])
    states = {name: result[1] for name, result in results.items()}
    shifted = np.array([0, 0, PREFILL])  # slot 2 decodes after its chunk
    for step in range(1, STEPS + 1):
        ids = tokens[:, step].reshape(-1, 1)
        positions = (np.array(STARTS) + step + shifted - (shifted > 0)).reshape(-1, 1).astype(np.int64)
        results = {name: calls.run(state, ids, positions, np.arange(SLOTS)) for name, state in states.items()}
        _assert_same(f"{family} step {step}", results["padded"], results["plain"])
        states = {name: result[1] for name, result in results.items()}


@pytest.mark.parametrize(
    ("positions", "slots"),
    [
        ([[5], [9], [-1], [-1], [-1]], [0, 3, -1, 3, 1]),  # three padding rows, two on slot 3 with row 1
        ([[0], [-1], [-1]], [2, 2, -1]),  # slots given as 2 and -1 (= 2 of 3)
        ([[4, 5, 6, -1, -1]], [1]),  # a prefill chunk's padded tail
        ([[-1, -1, -1]], [-1]),  # a call of padding only
    ],
)
def test_write_plan_gives_padding_indices_no_other_token_writes(positions, slots):
    """Full-context and ring indices are distinct across the call; valid tokens keep their own."""
    import torch

    from qeff_vision.export.kv_writes import write_plan

    full_batch_size, ctx_len, ring_len = 3 if max(slots) < 3 else 4, 16, 4
    positions = torch.tensor(positions)
    plan = write_plan(positions, torch.tensor(slots).view(-1, 1), full_batch_size)
    slot = plan.batch_index.expand(-1, positions.shape[1])
    assert int(slot.min()) >= 0 and int(slot.max()) < full_batch_size
    full = plan.full_slots(positions, ctx_len)
    assert torch.equal(full[plan.fresh], positions[plan.fresh])
    written = list(zip(slot.flatten().tolist(), full.flatten().tolist()))
    assert len(set(written)) == len(written), written
    ring = plan.ring_slots(ring_len)
    ring_written = list(
        zip(plan.batch_index.expand(-1, ring.shape[1]).flatten().tolist(), ring.flatten().tolist())
    )
    assert len(set(ring_written)) == len(ring_written), ring_written
    for row, row_positions in enumerate(positions.tolist()):  # a valid row's ring write holds its changes
        changed = {p % ring_len for p in row_positions if p >= 0}
        assert changed <= set(ring[row].tolist())
