"""Video token pruning on the host (EVS): keep the clip rows that changed most since the previous frame.

Efficient Video Sampling (arXiv 2510.14624), as vLLM implements it for Qwen2.5-VL / Qwen3-VL
(ref: vLLM v0.33.0 ``vllm/multimodal/video_prune/evs.py`` and ``_postprocess_video_embeds_evs`` in
``vllm/model_executor/models/qwen2_5_vl.py`` / ``qwen3_vl.py``): the first temporal patch of a
clip is kept whole; every later row is scored by ``1 - cosine similarity`` with the row at the
same place one temporal patch earlier, and the highest scores are kept, ties in row order, up to
:func:`~qeff_vision.contract.video_pruning.kept_rows` rows in all.

A clip must be encoded before its prompt exists: which rows survive decides which placeholder
tokens the prompt keeps and their M-RoPE positions. :func:`prune_prompt` therefore encodes a
prompt's clips up front (through the embedding cache, under a key that names the rate), drops the
placeholders of the pruned rows, and asks the family's host for the recomputed positions. The
result is an ordinary processed prompt with fewer placeholders, so the chunk planner, the
embedding cache and the batched engine run it unchanged; the rows the encoder hands the cache
for such a clip are its kept rows (:func:`prune_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision.contract.video_pruning import KEPT_ROWS, PRUNED_POSITIONS, RETENTION, kept_rows
from qeff_vision.runtime.embedding_cache import PreparedImage

if TYPE_CHECKING:
    from qeff_vision.runtime.generator import Generator


def retention_mask(rows: np.ndarray, grid: Sequence[int], rate: float) -> np.ndarray:
    """Which rows of a clip EVS keeps: bool [frames * height * width], row order.

    Computed with torch's own float32 cosine similarity and stable descending argsort, as vLLM's
    ``compute_retention_mask`` does: a static scene scores every later row ~0 up to rounding, and
    which of those near-ties survive depends on the reduction order, so a numpy re-implementation
    would keep different rows than vLLM on the same embeddings (measured: ~60% of 500 rows differ
    in the last bit). Scoring uses every column of a row (Qwen3-VL's deepstack columns too, as
    vLLM's tower output concatenates them in the same order).

    Args:
        rows: The clip's embedding rows [frames * height * width, width_of_a_row], prompt order.
        grid: Merged grid (frames, height, width): temporal patches and rows/columns after the
            spatial merge.
        rate: Pruning rate in [0, 1).

    Returns:
        The mask; exactly :func:`~qeff_vision.contract.video_pruning.kept_rows` entries are True.
    """
    import torch

    frames, height, width = (int(x) for x in grid)
    embeds = torch.from_numpy(np.ascontiguousarray(rows)).reshape(frames, height, width, -1)
    dissimilarity = 1 - torch.nn.functional.cosine_similarity(embeds[1:], embeds[:-1], dim=-1)
    # The first temporal patch scores above any cosine distance (<= 2): always kept.
    first = 255 * torch.ones_like(embeds[:1, :, :, 0])
    scores = torch.cat([first, dissimilarity], dim=0).reshape(-1)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[: kept_rows(frames, height * width, rate)]] = True
    return mask.numpy()


def pruned_key(key: str, rate: float) -> str:
    """Cache key of a clip's kept rows at ``rate`` (its full rows' key names another entry)."""
    return f"{key}|evs={float(rate)!r}"


def prune_rows(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The kept rows of an encoded clip, in row order."""
    if rows.shape[0] != mask.shape[0]:
        raise ValueError(f"clip of {rows.shape[0]} rows, retention mask of {mask.shape[0]}")
    return np.ascontiguousarray(rows[mask])


def prune_prompt(
    generator: Generator, processed: Mapping[str, Any], served: dict[str, str]
) -> tuple[Mapping[str, Any], tuple | None]:
    """``processed`` with its clips pruned at the generator's rate; unchanged at rate 0 or without clips.

    Returns the prompt and, when pruned, (pruned prompt, its prepared images, their inputs by
    key), so preparing the pruned prompt again does not hash the pixels again (tens of ms for a
    clip); ``served`` records the vision calls that encoded the clips.

    Encodes each clip not already in the cache (one vision call per clip), records its retention
    mask on the generator, stores its kept rows in the cache and drops the placeholders of the
    other rows from every per-token processor output (``input_ids``, ``attention_mask``, ...).
    Adds :data:`KEPT_ROWS`, :data:`PRUNED_POSITIONS` (the family host's recomputation) and
    :data:`RETENTION`.
    """
    rate = generator.video_pruning_rate
    if not rate or KEPT_ROWS in processed or not generator.host.has_images(processed):
        return processed, None
    host = generator.host
    grids = host.pruning_grids(processed)
    if not any(grid is not None for grid in grids):
        return processed, None
    # Masks of clips the cache no longer holds would be recomputed anyway: keep the table bounded.
    for stale in [key for key in generator.retention if key not in generator.cache]:
        del generator.retention[stale]
    images, inputs_by_key = generator._prepare_images(processed)
    segments = host.segments(processed)
    input_ids = np.asarray(processed["input_ids"]).reshape(-1)
    keep = np.ones(len(input_ids), dtype=bool)
    masks: list[np.ndarray | None] = []
    encode = generator._encoder(inputs_by_key, [0.0], served)
    for image, segment, grid in zip(images, segments, grids):
        if grid is None:
            masks.append(None)
            continue
        key = pruned_key(image.key, rate)
        mask = generator.retention.get(key)
        if mask is None or key not in generator.cache:
            (rows,) = encode([image])
            generator.cache.record_encoder_call(1)
            mask = retention_mask(rows, grid, rate)
            generator.retention[key] = mask
            generator.cache.put(key, prune_rows(rows, mask))
        tokens = np.concatenate([np.arange(start, start + length) for start, length in segment.token_runs])
        keep[tokens] = mask
        masks.append(mask)
    pruned = {
        name: np.asarray(value)[..., keep] if np.shape(value) == np.shape(processed["input_ids"]) else value
        for name, value in processed.items()
    }
    clips = [mask for mask in masks if mask is not None]  # prompt order = the processor's clip order
    pruned[KEPT_ROWS] = np.array([int(mask.sum()) for mask in clips], dtype=np.int64)
    pruned[PRUNED_POSITIONS] = host.pruned_positions(processed, keep, masks)
    pruned[RETENTION] = np.concatenate(clips)
    # The pruned prompt's prepared images (clips under their pruned keys).
    for number, mask in enumerate(masks):
        if mask is not None:
            key = pruned_key(images[number].key, rate)
            inputs_by_key[key] = inputs_by_key[images[number].key]
            images[number] = PreparedImage(images[number].pixels, images[number].resolution, key)
    return pruned, (pruned, images, inputs_by_key)
