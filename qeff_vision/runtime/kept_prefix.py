"""A conversation turn prefills only what follows the prefix the program holds.

A :class:`~qeff_vision.runtime.generator.Generator` asked to keep the prefix
(``generate(..., keep_prefix=True)``, what a :class:`~qeff_vision.runtime.conversation.Conversation`
asks, and what a single program's :class:`~qeff_vision.runtime.single.SingleGenerator` always
does) records what its language program holds after each generation: the prompt's tokens and
the fed part of the reply, the images among them by content key, and the caches (host-held on
onnxruntime). The next prompt, the whole conversation rendered again, keeps the longest prefix
the rules of :mod:`qeff_vision.runtime.retained_prefix` allow (a single program's rules). Only
the rest is prefilled, its chunks planned from the kept prefix on; positions (M-RoPE rows and
their deltas included) are those of the whole prompt, sliced, so they continue as if the prompt
had been prefilled at once.

Cross-attention (mllama) keeps a prefix only while the prompt's images are exactly the held
ones (:func:`~qeff_vision.runtime.retained_prefix.image_set_resume`), as its single program does.

Where it applies: a language program the runtime calls directly (:class:`CompiledProgram`:
onnxruntime, or a device, which keeps the caches resident, so there a prefix is kept only when
no other call reached the program since the turn it holds; rings resume only where they
stopped, no host copy exists), in slot 0 of the runner's engine when that slot is one host
cache (:class:`~qeff_vision.runtime.slots.SequentialSlots`). A disaggregated pair (prefill and
decode on two programs: the prefill program never holds the reply), a row of a batched cache
(a continuous-batching program's slot 0) and the requests of ``run --requests`` prefill every
prompt whole. A failed turn leaves nothing held: the next one starts over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from qeff_vision.runtime.results import GenerationResult
from qeff_vision.runtime.retained_prefix import HeldPrefix, Resume, held_after, kept_note, resume_point

if TYPE_CHECKING:
    from qeff_vision.runtime.request_state import RequestState


class PrefixKeeping:
    """Methods of :class:`~qeff_vision.runtime.generator.Generator` that keep a held prefix (a mixin).

    The engine calls :meth:`begin` when it takes a request, :meth:`prefill_done` after its last
    prefill chunk and :meth:`finish` with its result; what a request keeps lives in its
    :class:`~qeff_vision.runtime.request_state.RequestState`. The runner keeps only what its
    program holds: ``held`` (after the last kept generation, or None) and the program's calls
    then. They read the generator's ``language``, ``deployment``, ``host`` and ``_unpositioned``
    (the caches not indexed by position, :func:`~qeff_vision.runtime.retained_prefix.unpositioned_caches`).
    """

    held: HeldPrefix | None = None
    _unpositioned: Sequence[str] = ()
    #: Language-program calls when ``held`` was recorded (a device's resident caches are the
    #: held ones only if nothing ran since).
    _held_calls: int = -1

    def prefix_images(
        self, processed: Mapping[str, Any], prepared: tuple | None = None
    ) -> tuple[list[str], list[tuple[int, int]]]:
        """Content keys and ``[start, stop)`` token spans of the prompt's images, in prompt order."""
        if not self.host.has_images(processed):
            return [], []
        images = self._prepare_images(processed, prepared)[0]
        spans = [(segment.start, segment.stop) for segment in self.host.segments(processed)]
        return [image.key for image in images], spans

    def kept_resume(self, resume: Resume, held: HeldPrefix | None, keys: Sequence[str]) -> Resume:
        """``resume`` as this decoder kind may keep it (unchanged for token-merge)."""
        return resume

    def begin(self, request: RequestState) -> Resume:
        """Where ``request``'s prefill starts: after the prefix the program holds, if it may keep one.

        Whatever the request, the program's caches hold something else from now on, so nothing is
        known held until :meth:`finish` records it (a failed request leaves nothing held).
        """
        held, self.held = self.held, None
        if not self.keeps_prefix(request):
            return Resume()
        request.keys, spans = self.prefix_images(request.processed, request.prepared)
        if held is None or not self.deployment.holds_turn(self.language, self._held_calls):
            return Resume()
        found = resume_point(held, request.input_ids, spans, request.keys, self._unpositioned)
        return self.kept_resume(found, held, request.keys)

    def keeps_prefix(self, request: RequestState) -> bool:
        """Whether ``request`` keeps and records the prefix (asked for, and no history of its own)."""
        return request.request.keep_prefix and request.history is None

    def prefill_done(self, request: RequestState, cache: Mapping[str, np.ndarray] | None) -> None:
        """Keep the caches not indexed by position as the prompt's prefill left them.

        A later turn that resumes at the prompt's end restores them (host caches only; a step
        replaces the arrays, never writes into them, so no copy is needed).
        """
        if cache is not None:
            request.at_prompt_end = {
                name: cache[name] for name in self._unpositioned if name in cache
            } or None

    def finish(self, request: RequestState, result: GenerationResult) -> GenerationResult:
        """``result`` as reported; records what the program holds after a kept generation."""
        if not self.keeps_prefix(request):
            return result
        past = result.continuation.past if result.continuation is not None else {}
        self.held = held_after(request.input_ids, result.tokens, request.keys, past, request.at_prompt_end)
        self._held_calls = self.language.calls
        if not request.start:
            return result
        return replace(result, notes=[*result.notes, kept_note(request.start, len(request.input_ids))])
