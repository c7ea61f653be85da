"""Export wall time and peak RSS: the tiny checkpoint vs Qwen2.5-VL-3B's sizes with fewer layers.

Usage: python benchmarks/export_memory.py [--layers 2] [--vision-depth 4] [--work DIR]

Each export runs in a fresh subprocess so its peak RSS (ru_maxrss of the child) is its own. The
large configuration uses the published 3B widths (text hidden 2048, 16 heads / 2 KV heads, vocab
151,936; vision hidden 1280, 16 heads, out 2048) with random weights and few layers, which is what
bounds export memory: tracing uses small example shapes, so memory does not grow with image size.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXPORT = (
    "import sys; from qeff_vision.export.exporter import export_model;"
    "export_model(sys.argv[1], sys.argv[2], progress=None)"
)


def write_large(out: Path, layers: int, vision_depth: int) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        image_token_id=151655,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)


def measure(model_dir: Path, out_dir: Path) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", EXPORT, str(model_dir), str(out_dir)], check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qeff-export-bench-"))
    rows = []
    from qeff_vision import api

    tiny = api.tiny("qwen2_5_vl", work / "tiny", force=True)
    rows.append(("tiny (hidden 64, 2+2 layers)", *measure(tiny, work / "tiny-export")))
    large = work / "large"
    write_large(large, args.layers, args.vision_depth)
    label = f"3B widths ({args.layers} text + {args.vision_depth} vision layers)"
    rows.append((label, *measure(large, work / "large-export")))
    print(f"{'configuration':<44} {'export s':>9} {'peak RSS MB':>12}")
    for label, seconds, rss in rows:
        print(f"{label:<44} {seconds:>9.1f} {rss:>12.0f}")
    print("(note: ru_maxrss of children is the max over the children so far; rows are in increasing size)")


if __name__ == "__main__":
    main()
