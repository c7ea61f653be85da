"""Building a generator: the one runner registry, and a generator over an export directory.

A runner is the host of one decoder kind in one program form: the two programs of a dual or
disaggregated deployment (:class:`~qeff_vision.runtime.generator.Generator`,
:class:`~qeff_vision.runtime.cross_attention.CrossAttentionGenerator`) or the single program
holding the encoder (:class:`~qeff_vision.runtime.single.SingleGenerator`,
:class:`~qeff_vision.runtime.single_cross.SingleCrossGenerator`). Which form a deployment takes is
the deployment object's answer (:attr:`~qeff_vision.runtime.deployment.Deployment.encoder_inside`);
a new decoder kind registers its runners in :data:`RUNNERS`, and nothing else compares kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.contract.decoder_kinds import CROSS_ATTENTION, TOKEN_MERGE, DecoderKind
from qeff_vision.errors import UserError
from qeff_vision.export_record import PATCH_BUCKETS, read_export, vision_mode
from qeff_vision.runtime.cross_attention import CrossAttentionGenerator
from qeff_vision.runtime.deployment import Deployment, deployment_of
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generator import DEFAULT_CACHE_BYTES, Generator  # noqa: F401 - re-exported
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.session import OnnxProgram
from qeff_vision.runtime.single import SingleGenerator
from qeff_vision.runtime.single_cross import SingleCrossGenerator

#: The runner of each (encoder inside the language program, decoder kind). One registry for every
#: deployment mode: a mode picks the form, the checkpoint's family the kind.
RUNNERS: dict[tuple[bool, DecoderKind], Callable[..., Generator]] = {
    (False, TOKEN_MERGE): Generator,
    (False, CROSS_ATTENTION): CrossAttentionGenerator,
    (True, TOKEN_MERGE): SingleGenerator,
    (True, CROSS_ATTENTION): SingleCrossGenerator,
}


def make_generator(
    checkpoint: Checkpoint,
    vision: Any,
    language: Any,
    shape: LanguageShape,
    cache: EmbeddingCache | None = None,
    *,
    deployment: Deployment | None = None,
    **kwargs: Any,
) -> Generator:
    """The runner registered for the deployment's form and the checkpoint's decoder kind (:data:`RUNNERS`).

    Args:
        checkpoint: The checkpoint the programs were exported from.
        vision: The vision program (ignored by a mode whose encoder is inside ``language``).
        language: The language program.
        shape: Compiled language shapes.
        cache: The per-image embedding cache.
        deployment: The mode; by default the one ``language`` is (:func:`deployment_of`).
        **kwargs: The runner's keyword arguments (``patch_buckets``, ``eos_token_ids``, ...).

    Raises:
        UserError: No runner is registered for the decoder kind in that form.
    """
    deployment = deployment if deployment is not None else deployment_of(language)
    kind = checkpoint.family.decoder_kind
    runner = RUNNERS.get((deployment.encoder_inside, kind))
    if runner is None:
        form = "single-program runtime" if deployment.encoder_inside else "runtime"
        raise UserError(f"{checkpoint.family.title}: no {form} for decoder kind {kind.name!r}")
    programs = (language,) if deployment.encoder_inside else (vision, language)
    return runner(checkpoint, *programs, shape, cache, deployment=deployment, **kwargs)


def generator_for_export(
    export_dir: str | Path,
    shape: LanguageShape,
    *,
    vision_specializations: Sequence[Mapping[str, object]] | None = None,
    language_specializations: Sequence[Mapping[str, object]] | None = None,
    cache: EmbeddingCache | None = None,
    fp32_values: Mapping[str, Collection[str]] | None = None,
    mx=None,
) -> Generator:
    """A :class:`Generator` over an export directory's two graphs on onnxruntime.

    Without specializations any shape runs (a bare export); with them, the sessions reject the
    shapes a compiled program would. ``fp32_values`` (program -> precision plan) runs both
    programs at device precision (see :mod:`qeff_vision.numerics.device`); ``mx`` (a
    :class:`~qeff_vision.numerics.device.MxEmulation`) adds microscaling formats to the language
    program there (``-mxfp6-matmul`` and an MXINT8 KV cache are language-program options).
    """
    export_dir = Path(export_dir)
    manifest = read_export(export_dir)
    buckets = None
    if vision_mode(manifest) == PATCH_BUCKETS:
        if not vision_specializations:
            raise UserError(
                f"{export_dir}: a patch-bucket export runs with its vision specializations (the buckets)"
            )
        buckets = vision_specializations
    checkpoint = Checkpoint.open(manifest["model"], manifest["family"])
    plans = fp32_values or {}
    vision = OnnxProgram(
        export_dir / manifest["programs"]["vision"]["path"],
        vision_specializations,
        fp32_values=plans.get("vision", ()) if fp32_values is not None else None,
    )
    language = OnnxProgram(
        export_dir / manifest["programs"]["lang"]["path"],
        language_specializations,
        fp32_values=plans.get("lang", ()) if fp32_values is not None else None,
        mx=mx,
    )
    return make_generator(checkpoint, vision, language, shape, cache, patch_buckets=buckets)
