"""Spec key ``deployment``: which programs a spec compiles, and the keys that go with each mode.

Three modes, after the Cloud AI multimodal guide (docs/design.md "Contract v3")::

    dual            vision program + language program (prefill and decode specializations)
    single          one program holding encoder and decoder; batch 1, no full_batch_size
    disaggregated   vision + lang_prefill (prefill specializations, batch 1)
                    + lang_decode (decode at full_batch_size, or batch 1)

``kv_cache_prefix`` (disaggregated only) renames every KV input ``past_key.{i}`` to
``past_key.{i}_<prefix>`` (and its output to ``past_key.{i}_<prefix>_RetainedState``), the names
vLLM's prefill/decode KV hand-off selects by pattern (QEfficient's ``kv_cache_prefix``).
``retain_full_kv`` (disaggregated only, families with ring layers) keeps a ``ctx_len`` cache on
every ring layer instead of its ring (QEfficient's ``retain_full_kv``;
:mod:`qeff_vision.contract.full_kv`), so the KV handed from prefill to decode holds every position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qeff_vision.contract.deployment_programs import (  # noqa: F401 - the modes, re-exported
    DEPLOYMENTS,
    DISAGGREGATED,
    DUAL,
    LANG_DECODE,
    LANG_PREFILL,
    MODES,
    PROGRAMS,
    SINGLE,
    DeploymentMode,
)
from qeff_vision.spec.strict_yaml import shown

DEPLOYMENT_KEYS = ("deployment", "kv_cache_prefix", "retain_full_kv")
# vLLM selects the KV tensors by a name pattern; keep the prefix a plain identifier.
KV_PREFIX_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9]*")


@dataclass(frozen=True)
class Deployment:
    """How a spec is deployed.

    Attributes:
        mode: ``dual``, ``single`` or ``disaggregated``.
        kv_cache_prefix: Suffix of every KV name (disaggregated only); ``None`` keeps QEfficient's
            plain ``past_key.{i}``.
        retain_full_kv: Ring layers keep ``ctx_len`` slots, masked to their window or block
            (disaggregated only).
    """

    mode: str = DUAL
    kv_cache_prefix: str | None = None
    retain_full_kv: bool = False

    @property
    def table(self) -> DeploymentMode:
        """What the mode is (:data:`~qeff_vision.contract.deployment_programs.MODES`)."""
        return MODES[self.mode]

    @property
    def programs(self) -> dict[str, str]:
        """Program directory -> ``compile:`` section, in compile order."""
        return dict(self.table.programs)


def read_deployment(
    reader: Any, top: dict, batch_size: int | None, full_batch_size: int | None
) -> Deployment | None:
    """``deployment`` and ``kv_cache_prefix`` of a spec's top level, checked against the batch keys.

    Args:
        reader: The spec's :class:`~qeff_vision.spec.schema.Reader` (problems are recorded there).
        top: The parsed top-level mapping.
        batch_size: ``batch_size`` as read (None when invalid).
        full_batch_size: ``full_batch_size`` as read (None when absent or invalid).

    Returns:
        The deployment, or None when a value is invalid.
    """
    before = len(reader.problems)
    mode = reader.text(top, "deployment", "", choices=DEPLOYMENTS, default=DUAL)
    table = MODES.get(mode)
    hands_kv = table is not None and table.kv_prefix
    prefix = top.get("kv_cache_prefix")
    if "kv_cache_prefix" in top:
        if not isinstance(prefix, str) or not KV_PREFIX_PATTERN.fullmatch(prefix):
            reader.add(
                "kv_cache_prefix", f"must be letters and digits, starting with a letter (got {shown(prefix)})"
            )
        elif not hands_kv:
            reader.add(
                "kv_cache_prefix",
                "names the KV tensors a prefill program hands to a decode program; it needs "
                "deployment: disaggregated",
            )
    full_kv = top.get("retain_full_kv", False)
    if not isinstance(full_kv, bool):
        reader.add("retain_full_kv", f"must be true or false (got {shown(full_kv)})")
    elif full_kv and not hands_kv:
        reader.add(
            "retain_full_kv",
            "keeps full-length caches on ring layers so the KV a prefill program hands to a decode "
            "program holds every position; it needs deployment: disaggregated",
        )
    if table is not None and table.one_sequence:
        # One program that encodes and decodes keeps one sequence's state (vLLM asserts
        # max_num_seqs == 1 for QEfficient's single QPC).
        if full_batch_size is not None:
            reader.add(
                "full_batch_size", "deployment single serves one sequence (batch 1); remove full_batch_size"
            )
        if batch_size is not None and batch_size > 1:
            reader.add("batch_size", f"deployment single serves one sequence (batch 1), got {batch_size}")
    if len(reader.problems) != before or mode is None:
        return None
    return Deployment(mode, prefix if isinstance(prefix, str) else None, full_kv is True)


def check_deployment(reader: Any, family: Any, deployment: Deployment, model: Any) -> None:
    """The family can be deployed that way (its feature matrix says why not); ``model`` its config."""
    from qeff_vision.contract.full_kv import has_rings

    support = family.features.deployment(deployment.mode)  # the table names the feature cell
    if not support.supported:
        reader.add("deployment", f"{family.title} cannot be deployed {deployment.mode}: {support.note}")
    if deployment.retain_full_kv and not has_rings(family.layer_caches(model)):
        reader.add(
            "retain_full_kv",
            f"{family.title}'s layers keep no ring (no sliding-window or chunked-attention layer in "
            "this config): every cache is already full length",
        )
    if deployment.kv_cache_prefix and not family.decoder_kind.merges_vision_rows:
        reader.add(
            "kv_cache_prefix",
            f"{family.title}'s cross-attention states are vision-program outputs that the language "
            "program retains under the same KV cache names; a prefix would break that pairing",
        )


SAMPLER_KEY = "compile.language.sampler"


def check_sampler(reader: Any, deployment: Deployment, sampler: Any, vocab_size: int | None) -> None:
    """``compile.language.sampler`` fits the deployment and the vocabulary.

    The sampler goes into a separate language program (``dual``; both programs of
    ``disaggregated``, whose prefill also returns ``next_tokens``). QEfficient raises
    NotImplementedError for single-QPC multimodal models; the single program here is refused for
    the same structural reason. ``max_top_k_ids`` is a top-k over the vocabulary, so at most it.
    """
    if sampler is None:
        return
    if not deployment.table.sampler:
        reader.add(
            SAMPLER_KEY,
            "deployment single composes the vision encoder into the language program; the on-device "
            "sampler wraps a separate language program (QEfficient offers it for dual-QPC models "
            "only): use deployment dual or disaggregated",
        )
    if vocab_size is not None and sampler.max_top_k_ids > vocab_size:
        reader.add(
            f"{SAMPLER_KEY}.max_top_k_ids",
            f"{sampler.max_top_k_ids} exceeds the vocabulary ({vocab_size} tokens): the sampler's top-k "
            "keeps at most every token",
        )


def check_single_vision(reader: Any, deployment: Deployment, vision: Any) -> None:
    """``deployment: single`` encodes a prompt's images with one resolution table: no clips, no buckets.

    A clip (``vision.videos``) would ride the image path with its frames as temporal patches,
    which the single program's runtime does not feed; patch buckets pack images with host-made
    ids (a separate vision graph) that the composition does not take. Both serve dual.
    """
    if vision is None:
        return
    if not deployment.table.video and any(image.video for _, image in vision.images):
        reader.add(
            "vision.videos", "deployment single encodes images only; serve video clips with deployment dual"
        )
    if not deployment.table.patch_buckets and vision.patch_buckets:
        reader.add(
            "vision.patch_buckets",
            "deployment single composes the per-resolution vision graph; give vision.images "
            "(patch buckets serve dual)",
        )


def split_language(language: Any, mode: str, kv_cache_prefix: str | None = None) -> tuple[Any, ...]:
    """The language program(s) of ``mode`` from the dual language files (``ProgramFiles``).

    ``dual`` and ``single`` keep the one program. ``disaggregated`` gives ``lang_prefill`` (the
    prefill specializations only, at batch 1: a continuous-batching export binds
    ``full_batch_size`` 1 there, one request's cache being the unit handed to the decode program)
    and ``lang_decode`` (the decode specializations only: batch ``full_batch_size``, or 1). Both
    are compiled from the same language graph with the same custom IO (one KV dtype on both sides
    of the hand-off), whose KV names carry ``kv_cache_prefix`` when given.
    """
    from dataclasses import replace

    from qeff_vision import symbols
    from qeff_vision.contract.slot_names import with_kv_prefix_name

    phases = MODES[mode].phase_programs
    if not phases:
        return (language,)
    prefill, decode = [], []
    for entry in language.specializations:
        if entry.name.startswith("Decode"):
            decode.append(entry)
            continue
        values = dict(entry.symbols)
        for key in (symbols.FULL_BATCH_SIZE, symbols.FULL_BATCH_EXEC_SIZE):
            if key in values:
                values[key] = "1"
        prefill.append(replace(entry, symbols=values))
    if kv_cache_prefix:
        custom_io = tuple(
            (with_kv_prefix_name(name, kv_cache_prefix), kind) for name, kind in language.custom_io
        )
        language = replace(language, custom_io=custom_io)
    return (
        replace(language, directory=phases[0], specializations=tuple(prefill)),
        replace(language, directory=phases[1], specializations=tuple(decode)),
    )


# Bytes per KV element on the device: float16 and bfloat16 2; mxint8 one byte plus one shared 8-bit scale per
# block of 32 elements (OCP Microscaling v1.0, as qeff_vision/numerics/mx.py emulates it).
KV_ELEMENT_BYTES = {"float16": 2.0, "bfloat16": 2.0, "mxint8": 1 + 1 / 32}


def full_kv_note(spec: Any) -> str | None:
    """What ``retain_full_kv`` costs for a valid ``spec``: its decode program's KV bytes with and without.

    Counts every KV row of the language table (keys and values, the decode program's
    ``full_batch_size`` slots or ``batch_size`` rows) at the spec's ``kv_cache_dtype``; None when
    the spec does not set the option.
    """
    from qeff_vision import symbols
    from qeff_vision.contract.language_io import DType
    from qeff_vision.families import get_family

    if not spec.deployment.retain_full_kv:
        return None
    family, model = get_family(spec.family), spec.model_description
    slots = spec.full_batch_size or spec.batch_size
    values = {
        symbols.BATCH_SIZE: slots,
        symbols.FULL_BATCH_SIZE: slots,
        **family.language_dims(model),
        **family.kv_cache_lengths(model, spec.ctx_len),
        **family.request_symbols(model, spec.vision.max_images),
    }
    kv_dtype = spec.compile.language.kv_cache_dtype
    per_element = KV_ELEMENT_BYTES[kv_dtype]

    cb = spec.full_batch_size is not None
    dim0 = symbols.FULL_BATCH_SIZE if cb else symbols.BATCH_SIZE

    def mib(full: bool) -> float:
        # Each layer's state counts its own rows (a shared layer none); only KV rows change here.
        table = family.language_table(model, continuous_batching=cb, retain_full_kv=full)
        kv_bytes = {DType.KV: per_element, DType.STATE: 0}
        return (
            sum(state.state_bytes(layer, values, kv_bytes, dim0) for layer, state in enumerate(table.layers))
            / 2**20
        )

    rings = sum(state.ring for state in family.layer_caches(model))
    ring, full = mib(False), mib(True)
    return (
        f"retain_full_kv: {rings} ring layer(s) keep ctx_len {spec.ctx_len} slots; lang_decode's KV "
        f"({slots} slot(s), {kv_dtype}) grows from {ring:,.1f} MiB to {full:,.1f} MiB ({full / ring:.2f}x)"
    )
