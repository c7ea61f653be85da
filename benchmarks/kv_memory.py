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

A family with multi-head latent attention layers (Kimi-K2.5) also gets bytes per position and at
128k positions of three layouts: ours (``compressed_kv`` + ``k_pe``, ``LayerState.bytes_per_position``),
QEfficient's ``mla_absorption`` ``cache_compressed`` layout (the same rows), and per-head K/V as
transformers expands it and QEfficient caches it without ``cache_compressed`` (ref:
QEfficient transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py ``get_dummy_pkv_cache``:
keys [heads, qk_nope_head_dim + qk_rope_head_dim], values [heads, v_head_dim] per position).

A second table prints multi-head latent attention decoders (DeepSeek-V3 and Kimi-K2.5's text
configs, :data:`MLA_CONFIGS`) at ``--mla-ctx``: ours (the ``LatentAttention`` state's bytes per
position), QEfficient's ``cache_compressed`` layout and full per-head K/V.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qeff_vision import symbols
from qeff_vision.contract.language_io import DType
from qeff_vision.contract.states import ChunkedRing, CrossAttention, SlidingRing
from qeff_vision.contract.states.latent import KV_LORA_RANK, QK_ROPE_HEAD_DIM, LatentAttention
from qeff_vision.families import describe_checkpoint, family_for

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "specs" / "configs" / "gemma-3-4b-it" / "config.json"
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
    """Bytes per position over the latent layers per layout; None for a family without any."""
    latent = [state for state in family.layer_caches(description) if isinstance(state, LatentAttention)]
    if not latent:
        return None
    text = family.text_config(description)
    element = {DType.KV: kv_bytes, DType.STATE: 4}
    ours = sum(state.bytes_per_position(family.language_dims(description), element) for state in latent)
    head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"] + text["v_head_dim"]
    per_head = len(latent) * text["num_attention_heads"] * head * kv_bytes
    return {"ours": ours, "QEfficient cache_compressed": ours, "per-head K/V": per_head}


def latent_report(family, description, args) -> None:
    """The latent layers' bytes per position and per 128k-position sequence, per layout."""
    layouts = latent_layouts(family, description, args.kv_bytes)
    if layouts is None:
        return
    print(f"{'latent layers':<28} {'B/position':>11} {'GiB at 128k':>12} {'x ours':>7}")
    for name, per_position in layouts.items():
        at_long = per_position * LONG_CONTEXT * args.batch / 2**30
        print(f"{name:<28} {per_position:>11,} {at_long:>12.2f} {per_position / layouts['ours']:>7.1f}")


# Multi-head latent attention text configs (the published config.json values the cache depends on):
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3) and Kimi-K2.5's DeepSeek-V3 decoder (moonshotai/Kimi-K2.5
# text_config: 64 heads instead of 128).
MLA_CONFIGS = {
    "DeepSeek-V3": {
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
    "Kimi-K2.5": {
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
}


def mla_bytes(text: dict, ctx_len: int, kv_bytes: int, batch: int) -> dict[str, int]:
    """KV bytes of an MLA decoder: ours, QEfficient's two layouts, over every layer.

    Ours is the ``LatentAttention`` state's rows. QEfficient with ``mla_absorption``
    ``cache_compressed`` keeps the same ``compressed_kv.{i}`` / ``k_pe.{i}`` [batch, 1, ctx_len, width]
    (``get_dummy_pkv_cache``); without it, per-head ``past_key.{i}`` [batch, heads, ctx_len,
    qk_nope_head_dim + qk_rope_head_dim] and ``past_value.{i}`` [batch, heads, ctx_len, v_head_dim]:
    the full per-head K/V.
    """
    state = LatentAttention()
    values = {
        symbols.BATCH_SIZE: batch,
        symbols.CTX_LEN: ctx_len,
        KV_LORA_RANK: text["kv_lora_rank"],
        QK_ROPE_HEAD_DIM: text["qk_rope_head_dim"],
    }
    element = {DType.KV: kv_bytes}
    layers = text["num_hidden_layers"]
    ours = layers * state.state_bytes(0, values, element, symbols.BATCH_SIZE)
    compressed = layers * batch * ctx_len * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * kv_bytes
    key_width = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    per_head = (
        layers * batch * ctx_len * text["num_attention_heads"] * (key_width + text["v_head_dim"]) * kv_bytes
    )
    return {"ours": ours, "QEfficient compressed": compressed, "per-head K/V": per_head}


def mla_report(args) -> None:
    """Print the MLA table: bytes per position and totals at each context, ours against both layouts."""
    print(f"multi-head latent attention, {args.kv_bytes}-byte KV, batch {args.batch}")
    header = (
        f"{'model':>12} {'ctx_len':>8} {'B/pos/layer':>12} {'B/pos':>8} {'ours MiB':>10} "
        f"{'QEff compressed MiB':>20} {'per-head K/V MiB':>17} {'per-head/ours':>14}"
    )
    print(header)
    for name, text in MLA_CONFIGS.items():
        per_position = mla_bytes(text, 1, args.kv_bytes, args.batch)["ours"]  # every layer
        per_layer = per_position // text["num_hidden_layers"]
        for ctx_len in args.mla_ctx:
            sizes = mla_bytes(text, ctx_len, args.kv_bytes, args.batch)
            mib = {key: count / 2**20 for key, count in sizes.items()}
            assert sizes["ours"] == sizes["QEfficient compressed"] < sizes["per-head K/V"], sizes
            print(
                f"{name:>12} {ctx_len:>8} {per_layer:>12,} {per_position:>8,} {mib['ours']:>10,.1f} "
                f"{mib['QEfficient compressed']:>20,.1f} {mib['per-head K/V']:>17,.1f} "
                f"{sizes['per-head K/V'] / sizes['ours']:>14.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, nargs="+", default=[DEFAULT_CONFIG])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--kv-bytes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=1, help="image slots (cross-attention families)")
    parser.add_argument("--mla-ctx", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--smoke", action="store_true", help="One context length (a quick check).")
    args = parser.parse_args()
    if args.smoke:
        args.ctx, args.mla_ctx = args.ctx[:1], args.mla_ctx[:1]
    for config in args.config:
        report(config, args)
        description = describe_checkpoint(config.parent, config)
        latent_report(family_for(description), description, args)
        print()
    mla_report(args)


if __name__ == "__main__":
    main()
