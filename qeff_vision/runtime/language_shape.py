"""The compiled shapes of a language program, read from its specializations.

Prefill buckets (``seq_len``, ``vision_size``), the decode calls' ``vision_size``, the one
``ctx_len``, and the compute-context lengths (CCLs) of each phase when the program was compiled
with them. Pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.runtime.planner import PrefillBucket


@dataclass(frozen=True)
class LanguageShape:
    """Compiled language-program shapes: prefill buckets, decode vision size and context length."""

    buckets: tuple[PrefillBucket, ...]
    decode_vision_size: int
    ctx_len: int
    prefill_ccls: tuple[int, ...] = ()
    decode_ccls: tuple[int, ...] = ()

    @classmethod
    def from_specializations(cls, specializations: Sequence[Mapping[str, object]]) -> LanguageShape:
        """Read buckets (and compute-context lengths) from language specializations (seq_len 1 is decode)."""
        prefill, decode = [], []
        ccls: dict[bool, set[int]] = {True: set(), False: set()}
        for spec in specializations:
            # A cross-attention program has no vision_size (images are retained K/V): V = 0.
            seq_len, vision = int(spec[symbols.SEQ_LEN]), int(spec.get(symbols.VISION_SIZE, 0))
            bucket = PrefillBucket(seq_len, vision)
            phase = decode if seq_len == 1 else prefill
            if bucket not in phase:  # one per bucket, whatever the CCLs
                phase.append(bucket)
            if symbols.COMP_CTX_LENGTHS in spec:
                ccls[seq_len == 1].add(int(spec[symbols.COMP_CTX_LENGTHS]))
        ctx_lens = {int(spec[symbols.CTX_LEN]) for spec in specializations if symbols.CTX_LEN in spec}
        if not ctx_lens and prefill and not decode:  # a pooling program (no cache): its longest prompt
            ctx_lens = {max(bucket.seq_len for bucket in prefill)}
        if not prefill or len(ctx_lens) != 1:
            raise UserError("language specializations need prefill buckets and exactly one ctx_len")
        decode_vision = max(b.vision_size for b in decode) if decode else max(b.vision_size for b in prefill)
        return cls(
            tuple(prefill),
            decode_vision,
            ctx_lens.pop(),
            tuple(sorted(ccls[False])),
            tuple(sorted(ccls[True])),
        )

    @property
    def prefill_limit(self) -> int:
        """Prompt tokens prefill can reach: the last prefill CCL when compiled with CCLs, else ``ctx_len``."""
        return self.prefill_ccls[-1] if self.prefill_ccls else self.ctx_len

    def comp_ctx_length(self, decode: bool, furthest_position: int) -> int | None:
        """The smallest compiled CCL whose slots hold ``furthest_position``; None without CCLs.

        Raises:
            UserError: No CCL of the phase covers the position.
        """
        ccls = self.decode_ccls if decode else self.prefill_ccls
        if not ccls:
            return None
        for ccl in ccls:
            if ccl > furthest_position:
                return ccl
        phase = "decode" if decode else "prefill"
        raise UserError(f"position {furthest_position} is past every {phase} comp_ctx_length {list(ccls)}")
