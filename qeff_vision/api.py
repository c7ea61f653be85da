"""Library API: the verbs of the CLI, for users' Python. Heavy imports happen inside each verb."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qeff_vision.families import all_families


def families_table() -> str:
    """A plain-text table of every family and its feature support."""
    rows = []
    for family in all_families():
        rows.append((f"{family.name} [{family.title}]", "architectures", ", ".join(family.architectures)))
        rows.append(("", "decoder kind", family.decoder_kind.name))
        rows.append(("", "tasks", ", ".join(family.tasks)))  # spec key task (docs/guide/embeddings.md)
        rows.extend(("", feature, support.cell()) for feature, support in family.features.rows())
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows)


def tiny(family: str, out_dir, *, seed: int = 0, force: bool = False):
    """Write a tiny random-weight checkpoint of ``family`` to ``out_dir`` (atomically).

    Returns:
        The checkpoint directory.
    """
    from pathlib import Path

    from qeff_vision.checkpoint import quiet_transformers
    from qeff_vision.errors import UserError
    from qeff_vision.families import get_family
    from qeff_vision.fsutil import is_nonempty_dir, staged_directory

    out_dir = Path(out_dir)
    if is_nonempty_dir(out_dir) and not force:
        raise UserError(f"{out_dir} is not empty; pass --force to replace it")
    builder = get_family(family)
    quiet_transformers()
    with staged_directory(out_dir, force=force) as staging:
        builder.write_tiny_checkpoint(staging, seed)
    return out_dir


def export(
    model_dir,
    out_dir,
    *,
    force: bool = False,
    dtype: str = "float32",
    comp_ctx_lengths: bool = False,
    patch_buckets: bool = False,
    continuous_batching: bool = False,
    retain_full_kv: bool = False,
    sampler_top_k: int | None = None,
    sampler: Mapping[str, Any] | None = None,
    quiet: bool = False,
    revision: str | None = None,
    weight_dtype: str = "float32",
    keep_quantized: bool = False,
    task: str = "generate",
    subfunctions: bool = False,
):
    """Export the vision encoder and language decoder of ``model_dir`` to ONNX in ``out_dir``.

    ``model_dir`` is a checkpoint directory or a Hugging Face id (``Qwen/Qwen2.5-VL-3B-Instruct``,
    at ``revision``), resolved through the Hugging Face cache (:mod:`qeff_vision.hub`), which
    downloads what is missing; export.json then records the id and the commit.

    ``dtype`` (``float32`` or ``float16``) is the floating dtype of the graphs and weights;
    ``weight_dtype`` how a float32 graph stores float weights (``float16``: + Cast, where fp16 keeps
    the values) and ``keep_quantized`` keeps quantized checkpoint weights with ``DequantizeLinear``
    (docs/guide/weights-on-disk.md);
    ``comp_ctx_lengths`` adds that language input (for specs with compute-context lengths);
    ``patch_buckets`` exports the patch-bucket vision program (specs with ``vision.patch_buckets``).
    ``continuous_batching`` exports the language program with ``batch_index`` and
    ``full_batch_size`` KV slots (for specs with ``full_batch_size``); ``retain_full_kv`` gives
    ring layers ``ctx_len`` caches (for specs with ``retain_full_kv``). ``sampler_top_k`` compiles
    QEfficient's on-device sampler into the language program with that ``max_top_k_ids`` (for
    specs with ``compile.language.sampler``; its other keys at their defaults); ``sampler`` gives
    any of the spec's keys (``max_top_k_ids``, ``return_pdfs``, ``guided_decoding``) by name.
    ``task`` (``generate``, ``embed``, ``score``) picks the language program: a pooling task
    exports the cache-free pooling program (for specs with that ``task``).
    ``subfunctions`` exports each decoder layer as an ONNX function (for specs with
    ``compile.language.subfunctions``).

    Returns:
        :class:`qeff_vision.exporter.ExportResult`.
    """
    from qeff_vision import hub
    from qeff_vision.errors import UserError
    from qeff_vision.exporter import export_model, stderr_progress

    sampler_options = _export_sampler(sampler_top_k, sampler)  # bad keys refused before any work
    source = None
    if hub.is_hub_id(model_dir):
        if not quiet:
            stderr_progress(f"resolving {model_dir} in the Hugging Face cache (downloading what is missing)")
        checkpoint = hub.resolve(str(model_dir), revision, quiet=quiet)
        model_dir, source = checkpoint.directory, checkpoint.record()
    elif revision is not None:
        raise UserError(f"{model_dir}: a directory; --revision applies to a Hugging Face id only")
    return export_model(
        model_dir,
        out_dir,
        force=force,
        dtype=dtype,
        comp_ctx_lengths=comp_ctx_lengths,
        patch_buckets=patch_buckets,
        continuous_batching=continuous_batching,
        retain_full_kv=retain_full_kv,
        sampler=sampler_options,
        progress=None if quiet else stderr_progress,
        hub=source,
        weight_dtype=weight_dtype,
        keep_quantized=keep_quantized,
        task=task,
        subfunctions=subfunctions,
    )


def _export_sampler(top_k: int | None, keys: Mapping[str, Any] | None):
    """The export's :class:`SamplerOptions` from ``--sampler-top-k`` and ``--sampler`` keys, or None."""
    from qeff_vision.errors import UserError
    from qeff_vision.spec.compile_options import sampler_options

    if top_k is None and keys is None:
        return None
    keys = dict(keys or {})
    if top_k is not None:
        if keys.get("max_top_k_ids", top_k) != top_k:
            raise UserError("--sampler-top-k and --sampler max_top_k_ids disagree; give one")
        keys["max_top_k_ids"] = top_k
    try:
        return sampler_options(keys)
    except ValueError as exc:
        raise UserError(f"--sampler: {exc}") from None


def compile(spec, out_dir, **options):  # noqa: A001 - the verb's name, as on the command line
    """Compile both programs of a spec into ``out_dir`` (or verify them with onnxruntime).

    Keyword arguments are those of :func:`qeff_vision.compile.driver.compile_spec`: ``backend``
    (``qaic`` or ``onnxruntime``), ``compiler``, ``export_dir``, ``dry_run``, ``force``,
    ``timeout``, ``env``, ``progress`` and ``status_stream``.

    Returns:
        :class:`qeff_vision.compile.driver.CompileOutcome`; its ``manifest`` is what
        ``out_dir/manifest.json`` holds.
    """
    from qeff_vision.compile.driver import compile_spec
    from qeff_vision.progress import silenced

    with silenced("progress" in options and options["progress"] is None):  # quiet: no bars either
        return compile_spec(spec, out_dir, **options)


def specialize(spec_path, out_dir=None, *, layout: str | None = None):
    """Specializations and custom IO of both programs of a spec, written to ``out_dir`` if given.

    Args:
        spec_path: The YAML spec.
        out_dir: Where ``vision/`` and ``lang/`` ``specializations.json`` and ``custom_io.yaml``
            go (each file written atomically); ``None`` writes nothing.
        layout: ``flat``, ``named`` or ``auto`` instead of the spec's ``specialization_layout``;
            ``auto`` follows the installed SDK (``flat`` when there is none).

    Returns:
        :class:`qeff_vision.spec.ProgramSpecializations`.

    Raises:
        SpecError: Every problem of the spec.
    """
    from pathlib import Path

    from qeff_vision.fsutil import check_output_dir, staged_directory
    from qeff_vision.spec import AUTO, build_specializations, load_spec, resolve_layout, write_specializations

    spec = load_spec(spec_path)
    layout = layout or spec.layout
    if layout == AUTO:
        from qeff_vision.compile.sdk import detect_sdk

        sdk = detect_sdk()
        layout = resolve_layout(layout, sdk.specialization_layout if sdk else None)
    if out_dir is not None:
        check_output_dir(out_dir)
    result = build_specializations(spec, layout=layout)
    if out_dir is None:
        return result
    if Path(out_dir).is_dir():  # others' files may live there: each of ours replaced atomically
        write_specializations(result, out_dir)
    else:  # a new directory appears whole or not at all
        with staged_directory(out_dir) as staging:
            write_specializations(result, staging)
    return result


def validate(spec_path):
    """Check one spec file.

    Returns:
        ``(problems, warnings)``: every problem (``"<yaml path>: <what is wrong>"``; empty when the
        spec is valid) and every warning.
    """
    from qeff_vision.compile.serve_fit import serving_warnings
    from qeff_vision.errors import SpecError
    from qeff_vision.spec import build_specializations, load_spec

    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        return list(exc.problems), []
    if not spec.deployment.table.vllm_forms:
        return [], list(spec.warnings)  # vLLM forms are generated for the dual deployment only
    # The printed vLLM forms' servers: does the spec fit them (qeff_vision.compile.serve_fit)?
    return [], [*spec.warnings, *serving_warnings(build_specializations(spec))]


def memory_fit(spec_path) -> list[str]:
    """Weights and retained-state bytes per device for a valid spec's target (``spec/memory_fit.py``).

    Raises:
        SpecError: The spec is invalid.
    """
    from qeff_vision.spec import load_spec
    from qeff_vision.spec.memory_fit import memory_lines

    return memory_lines(load_spec(spec_path))


def deployment_notes(spec_path) -> list[str]:
    """What a valid spec's deployment options cost or change.

    ``retain_full_kv``: the KV bytes it adds; ``compile.comp_ctx_lengths``: the lists as QEfficient
    hands them to the compiler, when they differ from the spec's.

    Raises:
        SpecError: The spec is invalid.
    """
    from qeff_vision.spec import load_spec
    from qeff_vision.spec.ccl_lists import changed_note
    from qeff_vision.spec.deployment import full_kv_note

    spec = load_spec(spec_path)
    ccl = spec.compile.comp_ctx_lengths
    notes = [full_kv_note(spec), changed_note(ccl.prefill, ccl.decode, spec.ctx_len) if ccl else None]
    return [note for note in notes if note]


def config_notes(spec_path) -> list[str]:
    """The family defaults a valid spec's checkpoint config relies on; a pruning rate's kept rows per clip.

    Raises:
        SpecError: The spec is invalid.
    """
    from qeff_vision.families import get_family
    from qeff_vision.spec import load_spec
    from qeff_vision.spec.checks import video_pruning_notes

    spec = load_spec(spec_path)
    family = get_family(spec.family)
    notes = list(family.config_view(spec.model_description).notes)
    return notes + video_pruning_notes(family, spec.model_description, spec.vision)


def bucket_admission(spec_path) -> list[str]:
    """What each patch bucket of a valid spec admits (empty for a resolution-list spec).

    Raises:
        SpecError: The spec is invalid.
    """
    from qeff_vision.families import get_family
    from qeff_vision.spec import load_spec
    from qeff_vision.spec.buckets import admission_lines

    spec = load_spec(spec_path)
    if not spec.vision.patch_buckets:
        return []
    return admission_lines(get_family(spec.family), spec.model_description, spec.vision.patch_buckets)


def activation_estimate(spec_path) -> list[str]:
    """Attention score bytes of every specialization of a valid spec, estimated from its config.

    One line per program and specialization (:mod:`qeff_vision.spec.activation_estimate`);
    ``compile`` measures the exported graphs instead.

    Raises:
        SpecError: The spec is invalid.
    """
    from qeff_vision.spec import load_spec
    from qeff_vision.spec.activation_estimate import estimate_lines

    return estimate_lines(load_spec(spec_path))


def check_golden(specs_dir, *, update: bool = False):
    """Regenerate every spec under ``specs_dir`` and compare with (or rewrite) ``specs_dir/golden``.

    Returns:
        :class:`qeff_vision.compile.golden.GoldenReport`; ``report.ok`` is the verdict.
    """
    from qeff_vision.compile.golden import check_golden as check

    return check(specs_dir, update=update)


def conversation(
    artifacts_dir,
    *,
    cache_bytes: int | None = None,
    protocol: str = "chunk",
    max_new_tokens: int = 32,
    precision: str | None = None,
    video_pruning_rate: float | None = None,
    sampling=None,
):
    """A multi-turn conversation over a compile output directory (``qeff-vision compile -o OUT``).

    Each :meth:`~qeff_vision.runtime.conversation.Conversation.ask` re-runs the whole conversation
    with the checkpoint's chat template; images already shown come from the embedding cache.

    Args:
        artifacts_dir: OUT of ``qeff-vision compile`` (``manifest.json`` inside).
        cache_bytes: Bound of the per-image embedding cache (256 MiB if None).
        protocol: Default vision protocol, ``chunk`` or ``full``.
        max_new_tokens: Default upper bound of generated tokens per turn.
        precision: ``fp32`` runs the exported graphs; ``device`` runs them as the compiler will
            (fp16, the precision plan's nodes in fp32).
        video_pruning_rate: Prune clips at this rate (EVS, [0, 1), 0 = off); None: the compiled
            spec's ``vision.video_pruning_rate``.
        sampling: Default :class:`~qeff_vision.inputs.sampling_params.SamplingParams` of every turn
            (greedy when None).

    Returns:
        :class:`qeff_vision.runtime.conversation.Conversation`.
    """
    from qeff_vision.runtime.conversation import open_conversation

    return open_conversation(
        artifacts_dir,
        cache_bytes=cache_bytes,
        protocol=protocol,
        max_new_tokens=max_new_tokens,
        precision=precision,
        video_pruning_rate=video_pruning_rate,
        sampling=sampling,
    )


def run(
    artifacts_dir,
    images,
    prompts,
    *,
    max_new_tokens: int = 32,
    protocol: str = "chunk",
    compare_hf: bool = False,
    precision: str | None = None,
    on_text=None,
    on_turn=None,
    on_done=None,
    videos=(),
    fps: float | None = None,
    video_pruning_rate: float | None = None,
    turn_images=None,
    turn_videos=None,
    sampling=None,
):
    """Generate on compiled artifacts: one turn per prompt, each showing its images and clips.

    The program keeps the conversation's prefix between turns: a turn prefills only its new tokens
    and encodes only its new images (one shown in turn 3 is encoded there, held after).

    Args:
        artifacts_dir: OUT of ``qeff-vision compile``.
        images: Image paths (or PIL images) of the first turn, in order.
        prompts: The user's text, or a list of texts (one conversation turn each).
        max_new_tokens: Upper bound of generated tokens per turn.
        protocol: ``chunk`` or ``full``.
        compare_hf: Also run transformers generate (float32, eager, greedy) on each turn's exact
            inputs and compare the tokens.
        precision: ``fp32`` or ``device`` (see :func:`conversation`).
        on_text: Called with each completed piece of reply text (streaming).
        on_turn: Called with (turn index, prompt) before each turn.
        on_done: Called with (turn index, :class:`~qeff_vision.runtime.conversation.Turn`) after it.
        videos: Clips of the first turn: directories of frame images or video files.
        turn_images: Turn number (1 = the first) -> images that turn shows (in turn 1, after
            ``images``).
        turn_videos: Turn number -> clips that turn shows (in turn 1, after ``videos``).
        fps: Frame rate of the clips' frames (a directory) or to sample a file at.
        video_pruning_rate: Prune the clips at this rate (see :func:`conversation`).
        sampling: :class:`~qeff_vision.inputs.sampling_params.SamplingParams` of every turn (greedy
            when None; ``compare_hf`` needs greedy).

    Returns:
        One :class:`qeff_vision.runtime.conversation.Turn` per prompt.

    Raises:
        UserError: No manifest, a missing or unreadable image, a turn number beyond the prompts,
            a prompt that is not UTF-8 text, holds an image placeholder or does not fit ``ctx_len``,
            a checkpoint without tokenizer, or a ``qaic`` artifact without the SDK runtime.
    """
    from qeff_vision.bad_input import check_prompt
    from qeff_vision.errors import UserError
    from qeff_vision.inputs.prompt import media_by_turn
    from qeff_vision.media import load_image, load_video
    from qeff_vision.runtime.conversation import run_turns

    prompts = [check_prompt(prompt) for prompt in ([prompts] if isinstance(prompts, str) else prompts)]
    if compare_hf and sampling is not None and not sampling.greedy:
        raise UserError(
            "--compare-hf compares greedy tokens with transformers; drop the sampling options "
            "(temperature, top_k) or --compare-hf"
        )
    # Fail on a bad turn number, image or clip before loading anything heavy.
    media_by_turn(images, turn_images, len(prompts), "image")
    media_by_turn(videos, turn_videos, len(prompts), "video")
    for image in [*images, *(image for shown in (turn_images or {}).values() for image in shown)]:
        load_image(image)
    clips = [load_video(video, fps) for video in videos]
    turn_clips = {n: [load_video(video, fps) for video in shown] for n, shown in (turn_videos or {}).items()}
    chat = conversation(
        artifacts_dir,
        protocol=protocol,
        max_new_tokens=max_new_tokens,
        precision=precision,
        video_pruning_rate=video_pruning_rate,
        sampling=sampling,
    )
    return run_turns(
        chat,
        images,
        prompts,
        compare_hf=compare_hf,
        on_text=on_text,
        on_turn=on_turn,
        on_done=on_done,
        videos=clips,
        turn_images=turn_images,
        turn_videos=turn_clips,
    )


def run_requests(
    artifacts_dir,
    requests_file,
    *,
    max_new_tokens: int = 32,
    protocol: str = "chunk",
    compare_hf: bool = False,
    precision: str | None = None,
    on_finish=None,
    sampling=None,
):
    """Serve a JSON-lines request file through the batched engine (``run --requests``).

    Args:
        artifacts_dir: OUT of ``qeff-vision compile``.
        requests_file: One JSON object a line: ``prompt``, ``images``, ``max_new_tokens``,
            ``arrival_step`` (see :mod:`qeff_vision.inputs.requests`).
        max_new_tokens: For requests that do not set it.
        protocol: ``chunk`` or ``full``.
        compare_hf: Also run transformers generate alone on each request and compare tokens.
        precision: ``fp32`` or ``device``.
        on_finish: Called with (request, result) as each request completes.
        sampling: :class:`~qeff_vision.inputs.sampling_params.SamplingParams` of requests whose line
            sets no sampling key (each key a line sets overrides it).

    Returns:
        :class:`qeff_vision.runtime.batch_run.BatchRun`.

    Raises:
        UserError: A bad request file or image, a request that does not fit, no manifest.
    """
    from qeff_vision.runtime.batch_run import run_requests as serve

    return serve(
        artifacts_dir,
        requests_file,
        max_new_tokens=max_new_tokens,
        protocol=protocol,
        compare_hf=compare_hf,
        precision=precision,
        on_finish=on_finish,
        **({"sampling": sampling} if sampling is not None else {}),
    )
