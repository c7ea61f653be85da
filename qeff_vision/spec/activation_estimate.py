"""Attention score bytes per specialization, estimated from a spec's config without any graph.

``validate`` and ``specialize`` run on a spec alone (a pinned config, no export), so they cannot
measure a graph; what they can compute is the term the attention blocking bounds, from declared
dimensions: the scores of the largest attention of each program at each specialization, whole
and per block as the export's policy blocks it (:mod:`qeff_vision.contract.attention_blocking`),
at the device dtype. The vision figure comes from the family's ``vision_attention`` declaration;
the language figure is heads x batch x seq_len x keys (``comp_ctx_lengths`` when the call reads
fewer slots than ``ctx_len``). ``compile`` measures every value of the exported graphs instead
(qeff_vision/compile/activation_memory.py); these lines are the estimate a spec shows before that,
and what the golden files keep (``activation.txt``).
"""

from __future__ import annotations

from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.attention_blocking import MIB, for_spec, language_score_bytes

GOLDEN_FILE = "activation.txt"


def _mib(count: int) -> str:
    return f"{count / MIB:,.1f} MiB"


def _language(family, model, values: dict[str, int], policy) -> tuple[int, int]:
    heads = family.text_dims(model).num_attention_heads
    # A pooling program (no cache) attends over its own chunk: the keys are the seq_len tokens.
    keys = values.get(symbols.COMP_CTX_LENGTHS) or values.get(symbols.CTX_LEN) or values[symbols.SEQ_LEN]
    batch = values.get(symbols.BATCH_SIZE, 1)
    return language_score_bytes(heads, batch, values[symbols.SEQ_LEN], keys, policy)


def _vision(family, model, values: dict[str, int], policy) -> tuple[int, int] | None:
    if symbols.NUM_IMAGES in values:  # a single program's encode entry: its images are the batch
        values = {**values, symbols.BATCH_SIZE: values[symbols.NUM_IMAGES]}
    try:
        attention = family.vision_attention(model, values, policy)
    except KeyError:  # not an entry of the vision program (a single program's language entries)
        return None
    return None if attention is None else attention.score_bytes(policy.item_bytes)


def estimate_lines(spec: Any) -> list[str]:
    """One line per program and specialization: attention scores per block, whole, vs the bound."""
    from qeff_vision.families import get_family
    from qeff_vision.spec.specializations import build_specializations

    family = get_family(spec.family)
    model = spec.model_description
    bound = spec.compile.max_activation_bytes
    policy = for_spec(bound, spec.prefill.seq_lens, spec.ctx_len)
    generated = build_specializations(spec)
    lines = []
    for files in generated.programs or (generated.vision, generated.language):
        for index, entry in enumerate(files.specializations):
            values = {name: int(value) for name, value in entry.symbols.items()}
            figures = []
            if files.program == "vision" or symbols.NUM_IMAGES in values:
                figures.append(_vision(family, model, values, policy))
            if symbols.SEQ_LEN in values:
                figures.append(_language(family, model, values, policy))
            known = [f for f in figures if f is not None]
            label = f"{files.directory} {index}" + (f" ({entry.name})" if entry.name else "")
            if not known:
                lines.append(f"{label}: attention scores not declared by the family (measured at compile)")
                continue
            whole, block = max(known, key=lambda pair: pair[1])
            over = "" if bound is None or block <= bound else f", above the {_mib(bound)} bound"
            lines.append(f"{label}: attention scores {_mib(block)} per block ({_mib(whole)} unblocked){over}")
    return lines


def blocks_vision_attention(family, model) -> bool:
    """Whether ``family``'s export blocks its vision attention, read off its ``vision_attention``.

    The declaration under a policy forcing three query blocks: a tower the export blocks reports
    them; a per-tile tower under the bound (LLaVA's CLIP, Llama 4's tiles) reports one block, and
    a family declaring no attention is not blocked.

    Args:
        family: A registered family.
        model: A :class:`~qeff_vision.families.base.ModelDescription` of one of its configs.
    """
    from qeff_vision.contract.attention_blocking import AttentionBlocking
    from qeff_vision.families.base import ImageSize

    values = family.vision_symbols(model, ImageSize(448, 448))
    attention = family.vision_attention(model, values, AttentionBlocking(vision_blocks=3))
    return attention is not None and attention.blocks > 1


def blocked_towers() -> tuple[str, ...]:
    """Registered families whose vision attention the export blocks (at their smallest pinned config)."""
    import json

    from qeff_vision.families import all_families
    from qeff_vision.families.base import ModelDescription
    from qeff_vision.real_width import smallest_pinned_config

    return tuple(
        family.name
        for family in all_families()
        if blocks_vision_attention(
            family, ModelDescription(json.loads(smallest_pinned_config(family.name).read_text()))
        )
    )


def golden_text(spec: Any) -> str:
    """The golden ``activation.txt`` of a spec: the bound and :func:`estimate_lines`."""
    bound = spec.compile.max_activation_bytes
    head = [
        "# Attention scores per specialization at the device dtype (2 bytes), estimated from the",
        "# config by qeff_vision/spec/activation_estimate.py; compile measures the graphs.",
        f"# compile.max_activation_bytes: {'none' if bound is None else _mib(bound)}",
    ]
    return "\n".join([*head, *estimate_lines(spec)]) + "\n"
