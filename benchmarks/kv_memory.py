"""KV-cache bytes of the language program: ours (window layers as rings), QEfficient's layout, full ctx.

Usage: python benchmarks/kv_memory.py [--config specs/configs/gemma-3-4b-it/config.json ...]
                                      [--ctx 4096 8192 32768] [--kv-bytes 2] [--batch 1]
                                      [--mla-ctx 32768 131072]

Ours is the language IO table's state rows (``Family.layer_caches``: one state per layer, whose
class owns its rows and bytes; no rows for a layer that reads another layer's cache), the same
rows the exporter, the specializations and the runtime size caches from. QEfficient's layout is computed
from its rule (ref: QEfficient transformers/models/gemma3/modeling_gemma3.py and
gemma4/modeling_gemma4.py, ``get_onnx_dynamic_axes``, ``get_specializations`` and
``get_dummy_pkv_cache``: sliding layers' cache axis is the symbol ``sliding_window``, bound to
``config.sliding_window`` in every specialization; other layers ``ctx_len``; every layer has its
own cache, Gemma 4's shared-KV layers included, with its layer type's heads and head dim; Llama 4's
chunked-attention layers, QEfficient transformers/models/llama4/modeling_llama4.py: the symbol
``chunk_ctx_len`` bound to min(ctx_len, attention_chunk_size), as ours). Full ctx gives every
self-attention layer ``ctx_len`` slots. Bytes count keys and values of every layer
for ``batch`` sequences at ``kv-bytes`` per element (2: the spec's float16 KV).

A cross-attention family's cross layers hold the vision K/V of ``--images`` image slots
(``Family.request_symbols``), the same rows in every layout (QEfficient pins them at export too).

One table covers multi-head latent attention (Kimi-K2.5): every ``--config`` and every pinned
config whose decoder has ``LatentAttention`` layers, read from the pinned config through the state
classes. Per layout, bytes per position and per sequence at ``--mla-ctx`` (32k and 128k): ours
(``compressed_kv`` + ``k_pe``, ``LayerState.bytes_per_position``), QEfficient's ``mla_absorption``
``cache_compressed`` layout (a ``LatentAttention`` of its default geometry: the same rows), and
per-head K/V as transformers expands it and QEfficient caches it without ``cache_compressed`` (ref:
QEfficient transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py ``get_dummy_pkv_cache``:
keys [heads, qk_nope_head_dim + qk_rope_head_dim], values [heads, v_head_dim] per position).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _lib.docs_page import add_arguments as add_docs_arguments
from _lib.docs_page import recording

from qeff_vision import symbols
from qeff_vision.contract.language_io import DType
from qeff_vision.contract.states import ChunkedRing, CrossAttention, SlidingRing
from qeff_vision.contract.states.latent import LatentAttention
from qeff_vision.families import describe_checkpoint, family_for

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "specs" / "configs"
DEFAULT_CONFIG = PINNED / "gemma-3-4b-it" / "config.json"
LONG_CONTEXT = 128 * 1024


def layouts(family, description, ctx_len: int, images: int = 1) -> dict[str, int]:
    """Slots over all layers per layout."""
    cache_symbols = family.kv_cache_symbols(description)
    lengths = {**family.kv_cache_lengths(description, ctx_len), **family.request_symbols(description, images)}
    window = family.text_config(description).get("sliding_window")
    self_attention = (symbols.CTX_LEN, symbols.SLIDING_WINDOW, symbols.CHUNK_CTX_LEN)

    def slots(symbol: str, self_slots: int) -> int:
        return self_slots if symbol in self_attention else lengths[symbol]

    return {
        "ours": sum(lengths[s] for s in cache_symbols),
        "QEfficient": sum(
            slots(s, int(window) if s == symbols.SLIDING_WINDOW else lengths.get(s, ctx_len))
            for s in cache_symbols
        ),
        "full ctx": sum(slots(s, ctx_len) for s in cache_symbols),
    }


def layout_bytes(
    family, description, ctx_len: int, kv_bytes: int, batch: int, images: int = 1, state_bytes: int = 4
) -> dict[str, int]:
    """Bytes per layout, each layer's state counting its own rows (``LayerState.state_bytes``).

    Ours: the language table's states (a shared layer has no rows). QEfficient: every layer keeps
    its own copy of the state it reads, a ``sliding_window`` ring bound to the config's window even
    past ``ctx_len``. Full ctx: every ring made ``ctx_len`` (``LayerState.full_length``). KV rows at
    ``kv_bytes`` per element, recurrent state rows at ``state_bytes``.
    """
    lengths = {**family.kv_cache_lengths(description, ctx_len), **family.request_symbols(description, images)}
    values = {symbols.BATCH_SIZE: batch, **family.language_dims(description), **lengths}
    window = family.text_config(description).get("sliding_window")
    qefficient_values = {**values, symbols.SLIDING_WINDOW: int(window)} if window else values
    element = {DType.KV: kv_bytes, DType.STATE: state_bytes}
    table = family.language_table(description)
    sizes = {"ours": 0, "QEfficient": 0, "full ctx": 0}
    for layer, state in enumerate(table.layers):
        source = table.source_state(layer)  # QEfficient: every layer its own cache, shared or not
        sizes["ours"] += state.state_bytes(layer, values, element, symbols.BATCH_SIZE)
        sizes["QEfficient"] += source.state_bytes(layer, qefficient_values, element, symbols.BATCH_SIZE)
        sizes["full ctx"] += source.full_length().state_bytes(layer, values, element, symbols.BATCH_SIZE)
    return sizes


def report(config: Path, args) -> None:
    """Print one checkpoint's table."""
    description = describe_checkpoint(config.parent, config)
    family = family_for(description)
    dims = family.text_dims(description)
    states = family.layer_caches(description)
    windowed = sum(isinstance(state, SlidingRing) for state in states)
    chunked = sum(isinstance(state, ChunkedRing) for state in states)
    shared = sum(state.reads is not None for state in states)
    text = family.text_geometry(description)
    rings = f"sliding_window {text.sliding_window}"
    if chunked:
        rings = f"{chunked} chunked-attention layers, attention_chunk_size {text.attention_chunk_size}"
    print(
        f"{config.parent.name}: {dims.num_layers} layers ({windowed} window layers, {shared} read another "
        f"layer's cache, {rings}), {args.kv_bytes}-byte KV, batch {args.batch}"
    )
    cross = [state.length for state in states if isinstance(state, CrossAttention)]
    if cross:
        rows = family.request_symbols(description, args.images)[cross[0]]
        print(f"{len(cross)} cross-attention layers: {rows:,} K/V rows each for {args.images} image slot(s)")
    header = f"{'ctx_len':>8} {'ours MiB':>10} {'QEfficient MiB':>15} {'full ctx MiB':>13} {'ours/QEff':>10}"
    print(header)
    for ctx_len in args.ctx:
        sizes = layout_bytes(family, description, ctx_len, args.kv_bytes, args.batch, args.images)
        mib = {name: count / 2**20 for name, count in sizes.items()}
        assert sizes["ours"] <= sizes["QEfficient"], (ctx_len, sizes)
        print(
            f"{ctx_len:>8} {mib['ours']:>10.1f} {mib['QEfficient']:>15.1f} {mib['full ctx']:>13.1f} "
            f"{sizes['ours'] / sizes['QEfficient']:>10.3f}"
        )


def latent_layouts(family, description, kv_bytes: int) -> dict[str, int] | None:
    """Bytes per position over the latent layers per layout; None for a family without any.

    Ours: the family's ``LatentAttention`` states (``LayerState.bytes_per_position``). QEfficient's
    ``cache_compressed``: a ``LatentAttention`` state of its own default geometry per latent layer
    (one latent head: ``replicate_kv_heads`` off). Per-head K/V: keys [heads, qk_nope_head_dim +
    qk_rope_head_dim] and values [heads, v_head_dim] per position and layer.
    """
    latent = [state for state in family.layer_caches(description) if isinstance(state, LatentAttention)]
    if not latent:
        return None
    text = family.text_config(description)
    dims = family.language_dims(description)
    element = {DType.KV: kv_bytes, DType.STATE: 4}
    ours = sum(state.bytes_per_position(dims, element) for state in latent)
    qefficient = len(latent) * LatentAttention().bytes_per_position(dims, element)
    head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"] + text["v_head_dim"]
    per_head = len(latent) * text["num_attention_heads"] * head * kv_bytes
    return {"ours": ours, "QEfficient cache_compressed": qefficient, "per-head K/V": per_head}


def latent_configs(configs: list[Path]) -> list[Path]:
    """``configs`` and every pinned config (``specs/configs``) whose decoder has latent layers."""
    found = list(configs)
    given = {config.resolve() for config in configs}
    for config in sorted(PINNED.glob("*/config.json")):
        if config.resolve() in given:
            continue
        description = describe_checkpoint(config.parent, config)
        if any(isinstance(s, LatentAttention) for s in family_for(description).layer_caches(description)):
            found.append(config)
    return found


def latent_report(configs: list[Path], args) -> None:
    """The one MLA table: per checkpoint with latent layers, each layout's bytes per position and
    per sequence at each ``--mla-ctx`` (128k by default among them), from the pinned config through
    the state classes."""
    rows = []
    for config in latent_configs(configs):
        description = describe_checkpoint(config.parent, config)
        family = family_for(description)
        layouts = latent_layouts(family, description, args.kv_bytes)
        if layouts is not None:
            heads = family.text_config(description)["num_attention_heads"]
            rows.append((f"{config.parent.name} ({heads} heads)", layouts))
    if not rows:
        return
    print(f"multi-head latent attention layers, {args.kv_bytes}-byte KV, batch {args.batch}")
    at = "".join(f" {f'GiB at {ctx // 1024}k':>13}" for ctx in args.mla_ctx)
    print(f"{'checkpoint':<28} {'layout':<28} {'B/position':>11}{at} {'x ours':>7}")
    for name, layouts in rows:
        assert layouts["ours"] <= layouts["QEfficient cache_compressed"] < layouts["per-head K/V"], layouts
        for layout, per_position in layouts.items():
            sizes = "".join(f" {per_position * ctx * args.batch / 2**30:>13.2f}" for ctx in args.mla_ctx)
            print(
                f"{name:<28} {layout:<28} {per_position:>11,}{sizes} {per_position / layouts['ours']:>7.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, nargs="+", default=[DEFAULT_CONFIG])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--kv-bytes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=1, help="image slots (cross-attention families)")
    parser.add_argument("--mla-ctx", type=int, nargs="+", default=[32768, LONG_CONTEXT])
    parser.add_argument("--smoke", action="store_true", help="One context length (a quick check).")
    add_docs_arguments(parser)
    args = parser.parse_args()
    with recording(args, "kv_memory", None):
        if args.smoke:
            args.ctx, args.mla_ctx = args.ctx[:1], args.mla_ctx[-1:]
        for config in args.config:
            report(config, args)
            print()
        latent_report(args.config, args)


if __name__ == "__main__":
    main()
