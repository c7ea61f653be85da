"""Names of per-slot retained state (KV caches, recurrent states) and the ``kv_cache_prefix`` scheme.

Torch-free. A KV input is ``past_key.{i}`` / ``past_value.{i}``, a recurrent layer's state
``conv_state.{i}`` / ``recurrent_state.{i}``, any other kind's the stems its class declares
(:attr:`LayerState.stems <qeff_vision.contract.states.LayerState>`); each returns as
``<name>_RetainedState``. A
disaggregated compile with ``kv_cache_prefix`` renames all of them ``<name>_<prefix>`` (and
``<name>_<prefix>_RetainedState``), QEfficient's scheme that vLLM's prefill/decode hand-off selects
by pattern.
"""

from __future__ import annotations

from collections.abc import Iterable

from qeff_vision import symbols
from qeff_vision.contract.language_io import SLOT_ROLES, IORow, LanguageIO
from qeff_vision.contract.states import LayerState, kind_of_stem, slot_stems


def _layer_stem(name: str) -> tuple[str, int] | None:
    """(stem, layer) of a per-layer name, any ``kv_cache_prefix`` and ``_RetainedState`` dropped.

    ``past_key.3_vllmKvCache_RetainedState`` -> ``("past_key", 3)``; None when not per-layer.
    """
    base = name[: -len(symbols.RETAINED_SUFFIX)] if name.endswith(symbols.RETAINED_SUFFIX) else name
    head, _, layer = base.rpartition(".")
    layer = layer.partition("_")[0]
    return (head, int(layer)) if layer.isdigit() else None


def is_kv_name(name: str) -> bool:
    """Whether ``name`` is a per-layer KV cache input or its retained output (any layer).

    A ``kv_cache_prefix`` name (``past_key.3_vllmKvCache``) counts too.
    """
    stem = _layer_stem(name)
    return stem is not None and f"{stem[0]}.{stem[1]}" in (
        symbols.past_key(stem[1]),
        symbols.past_value(stem[1]),
    )


def is_state_name(name: str) -> bool:
    """Whether ``name`` is a recurrent layer's conv or recurrent state input or its retained output.

    A ``kv_cache_prefix`` name (``conv_state.0_vllmKvCache``) counts too.
    """
    stem = _layer_stem(name)
    return stem is not None and f"{stem[0]}.{stem[1]}" in (
        symbols.conv_state(stem[1]),
        symbols.recurrent_state(stem[1]),
    )


def is_slot_name(name: str) -> bool:
    """Whether ``name`` is per-slot retained state of any registered kind (its stems) or its output."""
    stem = _layer_stem(name)
    return stem is not None and stem[0] in slot_stems()


def kind_of_name(name: str) -> type[LayerState] | None:
    """The state kind whose row (or retained output) ``name`` is, any ``kv_cache_prefix`` dropped."""
    stem = _layer_stem(name)
    return None if stem is None else kind_of_stem(stem[0])


def with_kv_prefix_name(name: str, prefix: str) -> str:
    """``name`` with a ``kv_cache_prefix``; any name other than per-slot state unchanged.

    ``past_key.{i}`` -> ``past_key.{i}_{prefix}`` and its retained output ->
    ``past_key.{i}_{prefix}_RetainedState``; a recurrent layer's ``conv_state.{i}`` and
    ``recurrent_state.{i}`` alike: they are per-sequence state the prefill program hands to the
    decode program too (ref: QEfficient ``utils/_utils.py`` ``_KV_RETAINED_STEMS``, which vLLM's
    KV hand-off selects by the prefix pattern).
    """
    if not is_slot_name(name):
        return name
    if name.endswith(symbols.RETAINED_SUFFIX):
        return symbols.retained(f"{name[: -len(symbols.RETAINED_SUFFIX)]}_{prefix}")
    return f"{name}_{prefix}"


def with_kv_prefix(io: LanguageIO, prefix: str | None) -> LanguageIO:
    """``io`` with every KV and state row renamed by :func:`with_kv_prefix_name` (unchanged for None)."""
    if not prefix:
        return io

    def renamed(row: IORow) -> IORow:
        if row.role not in SLOT_ROLES:
            return row
        retained = with_kv_prefix_name(row.retained, prefix) if row.retained else None
        return IORow(
            with_kv_prefix_name(row.name, prefix), row.role, row.dtype, row.shape, retained, row.layer
        )

    return LanguageIO(tuple(map(renamed, io.inputs)), tuple(map(renamed, io.outputs)), io.layers)


def kv_prefix_of(names: Iterable[str]) -> str | None:
    """The ``kv_cache_prefix`` a graph's input names carry (``past_key.0_X`` -> ``X``), else None."""
    for name in names:
        if is_slot_name(name) and not name.endswith(symbols.RETAINED_SUFFIX):
            _, _, layer = name.rpartition(".")
            _, _, prefix = layer.partition("_")
            if prefix:
                return prefix
    return None
