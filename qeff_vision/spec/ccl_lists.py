"""The compute-context-length (CCL) lists QEfficient hands the compiler for a spec's lists.

QEfficient's compile path (pinned quic/efficient-transformers ebf55e8,
``QEfficient/utils/check_ccl_specializations.py``: ``process_ccl_specializations`` ->
``validate_ccl_lists``; constants ``CCL_MIN_CTX_LEN`` and ``CCL_UNIQNE_STEP`` in
``QEfficient/utils/constants.py``) rewrites the user's prefill and decode lists before it
specializes the language program. The same rules here, so a spec compiles the specializations
QEfficient (and the vLLM plugin, which reads the CCLs back from the program) would:

1. every value below ``CCL_MIN_CTX_LEN`` rises to it;
2. ``ctx_len`` joins a list whose last value is below it (every position has a CCL);
3. values are capped at ``ctx_len``, sorted and deduplicated;
4. a prefill value that a decode value (or an earlier prefill value) already holds moves down to
   the next lower multiple of ``CCL_UNIQNE_STEP``, again while taken: the two lists must not share
   a value (QEfficient's comment: a compiler limitation), and a multiple of 32 suits the hardware.

The prefill list therefore never reaches ``ctx_len`` (it is always in the decode list): the last
prefill CCL is at most ``ctx_len`` - 1 rounded down to 32. The runtime still serves every
position: a prompt's tokens past the last prefill CCL go one per decode-shaped call, at the decode
CCL covering each (:mod:`qeff_vision.runtime.planner`, ``prefill_stop``; an image placeholder
there has no call that merges it and is refused). Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

#: QEfficient's ``constants.CCL_MIN_CTX_LEN``: no CCL is smaller.
CCL_MIN_CTX_LEN = 1024
#: QEfficient's ``constants.CCL_UNIQNE_STEP`` (sic): a prefill value moved off a decode value
#: lands on a multiple of it.
CCL_UNIQUE_STEP = 32


def compiler_ccl_lists(
    prefill: Sequence[int], decode: Sequence[int], ctx_len: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill, decode) CCLs as QEfficient hands them to the compiler (see the module docstring).

    Args:
        prefill: The spec's prefill CCLs (non-empty).
        decode: The spec's decode CCLs (non-empty).
        ctx_len: The context length.

    Returns:
        Both lists sorted, distinct from each other; a prefill value that only went below 0 is
        dropped, as QEfficient drops it.
    """
    decode_values = _completed(decode, ctx_len)
    moved: list[int] = []
    for value in _completed(prefill, ctx_len):
        while value in decode_values or value in moved:
            value = (value - 1) // CCL_UNIQUE_STEP * CCL_UNIQUE_STEP
            if value < 0:
                break
        if value >= 0:
            moved.append(value)
    return tuple(sorted(moved)), decode_values


def _completed(values: Sequence[int], ctx_len: int) -> tuple[int, ...]:
    """Steps 1-3 for one list: raised to the minimum, ``ctx_len`` appended, capped, sorted, unique."""
    raised = [max(value, CCL_MIN_CTX_LEN) for value in values]
    if raised[-1] < ctx_len:  # QEfficient looks at the last value as given, not the largest
        raised.append(ctx_len)
    return tuple(sorted({min(value, ctx_len) for value in raised}))


def changed_note(prefill: Sequence[int], decode: Sequence[int], ctx_len: int) -> str | None:
    """What :func:`compiler_ccl_lists` changed in a spec's lists, for ``validate``; None when nothing."""
    compiled_prefill, compiled_decode = compiler_ccl_lists(prefill, decode, ctx_len)
    if (compiled_prefill, compiled_decode) == (tuple(prefill), tuple(decode)):
        return None
    changes = [
        f"{phase} {list(given)} -> {list(compiled)}"
        for phase, given, compiled in (
            ("prefill", prefill, compiled_prefill),
            ("decode", decode, compiled_decode),
        )
        if tuple(given) != compiled
    ]
    return (
        f"compile.comp_ctx_lengths compiled as QEfficient hands them to the compiler: {'; '.join(changes)} "
        f"(raised to {CCL_MIN_CTX_LEN} at least, ctx_len {ctx_len} added, prefill values moved off decode "
        f"values to multiples of {CCL_UNIQUE_STEP}); a prompt prefills up to "
        f"{compiled_prefill[-1] if compiled_prefill else 0} tokens, and `run` feeds its later tokens one "
        "per decode-shaped call at the decode CCL covering them (text only: an image there is refused)"
    )
