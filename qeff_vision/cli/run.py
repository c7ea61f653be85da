"""``qeff-vision run ARTIFACTS --image IMG --prompt TEXT``: chunk-aware generation on compiled artifacts.

Several ``--prompt`` make one conversation; ``--turn-image N IMG`` (``--turn-video N CLIP``) shows
an image (a clip) in turn N, which is encoded in that turn while the program keeps the earlier ones.

The reply streams to stdout as it is decoded; notes, the per-chunk table, timings and the
``--compare-hf`` verdict go to stderr, so ``> reply.txt`` keeps only the reply.
"""

from __future__ import annotations

import json
import sys

import click

from qeff_vision.cli.requests_report import result_json
from qeff_vision.runtime.planner import VisionProtocol

HELP = {
    "image": "An image of the first turn (repeat for several, in prompt order; later turns: --turn-image).",
    "video": "A clip of the first turn, after the images: a directory of frame images (sorted by name) "
    "or a video file (decoded with PyAV).",
    "fps": "Frame rate of a frame directory (default 2), or the rate to sample a video file at.",
    "video_pruning_rate": "Prune each clip's most redundant rows (EVS, as vLLM's video_pruning_rate): "
    "keep the first temporal patch and the rows that changed most, 1 - RATE of them; 0 turns it off. "
    "Default: the compiled spec's vision.video_pruning_rate.",
    "turn_image": "An image shown in turn N (1 = the first, counting --prompt options), before that turn's "
    "text; repeat for several (in order). Only turn N encodes it; later turns find it held by the program.",
    "turn_video": "A clip shown in turn N, after that turn's images (as --video for turn 1).",
    "prompt": "The user's text after the images; repeat for further turns of the same conversation: each "
    "turn prefills only what it adds to the prefix the program holds from the turns before.",
    "max_new_tokens": "Upper bound of generated tokens per turn.",
    "protocol": "chunk: each prefill chunk sends only its image rows. full: the whole embedding every chunk.",
    "precision": "fp32: run the exported graphs as they are (onnxruntime backend; its default). "
    "device: as the compiler will under -convert-to-fp16 (fp16, the precision plan's node outputs "
    "in fp32), or for an ai200 artifact in bfloat16 (every value rounded to bf16); the qaic "
    "default. device-mx: device plus the MX formats the language program was "
    "compiled with (-mxfp6-matmul weights as FP6 E2M3, an MXINT8 KV cache).",
    "compare_hf": "Also run transformers generate (float32, eager, greedy) on the same inputs and compare "
    "tokens; exit code 1 when they differ. With --requests, each request alone.",
    "temperature": "Sampling temperature (vLLM's name): 0 (default) is greedy; above, logits are divided "
    "by it and the token drawn.",
    "top_k": "Draw among the K most likely tokens (0: all; 1 is greedy).",
    "top_p": "Draw among the smallest set of most likely tokens whose probability reaches P (1: all).",
    "min_p": "Drop tokens less likely than P x the most likely one (0: none).",
    "repetition_penalty": "Above 1 discourages tokens of the prompt and the reply (vLLM's rule).",
    "presence_penalty": "Subtracted from the logit of every token already generated.",
    "seed": "Seed of each turn's (each request's) own random generator: the same tokens every run, "
    "whichever requests share its steps.",
    "json": "Print one JSON document on stdout instead of the streamed reply: per turn (per request) "
    "the text, the token ids and the counts the report shows.",
    "requests": "Serve a JSON-lines request file through the batched engine instead of --prompt: one object "
    "a line with keys prompt, images (paths relative to the file, may be empty), max_new_tokens and "
    "arrival_step (the engine step it arrives at), and any sampling option by its name (temperature, top_k, "
    "top_p, min_p, repetition_penalty, presence_penalty, seed), overriding the command's for that request. "
    "Requests share the program's full_batch_size KV slots. A request that fails while it prefills (an image "
    "refused, a device call's error) is reported (error line; --json: failed, error) and the others are "
    "served; the exit code is then 1.",
    "embed": "Pooling artifacts (spec task: embed): print the L2-normalized embedding of the --prompt input "
    "(with its --image options), or of each line of --requests, as JSON lines.",
    "score": "Pooling artifacts (spec task: score): print each document's relevance to QUERY, "
    "sigmoid(logit yes - logit no); the documents are --prompt (with --image) or the lines of --requests.",
    "query_image": "An image of the --score query (repeat for several).",
    "instruction": "The task instruction of --embed / --score (default: the model card's).",
    "dimensions": "--embed: keep the first N values (Matryoshka), renormalized.",
}


@click.command(name="run")
@click.argument("artifacts", type=click.Path(file_okay=False))
@click.option("--image", "images", multiple=True, metavar="IMG", help=HELP["image"])
@click.option("--video", "videos", multiple=True, metavar="FILE_OR_FRAME_DIR", help=HELP["video"])
@click.option("--fps", type=float, default=None, metavar="N", help=HELP["fps"])
@click.option(
    "--video-pruning-rate", type=float, default=None, metavar="RATE", help=HELP["video_pruning_rate"]
)
@click.option(
    "--turn-image",
    "turn_images",
    multiple=True,
    nargs=2,
    type=(click.IntRange(min=1), str),
    metavar="N IMG",
    help=HELP["turn_image"],
)
@click.option(
    "--turn-video",
    "turn_videos",
    multiple=True,
    nargs=2,
    type=(click.IntRange(min=1), str),
    metavar="N FILE_OR_FRAME_DIR",
    help=HELP["turn_video"],
)
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT", help=HELP["prompt"])
@click.option(
    "--requests",
    "requests_file",
    type=click.Path(dir_okay=False),
    metavar="FILE.jsonl",
    help=HELP["requests"],
)
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True, help=HELP["max_new_tokens"]
)
@click.option(
    "--vision-protocol",
    type=click.Choice([p.value for p in VisionProtocol]),
    default=VisionProtocol.CHUNK.value,
    show_default=True,
    help=HELP["protocol"],
)
@click.option(
    "--precision", type=click.Choice(["fp32", "device", "device-mx"]), default=None, help=HELP["precision"]
)
@click.option("--compare-hf", is_flag=True, help=HELP["compare_hf"])
@click.option("--temperature", type=float, default=None, metavar="T", help=HELP["temperature"])
@click.option("--top-k", type=int, default=None, metavar="K", help=HELP["top_k"])
@click.option("--top-p", type=float, default=None, metavar="P", help=HELP["top_p"])
@click.option("--min-p", type=float, default=None, metavar="P", help=HELP["min_p"])
@click.option("--repetition-penalty", type=float, default=None, metavar="R", help=HELP["repetition_penalty"])
@click.option("--presence-penalty", type=float, default=None, metavar="R", help=HELP["presence_penalty"])
@click.option("--seed", type=int, default=None, metavar="N", help=HELP["seed"])
@click.option("--json", "as_json", is_flag=True, help=HELP["json"])
@click.option("--embed", is_flag=True, help=HELP["embed"])
@click.option("--score", "score_query", metavar="QUERY", default=None, help=HELP["score"])
@click.option("--query-image", "query_images", multiple=True, metavar="IMG", help=HELP["query_image"])
@click.option("--instruction", default=None, metavar="TEXT", help=HELP["instruction"])
@click.option("--dimensions", type=click.IntRange(min=1), default=None, metavar="N", help=HELP["dimensions"])
def run(
    artifacts,
    images,
    videos,
    fps,
    video_pruning_rate,
    turn_images,
    turn_videos,
    prompts,
    requests_file,
    max_new_tokens,
    vision_protocol,
    precision,
    compare_hf,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition_penalty,
    presence_penalty,
    seed,
    as_json,
    embed,
    score_query,
    query_images,
    instruction,
    dimensions,
) -> None:
    """Generate text with the programs compiled into ARTIFACTS (the OUT of `qeff-vision compile`).

    Uses the checkpoint's own processor and chat template. Several --prompt options make one
    conversation: the program keeps what earlier turns prefilled, so each turn prefills only its new
    tokens and encodes only its new images (--image in turn 1, --turn-image N IMG in turn N).
    --requests serves a file of requests arriving at different steps through the batched engine.
    Backend onnxruntime runs here; backend qaic needs the Cloud AI 100 SDK runtime.
    """
    if embed or score_query is not None:
        from qeff_vision.cli.pool import run_pooling

        if embed and score_query is not None:
            raise click.UsageError("give --embed or --score QUERY, not both")
        task = "embed" if embed else "score"
        run_pooling(
            artifacts,
            task,
            score_query,
            query_images,
            prompts,
            images,
            requests_file,
            instruction,
            dimensions,
            precision,
            compare_hf,
        )
        return
    from qeff_vision import api
    from qeff_vision.inputs.sampling_params import SamplingParams

    given = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "seed": seed,
    }
    sampling = SamplingParams(**{name: value for name, value in given.items() if value is not None})
    if requests_file is not None:
        if prompts or images or videos or turn_images or turn_videos or video_pruning_rate is not None:
            raise click.UsageError(
                "--requests takes prompts and images from the file; "
                "drop --prompt/--image/--video/--turn-image/--turn-video/--video-pruning-rate"
            )
        _run_requests(
            artifacts,
            requests_file,
            max_new_tokens,
            vision_protocol,
            precision,
            compare_hf,
            sampling,
            as_json,
        )
        return
    if not prompts:
        raise click.UsageError("give --prompt TEXT (or --requests FILE.jsonl)")
    for option, pairs in (("--turn-image", turn_images), ("--turn-video", turn_videos)):
        beyond = [number for number, _ in pairs if number > len(prompts)]
        if beyond:
            raise click.UsageError(
                f"{option} {beyond[0]}: the conversation has {len(prompts)} turn(s), one per --prompt"
            )

    several = len(prompts) > 1

    def on_turn(index: int, prompt: str) -> None:
        if several:
            click.echo(f"{'' if index == 0 else chr(10)}[turn {index + 1}] {prompt}", err=True)

    def on_text(piece: str) -> None:
        if not as_json:  # the reply is in the document
            sys.stdout.write(piece)
            sys.stdout.flush()

    def on_done(index: int, turn) -> None:
        if not as_json:
            click.echo()
        for line in report_lines(turn.result):
            click.echo(line, err=True)
        if turn.comparison is not None:
            click.echo(f"compare-hf: {turn.comparison.describe()}", err=True)

    turns = api.run(
        artifacts,
        list(images),
        list(prompts),
        max_new_tokens=max_new_tokens,
        protocol=vision_protocol,
        compare_hf=compare_hf,
        precision=precision,
        on_text=on_text,
        on_turn=on_turn,
        on_done=on_done,
        videos=list(videos),
        fps=fps,
        video_pruning_rate=video_pruning_rate,
        turn_images=by_turn(turn_images),
        turn_videos=by_turn(turn_videos),
        sampling=sampling,
    )
    if as_json:
        click.echo(json.dumps({"turns": [turn_json(index, turn) for index, turn in enumerate(turns)]}))
    if compare_hf and not all(turn.comparison.identical for turn in turns):
        # Exit code 1 (not 2): the inputs were fine, the runtime disagrees with transformers.
        click.get_current_context().exit(1)


def turn_json(index: int, turn) -> dict:
    """One turn of ``run --json``: its number, prompt, reply, token ids and counts."""
    entry = {"turn": index + 1, "prompt": turn.prompt, **result_json(turn.result)}
    if turn.comparison is not None:
        entry["compare_hf"] = {"identical": turn.comparison.identical, "verdict": turn.comparison.describe()}
    return entry


def by_turn(pairs) -> dict[int, list[str]]:
    """``(N, path)`` pairs as turn number -> paths, in command-line order."""
    grouped: dict[int, list[str]] = {}
    for number, path in pairs:
        grouped.setdefault(number, []).append(path)
    return grouped


def report_lines(result) -> list[str]:
    """The notes, per-chunk table and summary of one generation, as printed by ``run``."""
    lines = [f"note: {note}" for note in result.notes]
    lines += [f"vision: {line}" for line in result.served]
    lines.append(
        f"prompt {result.prompt_tokens} tokens, {result.images} image(s) = {result.image_rows} vision rows; "
        f"protocol {result.protocol}; {len(result.chunks)} prefill chunk(s)"
    )
    header = ("chunk", "tokens/S", "rows/V", "vision bytes", "images encoded", "encode ms", "prefill ms")
    rows = [header]
    for index, chunk in enumerate(result.chunks):
        rows.append(
            (
                str(index),
                f"{chunk.tokens}/{chunk.seq_len}",
                f"{chunk.rows}/{chunk.vision_size}",
                f"{chunk.vision_bytes:,}",
                str(chunk.images_encoded),
                f"{chunk.encode_seconds * 1e3:.1f}",
                f"{chunk.seconds * 1e3:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    decode_steps = max(len(result.tokens) - 1, 0)
    lines.append(
        f"TTFT {result.ttft * 1e3:.1f} ms; "
        f"decode {decode_steps} token(s) in {result.decode_seconds * 1e3:.1f} ms "
        f"({result.decode_tokens_per_second:.1f} tokens/s); {len(result.tokens)} token(s) generated"
    )
    lines.append(
        f"vision: {result.vision_bytes:,} bytes of {result.vision_input} "
        f"sent over {len(result.chunks)} chunk(s); "
        f"{result.encoder_calls} encoder call(s) encoding {result.images_encoded} image(s); "
        f"{result.cache_hits} cache hit(s)"
    )
    return lines


def _run_requests(
    artifacts, requests_file, max_new_tokens, protocol, precision, compare_hf, sampling, as_json
) -> None:
    """``run --requests``: replies on stdout as requests finish (or one JSON document), table on stderr."""
    from qeff_vision import api
    from qeff_vision.cli.requests_report import report_json, report_table

    def on_finish(request, done) -> None:
        if done.failed:  # the engine served the others; the request's one line says why
            click.echo(f"error: request {request.index} failed: {done.error}", err=True)
        elif not as_json:
            click.echo(f"[request {request.index}] {done.result.text}")
        for note in done.result.notes:
            click.echo(f"note: request {request.index}: {note}", err=True)

    batch = api.run_requests(
        artifacts,
        requests_file,
        max_new_tokens=max_new_tokens,
        protocol=protocol,
        compare_hf=compare_hf,
        precision=precision,
        on_finish=on_finish,
        sampling=sampling,
    )
    if as_json:
        click.echo(json.dumps(report_json(batch)))
    for line in report_table(batch):
        click.echo(line, err=True)
    for request, comparison in zip(batch.requests, batch.comparisons):
        click.echo(f"compare-hf: request {request.index}: {comparison.describe()}", err=True)
    if (compare_hf and not batch.identical) or any(done.failed for done in batch.report.requests):
        click.get_current_context().exit(1)  # a failed request: reported above, the others served
