"""What a request asks of token choice: vLLM's ``SamplingParams`` names and bounds, greedy by default.

The parameters a user gives (``run --temperature ...``, a request file's keys, Python callers) are
input, checked once here; how a token is then chosen from logits is the runtime's
(:mod:`qeff_vision.runtime.sampling`, :mod:`qeff_vision.runtime.device_sampler`). vLLM keeps the
same split (``vllm/sampling_params.py`` against ``vllm/v1/sample/``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from qeff_vision.errors import UserError

#: Below this a temperature means greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens (vLLM's names and meanings; greedy by default).

    Attributes:
        temperature: 0 (default) is greedy; above, logits are divided by it before sampling.
        top_k: Keep the k most likely tokens; 0 keeps all (vLLM also takes -1 for all).
        top_p: Keep the smallest set of most likely tokens whose probability reaches it (1: all).
        min_p: Drop tokens whose probability is below ``min_p`` x the most likely one's (0: none).
        repetition_penalty: Above 1 discourages tokens already in the prompt or the output
            (a positive logit is divided by it, a negative one multiplied).
        presence_penalty: Subtracted from the logit of every token already generated.
        seed: Seeds the request's own random generator (None: fresh entropy each run).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise UserError(problems[0])

    def problems(self) -> list[str]:
        """Every out-of-range value, one sentence each (vLLM's bounds)."""
        found = []
        if not self.temperature >= 0:
            found.append(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            found.append(f"top_k must be an integer >= -1 (0 or -1: all tokens), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            found.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            found.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            found.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            found.append(f"seed must be an integer, got {self.seed!r}")
        return found

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax (temperature 0, or only the top token kept)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The parameter names (keys of a request file, ``run`` options)."""
        return tuple(field.name for field in fields(cls))


GREEDY = SamplingParams()
