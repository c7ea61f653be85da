"""KV-cache bytes of the language program: ours (window layers as rings), QEfficient's layout, full ctx.

Usage: python benchmarks/kv_memory.py [--config specs/configs/gemma-3-4b-it/config.json]
                                      [--ctx 4096 8192 32768] [--kv-bytes 2] [--batch 1]

Ours comes from the family's declaration (``Family.kv_cache_symbols`` / ``kv_cache_lengths``), the
same data the exporter, the specializations and the runtime size caches from. QEfficient's layout
is computed from its rule (ref: QEfficient transformers/models/gemma3/modeling_gemma3.py,
``get_onnx_dynamic_axes`` and ``get_specializations``: sliding layers' cache axis is the symbol
``sliding_window``, bound to ``config.sliding_window`` in every specialization; other layers
``ctx_len``). Full ctx gives every self-attention layer ``ctx_len`` slots. Bytes count keys and
values of every layer for ``batch`` sequences at ``kv-bytes`` per element (2: the spec's float16 KV).

A cross-attention family's cross layers hold the vision K/V of ``--images`` image slots
(``Family.request_symbols``), the same rows in every layout (QEfficient pins them at export too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qeff_vision import symbols
from qeff_vision.families import describe_checkpoint, family_for

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "specs" / "configs" / "gemma-3-4b-it" / "config.json"


def kv_bytes_per_slot(dims, kv_bytes: int, batch: int) -> int:
    """Bytes one slot of one layer holds (key and value)."""
    return 2 * batch * dims.num_kv_heads * dims.head_dim * kv_bytes


def layouts(family, description, ctx_len: int, images: int = 1) -> dict[str, int]:
    """Slots over all layers per layout."""
    cache_symbols = family.kv_cache_symbols(description)
    lengths = {**family.kv_cache_lengths(description, ctx_len), **family.request_symbols(description, images)}
    window = family.text_config(description).get("sliding_window")
    self_attention = (symbols.CTX_LEN, symbols.SLIDING_WINDOW)

    def slots(symbol: str, self_slots: int) -> int:
        return self_slots if symbol in self_attention else lengths[symbol]

    return {
        "ours": sum(lengths[s] for s in cache_symbols),
        "QEfficient": sum(
            slots(s, int(window) if s == symbols.SLIDING_WINDOW else ctx_len) for s in cache_symbols
        ),
        "full ctx": sum(slots(s, ctx_len) for s in cache_symbols),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--kv-bytes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=1, help="image slots (cross-attention families)")
    args = parser.parse_args()
    description = describe_checkpoint(args.config.parent, args.config)
    family = family_for(description)
    dims = family.text_dims(description)
    cache_symbols = family.kv_cache_symbols(description)
    windowed = cache_symbols.count(symbols.SLIDING_WINDOW)
    print(
        f"{args.config.parent.name}: {dims.num_layers} layers ({windowed} window layers, "
        f"sliding_window {family.text_config(description).get('sliding_window')}), "
        f"{dims.num_kv_heads} KV heads x {dims.head_dim}, {args.kv_bytes}-byte KV, batch {args.batch}"
    )
    cross = [s for s in cache_symbols if s not in (symbols.CTX_LEN, symbols.SLIDING_WINDOW)]
    if cross:
        rows = family.request_symbols(description, args.images)[cross[0]]
        print(f"{len(cross)} cross-attention layers: {rows:,} K/V rows each for {args.images} image slot(s)")
    per_slot = kv_bytes_per_slot(dims, args.kv_bytes, args.batch)
    print(f"{'ctx_len':>8} {'ours MiB':>10} {'QEfficient MiB':>15} {'full ctx MiB':>13} {'ours/full':>10}")
    for ctx_len in args.ctx:
        slots = layouts(family, description, ctx_len, args.images)
        mib = {name: count * per_slot / 2**20 for name, count in slots.items()}
        assert slots["ours"] <= slots["QEfficient"], (ctx_len, slots)
        print(
            f"{ctx_len:>8} {mib['ours']:>10.1f} {mib['QEfficient']:>15.1f} {mib['full ctx']:>13.1f} "
            f"{slots['ours'] / slots['full ctx']:>10.3f}"
        )


if __name__ == "__main__":
    main()
