"""``run --embed`` / ``run --score QUERY`` on compiled pooling artifacts: prompts, pooling, comparison.

Prompts are built with the checkpoint's own chat template, as the model cards of
Qwen3-VL-Embedding and Qwen3-VL-Reranker describe them (github.com/QwenLM/Qwen3-VL-Embedding
README, "Model Input Specification"; the reranker's system prompt and ``<Instruct>`` / ``<Query>``
/ ``<Document>`` layout as vLLM's Qwen3-VL-Reranker template writes it):

* embed: a system turn with the instruction (default "Represent the user's input."), then a user
  turn with the images and the text;
* score: the reranker's system prompt, then a user turn ``<Instruct>: ...`` ``<Query>: `` (the
  query's images and text) ``<Document>: `` (the document's images and text).

Parity with transformers is on the same processed inputs (``--compare-hf``): cosine for an
embedding, absolute difference for a score.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_vision.contract.tasks import EMBED, SCORE, is_pooling
from qeff_vision.errors import UserError

EMBED_INSTRUCTION = "Represent the user's input."
RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
#: Agreement ``--compare-hf`` accepts at fp32: cosine of embeddings, absolute difference of scores.
EMBED_MIN_COSINE = 0.9999
SCORE_MAX_DIFFERENCE = 1e-4
#: At device precision (fp16 with the plan's nodes in fp32): fp16 keeps about three significant
#: digits of each activation, so a score (in 0..1) agrees to ~1e-3 and an embedding's cosine to
#: well above 0.999; these bounds leave a decade of margin on the score.
DEVICE_EMBED_MIN_COSINE = 0.999
DEVICE_SCORE_MAX_DIFFERENCE = 1e-2


@dataclass(frozen=True)
class PoolInput:
    """One text with its images (a document, or the embed input)."""

    text: str
    images: tuple[Path, ...] = ()


@dataclass
class Pooled:
    """What one input pooled to.

    Attributes:
        value: ``embed``: the unit embedding (a Matryoshka prefix, renormalized, with dimensions);
            ``score``: [score].
        tokens: Prompt tokens (the bucket holds them all).
        seconds: Wall time of the vision and language calls.
        reference: transformers' value on the same inputs (``compare_hf``), else None.
        notes: Resized images and the like.
        device: The programs ran at device precision (``agreement`` takes the device bounds).
    """

    value: np.ndarray
    tokens: int
    seconds: float
    reference: np.ndarray | None = None
    notes: tuple[str, ...] = ()
    device: bool = False

    def agreement(self, task: str) -> tuple[float, bool] | None:
        """(cosine or |difference|, within tolerance) against the reference; None without one.

        The fp32 bounds, or the device ones when the programs ran at device precision.
        """
        if self.reference is None:
            return None
        if task == EMBED:
            cosine = float(
                np.dot(self.value, self.reference)
                / (np.linalg.norm(self.value) * np.linalg.norm(self.reference))
            )
            return cosine, cosine >= (DEVICE_EMBED_MIN_COSINE if self.device else EMBED_MIN_COSINE)
        difference = float(abs(self.value[0] - self.reference[0]))
        return difference, difference <= (
            DEVICE_SCORE_MAX_DIFFERENCE if self.device else SCORE_MAX_DIFFERENCE
        )


def _content(images: int, text: str) -> list[dict]:
    return [{"type": "image"}] * images + ([{"type": "text", "text": text}] if text else [])


def embed_messages(item: PoolInput, instruction: str | None) -> list[dict]:
    """Chat messages of one embedding input."""
    system = [{"type": "text", "text": instruction or EMBED_INSTRUCTION}]
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": _content(len(item.images), item.text)},
    ]


def score_messages(query: PoolInput, document: PoolInput, instruction: str | None) -> list[dict]:
    """Chat messages of one (query, document) pair for the reranker."""
    content = [{"type": "text", "text": f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: "}]
    content += _content(len(query.images), query.text)
    content += [{"type": "text", "text": "\n<Document>: "}, *_content(len(document.images), document.text)]
    system = [{"type": "text", "text": RERANK_SYSTEM}]
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def pool_inputs(
    artifacts_dir: str | Path,
    items: Sequence[PoolInput],
    task: str,
    *,
    query: PoolInput | None = None,
    instruction: str | None = None,
    dimensions: int | None = None,
    precision: str | None = None,
    compare_hf: bool = False,
    on_result: Callable[[int, Pooled], None] | None = None,
) -> list[Pooled]:
    """Pool each of ``items`` on the compiled programs (``score``: each against ``query``).

    Raises:
        UserError: The artifacts are not of ``task``, a prompt is longer than the largest bucket,
            an image cannot be read, or ``dimensions`` is out of range.
    """
    from qeff_vision.checkpoint import Checkpoint
    from qeff_vision.media import load_image
    from qeff_vision.runtime.artifacts import image_fitter, load_artifacts, open_programs
    from qeff_vision.runtime.pooling import Pooler, matryoshka, reference_pool

    artifacts = load_artifacts(artifacts_dir)
    built = artifacts.export_record.get("task", "generate")
    if built != task:
        wanted = (
            "--embed" if built == EMBED else "--score QUERY" if built == SCORE else "--prompt (generation)"
        )
        raise UserError(
            f"{artifacts.out_dir}: the programs were built for task {built}; run them with {wanted}"
        )
    if task == SCORE and query is None:
        raise UserError("--score needs the query text")
    assert is_pooling(task)
    vision, language = open_programs(artifacts, precision)
    at_device = artifacts.program_backend.at_device_precision(precision)
    checkpoint = artifacts.checkpoint()
    pooler = Pooler(checkpoint, vision, language, task)
    processor = checkpoint.processor
    fit = image_fitter(artifacts)
    reference_model = None
    if compare_hf:
        if not isinstance(artifacts.checkpoint_dir, Path):
            raise UserError(
                f"{artifacts.out_dir}: --compare-hf needs the checkpoint's weights on this machine"
            )
        reference_model = Checkpoint.open(artifacts.checkpoint_dir, artifacts.family).reference_model()
    score_ids = artifacts.export_record.get("score_token_ids") or ()
    if dimensions is not None:  # checked before any call (the message names the embedding's size)
        matryoshka(np.ones(checkpoint.dims.hidden_size, np.float32), dimensions)

    def pictures(paths: Sequence[Path], notes: list[str]) -> list:
        shown = []
        for path in paths:
            image, note = fit(load_image(path))
            if note:
                notes.append(f"{path}: {note}")
            shown.append(image)
        return shown

    query_notes: list[str] = []
    query_pictures = pictures(query.images, query_notes) if query is not None else []
    results = []
    for index, item in enumerate(items):
        notes = list(query_notes)
        shown = pictures(item.images, notes)
        if task == EMBED:
            messages, images = embed_messages(item, instruction), shown
        else:
            messages, images = score_messages(query, item, instruction), [*query_pictures, *shown]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        processed = processor(text=[text], images=images or None, return_tensors="np")
        inputs = {name: np.asarray(value) for name, value in processed.items()}
        start = time.perf_counter()
        value = pooler.pool(inputs)
        seconds = time.perf_counter() - start
        reference = None
        if reference_model is not None:
            reference = reference_pool(reference_model, inputs, task, score_ids)
        if task == EMBED:
            value = matryoshka(value, dimensions)
            reference = matryoshka(reference, dimensions) if reference is not None else None
        tokens = int(inputs["input_ids"].shape[-1])
        pooled = Pooled(value, tokens, seconds, reference, tuple(notes), device=at_device)
        results.append(pooled)
        if on_result is not None:
            on_result(index, pooled)
    return results
