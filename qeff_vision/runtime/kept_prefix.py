"""A conversation turn prefills only what follows the prefix the program holds.

A :class:`~qeff_vision.runtime.generator.Generator` asked to keep the prefix
(``generate(..., keep_prefix=True)``, what a :class:`~qeff_vision.runtime.conversation.Conversation`
asks, and what a single program's :class:`~qeff_vision.runtime.single.SingleGenerator` always
does) records what its language program holds after each generation: the prompt's tokens and
the fed part of the reply, the images among them by content key, and the caches (host-held on
onnxruntime). The next prompt, the whole conversation rendered again, keeps the longest prefix
the rules of :mod:`qeff_vision.runtime.retained_prefix` allow (the same rules a single program
follows: tokens equal, the same images, never cut inside an image, one token left to prefill,
and caches not indexed by position, a sliding-window or chunked-attention ring or a recurrent
state, resume only where they stopped or from the copy kept at the end of the last prefill).
Only the rest is prefilled, its chunks planned from the kept prefix on; positions (M-RoPE rows
and their deltas included) are those of the whole prompt, sliced, so they continue as if the
prompt had been prefilled at once.

Cross-attention (mllama) keeps a prefix only while the prompt's images are exactly the held
ones (:func:`~qeff_vision.runtime.retained_prefix.image_set_resume`), as its single program does.

Where it applies: a language program the runtime calls directly (:class:`CompiledProgram`:
onnxruntime, or a device, which keeps the caches resident, so there a prefix is kept only when
no other call reached the program since the turn it holds; rings resume only where they
stopped, no host copy exists). A disaggregated pair (prefill and decode on two programs: the
prefill program never holds the reply) and one-shot requests (the batched engine,
``run --requests``) prefill every prompt whole, as before. A failed turn leaves nothing held:
the next one starts over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import HeldPrefix, Resume, held_after, kept_note, resume_point


class PrefixKeeping:
    """Methods of :class:`~qeff_vision.runtime.generator.Generator` that keep a held prefix (a mixin).

    They read the generator's ``language``, ``deployment`` and ``host`` and call its
    ``_generate`` (which calls :meth:`resume_prompt` with the prompt as it runs), and set ``held``
    (what the program holds after the last kept generation, or None), ``_resume`` (where the
    running prompt's prefill starts; :class:`Resume` ``()`` outside a kept generation) and
    ``_at_prompt_end`` (the caches not indexed by position at the end of the last prefill, which
    the generator's prefill records); ``_unpositioned`` names those caches
    (:func:`~qeff_vision.runtime.retained_prefix.unpositioned_caches`).
    """

    held: HeldPrefix | None = None
    _resume: Resume = Resume()
    _at_prompt_end: dict[str, np.ndarray] | None = None
    _unpositioned: Sequence[str] = ()
    _kept_turn: _KeptTurn | None = None
    #: Language-program calls when ``held`` was recorded (a device's resident caches are the
    #: held ones only if nothing ran since).
    _held_calls: int = -1

    def prefix_images(self, processed: Mapping[str, Any]) -> tuple[list[str], list[tuple[int, int]]]:
        """Content keys and ``[start, stop)`` token spans of the prompt's images, in prompt order."""
        if not self.host.has_images(processed):
            return [], []
        images = self._prepare_images(processed)[0]
        spans = [(segment.start, segment.stop) for segment in self.host.segments(processed)]
        return [image.key for image in images], spans

    def kept_resume(self, resume: Resume, held: HeldPrefix | None, keys: Sequence[str]) -> Resume:
        """``resume`` as this decoder kind may keep it (unchanged for token-merge)."""
        return resume

    def _keeps_held(self) -> bool:
        """Whether what :attr:`held` describes is still in the program's caches (the mode's answer)."""
        return self.deployment.holds_turn(self.language, self._held_calls)

    def record_prompt_end(self, past: Mapping[str, np.ndarray]) -> None:
        """Keep the caches not indexed by position as the prompt's prefill left them.

        A later turn that resumes at the prompt's end restores them (host caches only; a step
        replaces the arrays, never writes into them, so no copy is needed).
        """
        self._at_prompt_end = {name: past[name] for name in self._unpositioned if name in past} or None

    def run_generation(self, processed: Mapping[str, Any], keep_prefix: bool, *args: Any) -> GenerationResult:
        """``generate``'s dispatch: :meth:`generate_kept`, or ``_generate`` with nothing left held.

        Args:
            processed: The prompt.
            keep_prefix: Whether ``processed`` is the whole conversation to resume (see
                :meth:`generate_kept`).
            *args: ``_generate``'s (max_new_tokens, protocol, on_token, keep_logits, history).
        """
        if keep_prefix:
            return self.generate_kept(processed, *args)
        self.held = None  # the program's caches now hold this prompt, recorded by no one
        return self._generate(processed, *args)

    def generate_kept(self, processed: Mapping[str, Any], *args: Any) -> GenerationResult:
        """The generator's ``_generate(processed, *args)``, prefilling only what follows the prefix held.

        ``_generate`` calls :meth:`resume_prompt` once the prompt is as it runs (clips pruned),
        which sets where its prefill starts.

        Args:
            processed: The whole prompt (the conversation rendered again).
            *args: ``_generate``'s (max_new_tokens, protocol, on_token, keep_logits, history); with
                a ``history`` (the last) nothing is kept or recorded: it continues a cache of its own.

        Returns:
            The result, with a note on the kept tokens when a prefix was kept.
        """
        held, self.held = self.held, None  # a failed generation leaves nothing known held
        if args[-1] is not None:
            return self._generate(processed, *args)
        turn = self._kept_turn = _KeptTurn(held if held is not None and self._keeps_held() else None)
        self._at_prompt_end = None
        try:
            result = self._generate(processed, *args)
        finally:
            self._kept_turn, resume, self._resume = None, self._resume, Resume()
        past = result.continuation.past if result.continuation is not None else {}
        self.held = held_after(turn.input_ids, result.tokens, turn.keys, past, self._at_prompt_end)
        self._held_calls = self.language.calls
        if not resume.start:
            return result
        return replace(result, notes=[*result.notes, kept_note(resume.start, len(turn.input_ids))])

    def resume_prompt(self, processed: Mapping[str, Any], input_ids: np.ndarray) -> None:
        """Set :attr:`_resume` for the running prompt, as it runs, in a kept generation (else nothing)."""
        turn = self._kept_turn
        if turn is None:
            return
        turn.input_ids = input_ids
        turn.keys, spans = self.prefix_images(processed)
        if turn.held is not None:
            found = resume_point(turn.held, input_ids, spans, turn.keys, self._unpositioned)
            self._resume = self.kept_resume(found, turn.held, turn.keys)


@dataclass
class _KeptTurn:
    """A kept generation under way: what the program held before it, and its prompt once known."""

    held: HeldPrefix | None
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    keys: list[str] = field(default_factory=list)
