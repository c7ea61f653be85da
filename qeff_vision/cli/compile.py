"""``qeff-vision compile SPEC -o OUT``: dual QPC via the SDK compiler, or verification with onnxruntime."""

from __future__ import annotations

import click

from qeff_vision.compile_record import BACKENDS, QAIC

HELP = {
    "out": "Output directory: export/, vision/, lang/ and manifest.json.",
    "backend": "qaic: compile with the SDK compiler. onnxruntime: run every specialization on CPU instead.",
    "compiler": "Compiler executable (default: $QAIC_COMPILER, then the SDK's qaic-exec or qaic-compile).",
    "export": "Use this export directory instead of OUT/export (exported there if absent).",
    "dry_run": "Write the compiler inputs and print both command lines; compile nothing.",
    "force": "Recompile both programs even when the cache holds them.",
    "timeout": "Seconds each compiler may run before it is killed (overrides compile.*.timeout).",
    "quiet": "No progress lines or bars; a failure is its one error line (naming the compiler's log).",
    "revision": "Branch, tag or commit of the spec's Hugging Face id (overrides its revision:).",
    "print_serve": (
        "Print how vLLM serves the compiled programs: vLLM 0.23 + vllm-qaic (offline, vllm serve) "
        "and the guide's 0.8.5 forms (two LLMs, E-PD in docker)."
    ),
}


@click.command(name="compile")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help=HELP["out"])
@click.option("--backend", type=click.Choice(BACKENDS), default=QAIC, show_default=True, help=HELP["backend"])
@click.option("--compiler", type=click.Path(dir_okay=False), help=HELP["compiler"])
@click.option("--export", "export_dir", type=click.Path(file_okay=False), help=HELP["export"])
@click.option("--dry-run", is_flag=True, help=HELP["dry_run"])
@click.option("--force", is_flag=True, help=HELP["force"])
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help=HELP["timeout"])
@click.option("--print-serve", is_flag=True, help=HELP["print_serve"])
@click.option("--revision", metavar="REV", help=HELP["revision"])
@click.option("-q", "--quiet", is_flag=True, help=HELP["quiet"])
def compile_command(
    spec, out_dir, backend, compiler, export_dir, dry_run, force, timeout, print_serve, revision, quiet
) -> None:
    """Compile both programs (vision encoder and language decoder) of SPEC into OUT.

    The spec's model is a checkpoint directory or a Hugging Face id, read from the Hugging Face
    cache (HF_HOME, HF_HUB_CACHE) and downloaded into it when an export needs it (HF_TOKEN for
    gated models; HF_HUB_OFFLINE=1 never downloads).

    Exports the checkpoint if OUT has no export, writes specializations and custom IO, then runs
    both compilers at once with logs in OUT/<program>/compile.log. Programs whose inputs did not
    change are reused from OUT. OUT/manifest.json, written last, records both programs and the
    vLLM hand-off. OUT is built beside it and replaced only when everything succeeded: a failed
    or interrupted compile leaves it absent or as it was (a failed compiler's log stays in a
    temporary directory the error names).
    """
    from qeff_vision import api
    from qeff_vision.compile.driver import CompileFailed
    from qeff_vision.compile.vllm_handoff import serve_text

    if print_serve and dry_run:
        raise click.UsageError("--print-serve needs compiled programs; drop --dry-run")
    try:
        outcome = api.compile(
            spec,
            out_dir,
            backend=backend,
            compiler=compiler,
            export_dir=export_dir,
            dry_run=dry_run,
            force=force,
            timeout=timeout,
            revision=revision,
            **({"progress": None, "status_stream": None} if quiet else {}),
        )
    except CompileFailed as failure:
        if quiet:
            raise
        click.echo(f"--- last {len(failure.tail)} lines of {failure.log_path} ---", err=True)
        for line in failure.tail:
            click.echo(line, err=True)
        raise
    for note in outcome.notes:
        click.echo(f"note: {note}", err=True)
    # Weights and activation memory per specialization (stderr on a dry run: stdout is the commands).
    for line in outcome.activation:
        click.echo(line, err=dry_run)
    if dry_run:
        for program, command in outcome.commands.items():
            click.echo(f"# {program}")
            click.echo(command)
        return
    manifest = outcome.manifest
    for program, entry in manifest["programs"].items():
        cached = " (cached)" if entry.get("cached") else ""
        click.echo(f"{program}: {entry['path']}{cached}")
    for line in deviation_lines(manifest):
        click.echo(line)
    click.echo(f"manifest: {outcome.out_dir / 'manifest.json'}")
    if print_serve:
        click.echo(serve_text(manifest), nl=False)


def deviation_lines(manifest) -> list[str]:
    """The device-precision table of an onnxruntime verification (empty when nothing was compared).

    One row per specialization and emulation (fp16, then fp16 with the microscaling formats the
    options ask for): the plan's size, the largest deviation of the outputs from fp32 (absolute,
    and relative to that output's fp32 range) and whether any was inf/NaN.
    """
    header = (
        "program",
        "spec",
        "emulation",
        "fp32 nodes",
        "max |dev|",
        "dev/range",
        "worst output",
        "inf/NaN",
    )
    rows = []
    bf16 = (manifest.get("hardware") or {}).get("aic_hw_version") == "ai200"
    for program, entry in manifest["programs"].items():
        plan = entry.get("node_precision") or {}
        kept = plan.get("nodes")
        kept = "-" if kept is None else f"{kept}/{plan.get('non_matmul_outputs') or '?'}"
        for run in (entry.get("verification") or {}).get("runs", []):
            for key in ("device_precision", "device_precision_mx"):
                device = run.get(key)
                if device is None:
                    continue
                rows.append(
                    (
                        program,
                        str(run["index"]),
                        device.get("formats", "bf16" if bf16 else "fp16"),
                        kept,
                        f"{device['max_abs']:.3g}",
                        f"{device['max_relative']:.2e}",
                        device["worst_output"],
                        "no" if device["finite"] else "yes",
                    )
                )
    if not rows:
        return []
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    title = "bf16, every value rounded" if bf16 else "fp16, plan nodes fp32"
    lines = [f"device precision ({title}) vs fp32 on calibration inputs:"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    return lines
