"""``run --embed`` / ``run --score QUERY``: pooling programs (spec ``task: embed | score``).

One input is ``--prompt TEXT`` with its ``--image`` options; ``--requests FILE.jsonl`` gives many
(one object a line with ``prompt`` and ``images``, as for generation; other keys are ignored).
stdout: one JSON object per input, in input order (``{"index", "embedding"}`` or
``{"index", "score"}``); stderr: tokens, time and the ``--compare-hf`` verdict per input.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from qeff_vision.contract.tasks import EMBED, SCORE


def run_pooling(
    artifacts,
    task: str,
    query: str | None,
    query_images,
    prompts,
    images,
    requests_file,
    instruction,
    dimensions,
    precision,
    compare_hf,
) -> None:
    """Pool the inputs and print them (see the module docstring); exit 1 when --compare-hf disagrees."""
    from qeff_vision.inputs.requests import read_requests
    from qeff_vision.runtime.pooling_run import PoolInput, pool_inputs

    if dimensions is not None and task != EMBED:
        raise click.UsageError("--dimensions (a Matryoshka prefix) applies to --embed only")
    if query_images and task != SCORE:
        raise click.UsageError("--query-image goes with --score QUERY")
    if requests_file is not None:
        if prompts or images:
            raise click.UsageError("--requests takes prompts and images from the file; drop --prompt/--image")
        items = [PoolInput(r.prompt, tuple(r.images)) for r in read_requests(requests_file)]
    elif len(prompts) == 1:
        items = [PoolInput(prompts[0], tuple(Path(p) for p in images))]
    else:
        raise click.UsageError("give one --prompt TEXT (with its --image options) or --requests FILE.jsonl")
    query_input = PoolInput(query, tuple(Path(p) for p in query_images)) if task == SCORE else None
    failed = []

    def on_result(index: int, pooled) -> None:
        key, value = (
            ("embedding", pooled.value.tolist()) if task == EMBED else ("score", float(pooled.value[0]))
        )
        click.echo(json.dumps({"index": index, key: value}))
        for note in pooled.notes:
            click.echo(f"note: input {index}: {note}", err=True)
        line = f"input {index}: {pooled.tokens} tokens, {pooled.seconds * 1e3:.1f} ms"
        agreement = pooled.agreement(task)
        if agreement is not None:
            figure, ok = agreement
            measure = "cosine" if task == EMBED else "|score - transformers|"
            verdict = "within" if ok else "OUTSIDE"
            bound = "device" if pooled.device else "fp32"
            line += f"; compare-hf: {measure} {figure:.8f} ({verdict} the {bound} tolerance)"
            if not ok:
                failed.append(index)
        click.echo(line, err=True)

    pool_inputs(
        artifacts,
        items,
        task,
        query=query_input,
        instruction=instruction,
        dimensions=dimensions,
        precision=precision,
        compare_hf=compare_hf,
        on_result=on_result,
    )
    if failed:  # exit 1 (not 2): the inputs were fine, the programs disagree with transformers
        click.get_current_context().exit(1)
