"""The on-device sampler's IO (QEfficient's ``include_sampler``), added to any language table.

With the sampler the language program returns the next token instead of the logits: the host feeds
each row's sampling parameters and random numbers, and two per-slot penalty buffers stay on the
device as retained state. Names, dtypes, shapes and order are QEfficient's (pinned
quic/efficient-transformers ebf55e8, ``QEfficient/utils/sampler_utils.py``
``get_sampling_inputs_and_outputs`` and ``modeling_auto.py``, dual-QPC export): the sampler's
inputs follow every other input; ``next_tokens`` takes the place of ``logits`` (``probs`` just
before it with ``return_pdfs``, QEfficient's causal-LM order); the two buffers' retained states
come last. Torch-free: the export wraps whatever decoder a family has (:mod:`qeff_vision.export.sampler`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from qeff_vision import symbols
from qeff_vision.contract.language_io import VOCAB_SIZE, DType, Fixed, IORow, LanguageIO, Role

#: QEfficient's default (``Constants.MAX_TOP_K_IDS``): the top-k the sampler keeps at most.
DEFAULT_MAX_TOP_K_IDS = 512
MAX_TOP_K_IDS = Fixed("max_top_k_ids")

LAST_ACCEPTED_OUTPUT_TOKENS = "last_accepted_output_tokens"
REPETITION_BUFFER = "past_repetition_penalty_buffer"
PRESENCE_BUFFER = "past_presence_penalty_buffer"
REPETITION_PENALTIES = "repetition_penalties"
PRESENCE_PENALTIES = "presence_penalties"
TEMPERATURES = "temperatures"
TOP_KS = "top_ks"
TOP_PS = "top_ps"
MIN_PS = "min_ps"
RANDOM_NUMBERS = "random_numbers"
TOKEN_BITMASKS = "token_bitmasks"
NEXT_TOKENS = "next_tokens"
PROBS = "probs"
#: The per-slot retained rows (what a call must leave alone on slots it does not name).
PENALTY_BUFFERS = (REPETITION_BUFFER, PRESENCE_BUFFER)


@dataclass(frozen=True)
class SamplerOptions:
    """Spec ``compile.language.sampler`` (QEfficient's ``qaic_config`` keys in brackets).

    Attributes:
        max_top_k_ids: Candidates kept by the sampler's top-k (``max_top_k_ids``): a request's
            ``top_k`` is clipped to it, and ``top_k`` 0 (all tokens) means these many.
        return_pdfs: Also return the probabilities over the vocabulary (``return_pdfs``).
        guided_decoding: Take ``token_bitmasks`` (``include_guided_decoding``).
    """

    max_top_k_ids: int = DEFAULT_MAX_TOP_K_IDS
    return_pdfs: bool = False
    guided_decoding: bool = False

    def to_dict(self) -> dict:
        """Plain dictionary (export.json, manifests)."""
        return {
            "max_top_k_ids": self.max_top_k_ids,
            "return_pdfs": self.return_pdfs,
            "guided_decoding": self.guided_decoding,
        }


def _zeros_bool(shape, values, image_token_id) -> np.ndarray:
    return np.zeros(shape, dtype=bool)


def _filled(value: float):
    def example(shape, values, image_token_id) -> np.ndarray:
        return np.full(shape, value, dtype=np.float32)

    return example


def _top_ks(shape, values, image_token_id) -> np.ndarray:
    # Below max_top_k_ids, so the trace keeps the clipping and masking of a real top-k.
    return np.full(shape, max(1, int(values[MAX_TOP_K_IDS]) // 2), dtype=np.int32)


def _uniform(shape, values, image_token_id) -> np.ndarray:
    return np.random.default_rng(0).uniform(0.05, 0.95, shape).astype(np.float32)


def with_sampler(io: LanguageIO, options: SamplerOptions) -> LanguageIO:
    """``io`` with the sampler's rows (see the module docstring for names and order).

    The penalty buffers have the caches' slot axis (``full_batch_size`` with continuous batching);
    every other sampler row is per call row (``batch_size``). Example values are QEfficient's
    (``ONNX_EXPORT_EXAMPLE_*``: penalties 0.5, temperature 0.8, top-p 0.8, min-p 0.99).
    """
    batch, seq = symbols.BATCH_SIZE, symbols.SEQ_LEN
    slots = symbols.FULL_BATCH_SIZE if io.has(Role.KV_SLOT) else batch
    buffer = (slots, VOCAB_SIZE)

    def parameter(name: str, value: float) -> IORow:
        return IORow(name, Role.SAMPLING_PARAMETER, DType.FLOAT32, (batch, 1), example=_filled(value))

    def penalty_buffer(name: str) -> IORow:
        retained = symbols.retained(name)
        return IORow(name, Role.PENALTY_BUFFER, DType.BOOL, buffer, retained, example=_zeros_bool)

    inputs = [
        IORow(LAST_ACCEPTED_OUTPUT_TOKENS, Role.ACCEPTED_TOKENS, DType.INT64, (batch, seq)),
        penalty_buffer(REPETITION_BUFFER),
        parameter(REPETITION_PENALTIES, 0.5),
        penalty_buffer(PRESENCE_BUFFER),
        parameter(PRESENCE_PENALTIES, 0.5),
        parameter(TEMPERATURES, 0.8),
        IORow(TOP_KS, Role.SAMPLING_PARAMETER, DType.INT32, (batch, 1), example=_top_ks),
        parameter(TOP_PS, 0.8),
        parameter(MIN_PS, 0.99),
        IORow(RANDOM_NUMBERS, Role.RANDOM_NUMBERS, DType.FLOAT32, (batch, MAX_TOP_K_IDS), example=_uniform),
    ]
    if options.guided_decoding:
        inputs.append(
            IORow(TOKEN_BITMASKS, Role.TOKEN_BITMASK, DType.BOOL, (batch, VOCAB_SIZE), example=_zeros_bool)
        )
    sampled = [IORow(NEXT_TOKENS, Role.NEXT_TOKENS, DType.INT64, (batch, 1, 1))]
    if options.return_pdfs:
        sampled.insert(0, IORow(PROBS, Role.PROBABILITIES, DType.FLOAT32, (batch, 1, VOCAB_SIZE)))
    outputs = []
    for row in io.outputs:
        outputs += sampled if row.role is Role.LOGITS else [row]
    outputs += [
        IORow(row.retained, row.role, row.dtype, row.shape, row.name) for row in inputs if row.retained
    ]
    return replace(io, inputs=(*io.inputs, *inputs), outputs=tuple(outputs))


def sampler_dims(options: SamplerOptions) -> dict[str, int]:
    """Values of the sampler's fixed dimensions (to join a table's model dimensions)."""
    return {MAX_TOP_K_IDS: options.max_top_k_ids}


def sampler_of(io: LanguageIO) -> bool:
    """Whether ``io`` is a table with the sampler (it returns ``next_tokens``, not logits)."""
    return any(row.role is Role.NEXT_TOKENS for row in io.outputs)
