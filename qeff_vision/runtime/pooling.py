"""Run a pooling program (spec ``task: embed | score``): one language call per whole prompt.

The host encodes the prompt's images with the vision program (once each), concatenates their rows
in prompt order, and feeds the language program the whole prompt in the smallest compiled bucket
that holds it: token ids padded with a non-placeholder id at position -1, every row the prompt
needs of ``vision_embeds`` (and stacked rows) zero-padded to the bucket's ``vision_size``, image
cursor 0. A prompt longer than the largest bucket is refused: a pooling program keeps no cache to
carry a prompt over several calls (:mod:`qeff_vision.contract.tasks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import Role
from qeff_vision.contract.tasks import EMBED, is_pooling, pooled_io, pooled_output_name
from qeff_vision.errors import UserError


def matryoshka(embedding: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first ``dimensions`` values of a unit ``embedding``, renormalized (all when None).

    Raises:
        UserError: ``dimensions`` is not in 1..len(embedding).
    """
    if dimensions is None:
        return embedding
    size = embedding.shape[-1]
    if not 1 <= dimensions <= size:
        raise UserError(f"--dimensions must be in 1..{size} (the embedding's size), not {dimensions}")
    head = embedding[..., :dimensions].astype(np.float64)
    return (head / np.linalg.norm(head, axis=-1, keepdims=True)).astype(np.float32)


class Pooler:
    """Pools prompts on a vision program and a pooling language program.

    Args:
        checkpoint: The :class:`~qeff_vision.checkpoint.Checkpoint` the programs were exported from.
        vision: The vision program (``run(feeds) -> outputs``).
        language: The pooling language program; its ``specializations`` (None: any shape) are the
            buckets.
        task: ``embed`` or ``score``.
    """

    def __init__(self, checkpoint: Any, vision: Any, language: Any, task: str):
        if not is_pooling(task):
            raise UserError(f"these programs were built for task {task!r}, not a pooling task (embed, score)")
        self.checkpoint, self.vision, self.language, self.task = checkpoint, vision, language, task
        self.output = pooled_output_name(task)
        family = checkpoint.family
        self.io = pooled_io(family.language_io(checkpoint.dims.num_layers), task)

    def buckets(self) -> list[tuple[int, int]] | None:
        """(seq_len, vision_size) of every compiled bucket, ascending; None when any shape runs."""
        specs = self.language.specializations
        if specs is None:
            return None
        return sorted((int(s[symbols.SEQ_LEN]), int(s.get(symbols.VISION_SIZE, 0))) for s in specs)

    def _rows(self, processed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every vision output of the prompt's images, concatenated on the row axis in prompt order."""
        host = self.checkpoint.host
        if not host.has_images(processed):
            return {}
        pieces: dict[str, list[np.ndarray]] = {}
        for inputs in host.vision_inputs(processed):
            outputs = self.vision.run(inputs)
            own = host.own_rows(inputs)
            for name, value in outputs.items():
                value = np.asarray(value)
                rows = value[..., :own, :] if own is not None else value
                # [.., batch 1, rows, hidden] -> [.., rows, hidden]: the rows of one image.
                pieces.setdefault(name, []).append(rows.reshape(*rows.shape[:-3], -1, rows.shape[-1]))
        return {name: np.concatenate(parts, axis=-2) for name, parts in pieces.items()}

    def feeds(self, processed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The language program's inputs for one whole prompt (see the module docstring)."""
        host = self.checkpoint.host
        ids = np.asarray(processed["input_ids"], dtype=np.int64).reshape(1, -1)
        length = ids.shape[1]
        positions = np.asarray(host.prompt_positions(processed), dtype=np.int64)
        rows = self._rows(processed)
        needed = max((value.shape[-2] for value in rows.values()), default=0)
        buckets = self.buckets()
        if buckets is None:
            seq_len, vision_size = length, max(needed, 1)
        else:
            fitting = [(s, v) for s, v in buckets if s >= length and v >= needed]
            if not fitting:
                longest = buckets[-1][0]
                raise UserError(
                    f"the prompt has {length} tokens and {needed} image rows; the largest bucket takes "
                    f"{longest} tokens and {buckets[-1][1]} rows (a pooling program runs a prompt in one "
                    "call: compile a longer prefill bucket)"
                )
            seq_len, vision_size = fitting[0]
        pad = seq_len - length
        padded_ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=self._pad_id())
        padded_positions = np.pad(positions, [(0, 0)] * (positions.ndim - 1) + [(0, pad)], constant_values=-1)
        dtypes = getattr(self.language, "input_dtypes", {})
        hidden = self.checkpoint.dims.hidden_size
        vision = {}
        for row in self.io.rows(Role.VISION_ROWS):  # vision_embeds, then stacked rows (deepstack)
            value = rows.get(row.name)
            if value is None:  # a prompt without images: no rows, all padding
                value = np.zeros((*self._stack(row.shape), 0, hidden), np.float32)
            block = np.zeros((*value.shape[:-2], 1, vision_size, value.shape[-1]), dtype=value.dtype)
            block[..., 0, : value.shape[-2], :] = value
            vision[row.name] = block.astype(dtypes.get(row.name, np.float32))
        return self.io.feeds(
            {
                Role.TOKEN_IDS: padded_ids,
                Role.POSITIONS: padded_positions,
                Role.VISION_ROWS: vision,
                Role.VISION_CURSOR: np.zeros((1, 1), dtype=np.int64),
            }
        )

    def _stack(self, shape: Sequence) -> tuple[int, ...]:
        """Leading stack axes of a vision-row input (a stacked row's depth), for a prompt without images."""
        if len(shape) <= 3:
            return ()
        symbols_of = self.checkpoint.family.language_symbols(self.checkpoint.description)
        return (shape[0] if isinstance(shape[0], int) else symbols_of[shape[0]],)

    def _pad_id(self) -> int:
        tokenizer = self.checkpoint.tokenizer
        pad = tokenizer.pad_token_id
        return int(pad if pad is not None else tokenizer.eos_token_id)

    def pool(self, processed: Mapping[str, Any]) -> np.ndarray:
        """``embed``: the unit embedding [hidden]; ``score``: the score [1]."""
        outputs = self.language.run(self.feeds(processed))
        return np.asarray(outputs[self.output], dtype=np.float32)[0]


def reference_pool(
    model: Any, processed: Mapping[str, Any], task: str, score_ids: Sequence[int] = ()
) -> np.ndarray:
    """The transformers pooled output on the same processed inputs (the parity reference).

    ``embed``: the last token's final hidden state, L2-normalized; ``score``:
    ``sigmoid(logit(yes) - logit(no))`` at the last position (ids ``score_ids``).
    """
    import torch

    inputs = {k: torch.as_tensor(v) for k, v in processed.items()}
    with torch.no_grad():
        if task == EMBED:  # the text model's output after its final norm
            last = model.model(**inputs).last_hidden_state[0, -1].double()
            return (last / last.norm()).float().numpy()
        logits = model(**inputs).logits[0, -1].double()
    yes, no = score_ids
    return torch.sigmoid(logits[yes] - logits[no]).reshape(1).float().numpy()
