"""The on-device sampler wrapped around any family's language decoder (QEfficient's ``include_sampler``).

:class:`SamplerDecoder` calls the family's decoder with its own inputs, takes the ``logits`` it
returns and puts the sampled token in their place (:mod:`qeff_vision.contract.sampler_io` for the
IO). The math is QEfficient's ``sampler_forward`` (pinned quic/efficient-transformers ebf55e8,
``QEfficient/transformers/sampler/sampler.py``), step for step and in its dtypes: logits in
float32; guided decoding masks with float16's minimum; repetition penalty
``logits *= where(seen, penalty, 1) ** -sign(logits)``; presence penalty ``logits -= penalty *
seen_in_output``; greedy is the first argmax; otherwise divide by the temperature, top-k over
``max_top_k_ids`` (TopK: ties to the lower token id), flipped ascending, the ``max_top_k_ids -
top_k`` smallest masked, softmax, top-p drops the ascending prefix whose cumulative probability is
at most ``1 - top_p`` (never the largest), min-p drops probabilities under ``min_p`` x the largest,
and the token is the Gumbel-max ``argmax(values - log(-log(random_numbers)))`` over the kept ones.
Every branch QEfficient takes on a data-dependent condition is traced taken (its example inputs
take them all), so the graph computes every step; a step whose parameter is neutral (penalty 1,
min-p 0) changes nothing.

Penalty buffers (bool [slots, vocab], retained on the device): a prefill chunk (seq_len > 1)
clears its slot's presence buffer (a prompt has no output yet), starts its repetition buffer
afresh when its first position is 0 (a new request in the slot; a chunk continuing a kept prefix
adds to it), then marks its valid tokens there; a decode step marks
``last_accepted_output_tokens`` (the token it is fed, i.e. the one generated last) in both.
Two departures from QEfficient, both for the IO contract:

* QEfficient masks padding with an out-of-range ``INT32_MAX`` token that the device's
  ``CtxScatterCB3D`` skips and onnxruntime rejects; here each row's marks are gathered into a
  [rows, vocab] bool with in-range indices only (a padded token re-marks its row's first token,
  which is valid whenever the row has a valid token), and rows reach their slots through a
  one-hot [rows, slots] product, so an idle row (``batch_index`` -1) changes no slot.
* QEfficient's prefill clears the presence buffer of *every* slot on every chunk, erasing what
  the other running requests generated; here only the slots the chunk's rows prefill are cleared
  (for the request being prefilled the result is QEfficient's).
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision.contract.language_io import LanguageIO, Role
from qeff_vision.contract.sampler_io import SamplerOptions

# QEfficient masks with float16's minimum (it survives -convert-to-fp16).
MASKED = float(torch.finfo(torch.float16).min)


def _marks(tokens: torch.Tensor, valid: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] True at every valid token of each row; in-range indices only, no write races.

    An id past ``vocab`` (an input-only vocabulary of image placeholders, Molmo2's) is never a
    logit: it marks nothing. Every other index re-marks the row's first valid token.
    """
    valid = valid & (tokens >= 0) & (tokens < vocab)
    row_valid = valid.any(dim=1, keepdim=True)
    first_valid = torch.gather(tokens, 1, torch.argmax(valid.to(torch.int32), dim=1, keepdim=True))
    first = torch.where(row_valid, first_valid, torch.zeros_like(first_valid))
    index = torch.where(valid, tokens, first.expand_as(tokens))
    return torch.zeros(tokens.shape[0], vocab, dtype=torch.bool).scatter(
        1, index, row_valid.expand_as(tokens)
    )


def _to_slots(rows: torch.Tensor, one_hot: torch.Tensor) -> torch.Tensor:
    """Per-row bools [rows, vocab] OR-ed into their slots by ``one_hot`` [rows, slots]: [slots, vocab]."""
    return torch.matmul(one_hot.transpose(0, 1).to(torch.float32), rows.to(torch.float32)) > 0


def update_buffers(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    accepted: torch.Tensor,
    slot: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The penalty buffers after this call (see the module docstring for the lifecycle).

    Args:
        input_ids: [rows, seq] the call's tokens.
        positions: [rows, seq] their text positions (-1: padding).
        accepted: [rows, seq] ``last_accepted_output_tokens`` (a decode step's fed token).
        slot: [rows, 1] each row's slot (``batch_index``, or its row number).
        repetition: [slots, vocab] bool.
        presence: [slots, vocab] bool.
    """
    slots, vocab = repetition.shape
    valid = positions >= 0
    row_valid = valid.any(dim=1, keepdim=True)
    one_hot = (slot.view(-1, 1) == torch.arange(slots).view(1, -1)) & row_valid  # [rows, slots]
    seq_len = torch.ones_like(input_ids).sum(dim=1, keepdim=True)[:1]  # a tensor, so tracing keeps it
    prefill = seq_len > 1  # QEfficient: input_ids.shape[1] > logits' spec length (1)
    starts = one_hot & (positions[:, :1] == 0)  # a prompt's first chunk starts its slot afresh
    fresh = (starts.to(torch.float32).sum(dim=0) > 0).view(-1, 1)  # [slots, 1]
    touched = (one_hot.to(torch.float32).sum(dim=0) > 0).view(-1, 1)  # [slots, 1]: a row writes it
    prompt_marks = _to_slots(_marks(input_ids, valid, vocab), one_hot)
    output_marks = _to_slots(_marks(accepted, valid, vocab), one_hot)
    repetition_prefill = (repetition & ~fresh) | prompt_marks
    presence_prefill = presence & ~touched  # a prompt has no output yet
    # Boolean algebra, not Where: onnxruntime's CPU Where has no bool kernel.
    repetition = (prefill & repetition_prefill) | (~prefill & (repetition | output_marks))
    presence = (prefill & presence_prefill) | (~prefill & (presence | output_marks))
    return repetition, presence


def sample(
    logits: torch.Tensor,
    repetition_seen: torch.Tensor,
    presence_seen: torch.Tensor,
    params: dict[str, torch.Tensor],
    random_numbers: torch.Tensor,
    options: SamplerOptions,
    token_bitmasks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(next tokens [rows, 1] int64, probabilities [rows, vocab] or None) from logits [rows, vocab].

    ``params``: ``repetition_penalties``, ``presence_penalties``, ``temperatures``, ``top_ps``,
    ``min_ps`` (float32 [rows, 1]) and ``top_ks`` (int32 [rows, 1]); the seen buffers are each
    row's slot's [rows, vocab].
    """
    logits = logits.to(torch.float32)
    if token_bitmasks is not None:
        logits = torch.where(token_bitmasks, logits, MASKED)
    penalty = torch.where(repetition_seen, params["repetition_penalties"], 1.0)
    logits = logits * penalty ** (-torch.sign(logits))
    logits = logits - params["presence_penalties"] * presence_seen.to(torch.float32)
    greedy = torch.argmax(logits, dim=1, keepdim=True)
    temperatures = params["temperatures"]
    logits = torch.where(temperatures != 0, logits / temperatures, logits)
    k = options.max_top_k_ids
    values, indices = torch.topk(logits, k=k, dim=1)
    values, indices = values.flip(dims=[1]), indices.flip(dims=[1])  # ascending
    top_ks = torch.clamp(params["top_ks"].to(torch.int64), max=k)
    values = torch.where(torch.arange(k).view(1, -1) < k - top_ks, MASKED, values)
    probs = torch.softmax(values, dim=1)
    top_p_mask = torch.cumsum(probs, dim=1) <= 1 - params["top_ps"]
    top_p_mask = top_p_mask & (torch.arange(k).view(1, -1) < k - 1)  # the largest always stays
    values = torch.where(top_p_mask, MASKED, values)
    min_p_mask = probs < params["min_ps"] * probs[:, k - 1 :]
    values = torch.where(min_p_mask, MASKED, values)
    full = None
    if options.return_pdfs:
        spread = torch.full_like(logits, MASKED).scatter(1, indices, values)
        full = torch.softmax(spread, dim=1)
    gumbel = -torch.log(-torch.log(random_numbers))
    drawn = torch.gather(indices, 1, torch.argmax(values + gumbel, dim=1, keepdim=True))
    return torch.where(temperatures == 0, greedy, drawn), full


class SamplerDecoder(nn.Module):
    """A family's language decoder whose logits become the sampled next token.

    Args:
        decoder: The family's decoder; its positional inputs and outputs are ``inner``'s rows.
        inner: The family's table (without the sampler).
        io: ``inner`` with the sampler's rows (:func:`~qeff_vision.contract.sampler_io.with_sampler`).
        options: The sampler's options.
    """

    def __init__(self, decoder: nn.Module, inner: LanguageIO, io: LanguageIO, options: SamplerOptions):
        super().__init__()
        self.decoder, self.inner, self.io, self.options = decoder, inner, io, options

    def forward(self, *inputs):
        """Run the decoder, then the sampler; returns ``io``'s outputs in order."""
        io, inner = self.io, self.inner
        named = dict(zip(io.input_names, inputs, strict=True))
        produced = dict(
            zip(inner.output_names, self.decoder(*(named[n] for n in inner.input_names)), strict=True)
        )
        logits = produced.pop(inner.name(Role.LOGITS, output=True))
        input_ids = named[io.name(Role.TOKEN_IDS)]
        positions = named[io.name(Role.POSITIONS)]
        positions = positions if positions.dim() == 2 else positions[0]  # M-RoPE: row 0 is the text position
        repetition_row, presence_row = io.rows(Role.PENALTY_BUFFER)
        slots = named[repetition_row.name].shape[0]
        rows = torch.arange(input_ids.shape[0]).view(-1, 1)
        slot = named[io.name(Role.KV_SLOT)] if io.has(Role.KV_SLOT) else rows
        slot = torch.remainder(slot, slots)  # an idle row's -1: in range, and its marks go nowhere
        repetition, presence = update_buffers(
            input_ids,
            positions,
            named[io.name(Role.ACCEPTED_TOKENS)],
            slot,
            named[repetition_row.name],
            named[presence_row.name],
        )
        params = {row.name: named[row.name] for row in io.rows(Role.SAMPLING_PARAMETER)}
        bitmask = named[io.name(Role.TOKEN_BITMASK)] if io.has(Role.TOKEN_BITMASK) else None
        flat = logits.reshape(-1, logits.shape[-1])  # [rows * 1, vocab]
        tokens, probs = sample(
            flat,
            repetition[slot.view(-1)],
            presence[slot.view(-1)],
            params,
            named[io.name(Role.RANDOM_NUMBERS)],
            self.options,
            bitmask,
        )
        produced[io.name(Role.NEXT_TOKENS, output=True)] = tokens.reshape(-1, 1, 1)
        if probs is not None:
            produced[io.name(Role.PROBABILITIES, output=True)] = probs.reshape(logits.shape)
        produced[io.output_of(repetition_row)] = repetition
        produced[io.output_of(presence_row)] = presence
        return tuple(produced[name] for name in io.output_names)
