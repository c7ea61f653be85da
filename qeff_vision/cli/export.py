"""``qeff-vision export MODEL -o OUT``: both programs to ONNX (MODEL: a directory or a Hugging Face id)."""

from __future__ import annotations

from typing import Any

import click
import yaml

from qeff_vision import api
from qeff_vision.contract.tasks import GENERATE, TASKS
from qeff_vision.errors import UserError


@click.command()
@click.argument("model_dir", metavar="MODEL", type=click.Path(file_okay=False))
@click.option(
    "-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory."
)
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    show_default=True,
    help="Floating dtype of the exported graphs and weights.",
)
@click.option(
    "--weight-dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="How a float32 graph stores float weights: float16 (+ Cast; half the bytes, for programs "
    "compiled to fp16, where fp16 keeps the values), bfloat16 (+ Cast; for ai200, which computes "
    "bf16) or float32. A spec's compile chooses by itself.",
)
@click.option(
    "--keep-quantized",
    is_flag=True,
    help="Keep weights a quantized checkpoint stores quantized (int4/int8/fp8 + scales feeding "
    "DequantizeLinear; the graphs move to opset 21).",
)
@click.option(
    "--comp-ctx-lengths",
    "ccl",
    is_flag=True,
    help="Add the comp_ctx_lengths input (specs with compile.comp_ctx_lengths need it).",
)
@click.option(
    "--patch-buckets",
    is_flag=True,
    help="Export the patch-bucket vision program (specs with vision.patch_buckets need it).",
)
@click.option(
    "--continuous-batching",
    "cb",
    is_flag=True,
    help="Language program for continuous batching: batch_index input, full_batch_size KV slots "
    "(specs with full_batch_size need it).",
)
@click.option(
    "--retain-full-kv",
    "full_kv",
    is_flag=True,
    help="Ring layers (sliding window, attention chunk) keep ctx_len KV slots instead of a ring "
    "(specs with retain_full_kv need it).",
)
@click.option(
    "--sampler-top-k",
    "sampler_top_k",
    type=click.IntRange(min=1),
    default=None,
    help="Compile QEfficient's on-device sampler into the language program with this max_top_k_ids "
    "(specs with compile.language.sampler need it; the spec's compile exports it by itself).",
)
@click.option(
    "--sampler",
    "sampler",
    metavar="KEY=VALUE",
    multiple=True,
    help="Compile the on-device sampler with this compile.language.sampler key, named and valued as "
    "in a spec: max_top_k_ids=N, return_pdfs=true|false, guided_decoding=true|false (repeatable; "
    "the others at their defaults).",
)
@click.option(
    "--subfunctions",
    is_flag=True,
    help="Export each decoder layer as an ONNX function, one per distinct layer body "
    "(specs with compile.language.subfunctions need it).",
)
@click.option(
    "--revision",
    metavar="REV",
    help="Branch, tag or commit of a Hugging Face id (default: main); the commit is recorded.",
)
@click.option(
    "--task",
    type=click.Choice(TASKS),
    default=GENERATE,
    show_default=True,
    help="The language program: generate (KV-cache decoder), embed or score (pooling programs, "
    "for specs with that task; the family must declare it).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress lines or bars on stderr.")
def export(
    model_dir: str,
    out_dir: str,
    force: bool,
    dtype: str,
    weight_dtype: str,
    keep_quantized: bool,
    ccl: bool,
    patch_buckets: bool,
    cb: bool,
    full_kv: bool,
    sampler_top_k: int | None,
    sampler: tuple[str, ...],
    subfunctions: bool,
    revision: str | None,
    task: str,
    quiet: bool,
) -> None:
    """Export MODEL's vision encoder and language decoder to OUT/vision and OUT/lang (+ export.json).

    MODEL is a checkpoint directory or a Hugging Face id (Qwen/Qwen2.5-VL-3B-Instruct), read from
    the Hugging Face cache (HF_HOME, HF_HUB_CACHE) and downloaded into it when missing (HF_TOKEN for
    gated models; HF_HUB_OFFLINE=1 never downloads). A directory of that name wins over the id.
    """
    result = api.export(
        model_dir,
        out_dir,
        force=force,
        dtype=dtype,
        weight_dtype=weight_dtype,
        keep_quantized=keep_quantized,
        comp_ctx_lengths=ccl,
        patch_buckets=patch_buckets,
        continuous_batching=cb,
        retain_full_kv=full_kv,
        sampler_top_k=sampler_top_k,
        sampler=_sampler_keys(sampler),
        subfunctions=subfunctions,
        quiet=quiet,
        revision=revision,
        task=task,
    )
    for program in ("vision", "lang"):
        inputs = result.manifest["programs"][program]["inputs"]
        shown = ", ".join(f"{name}{info['shape']}" for name, info in list(inputs.items())[:4])
        more = f", ... ({len(inputs)} inputs)" if len(inputs) > 4 else ""
        click.echo(f"{program}: {result.program_path(program)}  {shown}{more}")
    click.echo(f"export.json: {result.out_dir / 'export.json'}")


def _sampler_keys(pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """``--sampler KEY=VALUE`` pairs as a spec's mapping (values read as YAML scalars), or None."""
    if not pairs:
        return None
    keys: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key:
            raise UserError(f"--sampler {pair}: expected KEY=VALUE (for example max_top_k_ids=512)")
        if key in keys:
            raise UserError(f"--sampler {key}: given twice")
        try:
            keys[key] = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            keys[key] = text  # not a scalar: the sampler check names the key and the value
    return keys
