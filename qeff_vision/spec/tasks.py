"""Spec key ``task``: checked against the family and the keys that only a cached decoder has."""

from __future__ import annotations

from qeff_vision.contract.tasks import is_pooling


def check_task(reader, family, task: str, deployment, full_batch_size, compile_options) -> None:
    """Record a problem when ``family`` does not declare ``task`` or a pooling task meets a cache key.

    A pooling program (``embed``, ``score``) keeps nothing between calls, so continuous batching,
    compute-context lengths, the on-device sampler and the split deployments (which hand a KV
    cache from one program to another, or compose the encoder into a cached decoder) do not apply.
    """
    if task not in family.tasks:
        reader.add(
            "task", f"{family.title} does not declare task {task!r} (it declares {', '.join(family.tasks)})"
        )
        return
    if not is_pooling(task):
        return
    why = f"task {task} has no KV cache"
    if full_batch_size is not None:
        reader.add("full_batch_size", f"{why}, so no continuous batching slots")
    if deployment is not None and not deployment.table.pooling:
        reader.add("deployment", f"{why}: deploy it dual (a vision program and a pooling language program)")
    if compile_options.comp_ctx_lengths is not None:
        reader.add("compile.comp_ctx_lengths", f"{why}, so no compute-context lengths")
    if compile_options.language.sampler is not None:
        reader.add("compile.language.sampler", f"{why} and samples no token")
