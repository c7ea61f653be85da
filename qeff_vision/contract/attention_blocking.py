"""Block counts of exported attentions and experts (pure data; the torch side: export/blocked_attention.py).

A graph's node list cannot depend on a specialization, so an attention's block count is fixed when
it is traced: the smallest count that keeps one block's scores under ``bound`` bytes (at the
device dtype) at the largest length the policy is sized for. The export records the policy in
export.json (``attention_blocking``); a compile exports with the policy its spec implies
(:func:`for_spec`) and measures every specialization (qeff_vision/compile/activation_memory.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MIB = 1 << 20
#: Default bound on one intermediate (bytes at the device dtype), also ``compile.max_activation_bytes``.
DEFAULT_BOUND = 256 * MIB
#: Vision attention length the default policy is sized for: above a 2560x1440 image on every family
#: (Qwen2.5-VL, 14 px patches: 102 x 182 = 18,564 patches; Qwen3-VL, 16 px: 14,400; Pixtral at
#: its 1540 px limit: 12,100).
VISION_ROWS = 20_480
#: Language prefill shape the default policy is sized for (seq_len x ctx_len).
LANGUAGE_ROWS = 512
LANGUAGE_KEYS = 32_768
#: Bytes per element at the device dtype (fp16 on AI 100, bf16 on AI 200).
DEVICE_ITEM_BYTES = 2


@dataclass(frozen=True)
class AttentionBlocking:
    """How many blocks an attention (or a mixture-of-experts layer) gets: the fewest under ``bound``.

    Attributes:
        bound: Bytes one block's scores may take at ``item_bytes`` per element.
        vision_rows: Longest vision attention (queries = keys) the count must bound.
        language_rows: Most query rows of a language call (the largest prefill ``seq_len``).
        language_keys: Most keys of a language call (``ctx_len``).
        vision_blocks: Fixed query-block count for vision towers (None: from the bound).
        language_blocks: Fixed key-block count for the language program (None: from the bound).
        item_bytes: Bytes per score element on the device.
        expert_blocks: Fixed count of expert-slice blocks of a mixture-of-experts layer (None: from
            the bound; never more than the layer's top-k, see :meth:`expert_counts`).
        expert_chunks: Fixed count of chunks of the experts' intermediate width (None: from the bound).
    """

    bound: int = DEFAULT_BOUND
    vision_rows: int = VISION_ROWS
    language_rows: int = LANGUAGE_ROWS
    language_keys: int = LANGUAGE_KEYS
    vision_blocks: int | None = None
    language_blocks: int | None = None
    item_bytes: int = DEVICE_ITEM_BYTES
    expert_blocks: int | None = None
    expert_chunks: int | None = None

    def vision_count(self, heads: int, rows: int | None = None, batch: int = 1) -> int:
        """Query blocks for a tower attention with ``heads`` score planes per query row.

        Args:
            heads: Attention heads.
            rows: The attention's length when the tower fixes it (a tile of the checkpoint's image
                size); None: ``vision_rows``, the longest any image may give.
            batch: Most attentions one call computes side by side (a fixed-size tower's tiles).
        """
        if self.vision_blocks is not None:
            return self.vision_blocks
        rows = rows or self.vision_rows
        whole = batch * heads * rows * rows * self.item_bytes
        return max(1, math.ceil(whole / self.bound))

    def language_count(self, heads: int) -> int:
        """Key blocks for a language attention with ``heads`` query heads."""
        if self.language_blocks is not None:
            return self.language_blocks
        whole = heads * self.language_rows * self.language_keys * self.item_bytes
        # Blocks of a power-of-two share of the keys divide a power-of-two ctx_len evenly.
        return 1 << max(0, math.ceil(math.log2(max(1.0, whole / self.bound))))

    def expert_counts(self, experts: int, top_k: int, inner: int, hidden: int) -> tuple[int, int]:
        """(slice blocks, width chunks) of a mixture-of-experts layer (export/experts.py).

        A layer reads n = min(tokens x top_k, experts) expert slices; they are taken in ``blocks``
        balanced blocks of at most ceil(experts / blocks) slices, and each block's intermediate
        width in ``chunks``. The block count never exceeds ``top_k`` (nor ``experts``): n is at
        least top_k at every call, so no block is ever empty. One chunk gathers a block's whole
        slices (b x 2 x inner x hidden values); more chunks gather each projection's chunk
        (b x inner / chunks x hidden). A chunk's activations at the largest prefill are
        b x ``language_rows`` x inner / chunks. The pair is the one with the fewest blocks x
        chunks (then the fewest blocks) that keeps both under the bound; top-k blocks of single
        columns if none does.

        Args:
            experts: Experts of the layer.
            top_k: Experts each token is routed to.
            inner: The experts' intermediate width (gate and up each).
            hidden: The model width.
        """
        most = max(1, min(top_k, experts))
        block_choices = range(1, most + 1)
        if self.expert_blocks is not None:
            block_choices = [max(1, min(self.expert_blocks, most))]
        best = None
        for blocks in block_choices:
            per_block = -(-experts // blocks)
            if self.expert_chunks is not None:
                chunks = max(1, min(self.expert_chunks, inner))
            else:
                chunks = next(
                    (c for c in range(1, inner + 1) if self._chunk_fits(per_block, c, inner, hidden)), inner
                )
            fits = self._chunk_fits(per_block, chunks, inner, hidden)
            key = (not fits, blocks * chunks, blocks)
            if best is None or key < best[0]:
                best = (key, blocks, chunks)
        return best[1], best[2]

    def _chunk_fits(self, per_block: int, chunks: int, inner: int, hidden: int) -> bool:
        """Whether one chunk of a block of ``per_block`` slices stays under the bound."""
        width = -(-inner // chunks)
        gathered = per_block * (2 * inner if chunks == 1 else width) * hidden * self.item_bytes
        activations = per_block * self.language_rows * width * self.item_bytes
        return max(gathered, activations) <= self.bound

    def to_dict(self) -> dict:
        """The policy as export.json records it."""
        return asdict(self)


#: Unblocked: every attention and expert layer in one block (what the graphs were before blocking).
UNBLOCKED = AttentionBlocking(vision_blocks=1, language_blocks=1, expert_blocks=1, expert_chunks=1)


@dataclass(frozen=True)
class VisionAttention:
    """The largest attention of a vision program at one specialization, as a family declares it.

    Attributes:
        heads: Attention heads.
        queries: Query rows of one attention.
        keys: Keys of one attention.
        parallel: Attentions one call computes side by side (images, frames, tiles).
        blocks: Query blocks the export gives it under a policy (1: not blocked).
    """

    heads: int
    queries: int
    keys: int
    parallel: int = 1
    blocks: int = 1

    def score_bytes(self, item_bytes: int = DEVICE_ITEM_BYTES) -> tuple[int, int]:
        """(whole scores, one query block's scores) in bytes."""
        whole = self.parallel * self.heads * self.queries * self.keys * item_bytes
        rows = -(-self.queries // max(1, self.blocks))
        return whole, self.parallel * self.heads * rows * self.keys * item_bytes


def language_score_bytes(
    heads: int, batch: int, rows: int, keys: int, policy: AttentionBlocking
) -> tuple[int, int]:
    """(whole scores, one key block's scores) in bytes of a language attention call."""
    blocks = policy.language_count(heads)
    whole = batch * heads * rows * keys * policy.item_bytes
    return whole, batch * heads * rows * -(-keys // blocks) * policy.item_bytes


def for_spec(bound: int | None, seq_lens, ctx_len: int) -> AttentionBlocking:
    """The policy a spec's compile exports with: its bound, its largest prefill and its ctx_len.

    Args:
        bound: ``compile.max_activation_bytes`` (None: no bound; blocks are sized for the default).
        seq_lens: The prefill ``seq_len`` buckets.
        ctx_len: The spec's context length.
    """
    return AttentionBlocking(
        bound=bound or DEFAULT_BOUND,
        language_rows=max([1, *seq_lens]),
        language_keys=max(1, int(ctx_len)),
    )
