"""What a language program is for (spec ``task``): generate text, or pool one prompt (torch-free).

``generate`` is the KV-cache decoder of the IO contract. ``embed`` and ``score`` are the pooling
programs of Qwen3-VL-Embedding and Qwen3-VL-Reranker (ref: github.com/QwenLM/Qwen3-VL-Embedding
README, "Architecture Design"): one call reads the whole prompt and returns

* ``embed``: the last token's final hidden state (after the final norm), L2-normalized,
  ``embeddings`` [batch, hidden]. Matryoshka dimensions are a prefix of it, renormalized on the
  host (truncating before or after the normalization gives the same unit vector);
* ``score``: ``sigmoid(logit("yes") - logit("no"))`` at the last position, ``scores`` [batch, 1]:
  the two rows of ``lm_head`` are the only part of the head kept (vLLM's ``classifier_from_token``
  conversion of the Qwen3 rerankers computes the same difference, examples/offline_inference/
  qwen3_reranker.py).

A pooling program keeps no state between calls: no KV cache, no retained rows, no decode
specialization. A prompt is one call in the smallest prefill bucket that holds it (the rows it
needs of ``vision_embeds``, image cursor 0, padding at position -1), so the buckets are prompt
lengths and the longest is the longest prompt. That is what vLLM's pooling runner gives a user:
every request is pooled once over its whole prompt and no request's tokens wait for a later step.
"""

from __future__ import annotations

from dataclasses import replace

from qeff_vision import symbols
from qeff_vision.contract.io_rows import HIDDEN_SIZE, DType, IORow, Role
from qeff_vision.contract.language_io import LanguageIO

GENERATE = "generate"
EMBED = "embed"
SCORE = "score"
TASKS = (GENERATE, EMBED, SCORE)
POOLING_TASKS = (EMBED, SCORE)
#: The two tokens whose logit difference is the reranker's score (positive first).
SCORE_TOKENS = ("yes", "no")
#: Input roles a pooling program keeps: everything but per-layer state and continuous batching.
POOLED_INPUT_ROLES = (Role.TOKEN_IDS, Role.POSITIONS, Role.VISION_ROWS, Role.VISION_CURSOR, Role.CROSS_MASK)


def is_pooling(task: str) -> bool:
    """Whether ``task`` is one of the pooling tasks (no KV cache, no decode)."""
    return task in POOLING_TASKS


def pooled_io(io: LanguageIO, task: str) -> LanguageIO:
    """The pooling program's table from the generate table ``io`` of the same family and model.

    The token, position and vision inputs stay as they are (same names, axes and merge rule);
    nothing is retained, so the vision rows lose their ``_RetainedState`` pairs; the only output
    is ``embeddings`` or ``scores``.

    Raises:
        ValueError: ``task`` is not a pooling task, or ``io`` has inputs of continuous batching or
            compute-context lengths (they have no meaning without a cache).
    """
    if not is_pooling(task):
        raise ValueError(f"{task!r} is not a pooling task ({', '.join(POOLING_TASKS)})")
    stateful = [row.name for row in io.inputs if row.role in (Role.KV_SLOT, Role.COMP_CTX_LENGTHS)]
    if stateful:
        raise ValueError(f"a pooling program has no cache, so no {', '.join(stateful)}")
    inputs = tuple(replace(row, retained=None) for row in io.inputs if row.role in POOLED_INPUT_ROLES)
    batch = symbols.BATCH_SIZE
    if task == EMBED:
        output = IORow(symbols.EMBEDDINGS, Role.EMBEDDING, DType.COMPUTE, (batch, HIDDEN_SIZE))
    else:
        output = IORow(symbols.SCORES, Role.SCORE, DType.COMPUTE, (batch, 1))
    return LanguageIO(inputs, (output,), ())


def pooled_output_name(task: str) -> str:
    """The one output of a pooling program of ``task``."""
    return {EMBED: symbols.EMBEDDINGS, SCORE: symbols.SCORES}[task]
