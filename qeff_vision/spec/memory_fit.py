"""What one device holds for a spec: weights and retained state bytes, for ``validate`` (issue 49).

Weights are counted from the checkpoint's safetensors headers (parameters x the stored bytes of
the target: 2 for ai100's float16 and ai200's bfloat16; ``-mxfp6-matmul`` compresses the
language program's matmul weights further, which is not counted here). They are known only when
the spec's model is a local directory. A program on N devices holds 1/N of each (tensor
slicing). State is every retained row of the language table at the spec's KV and state dtypes,
for ``full_batch_size`` slots or ``batch_size`` rows.

The device memory itself is not judged. Cloud AI 100's depends on the card. For ai200 no
per-device figure is published in the SDK documentation or QEfficient, so ``validate`` says that
instead of guessing.
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path
from typing import Any

from qeff_vision import symbols
from qeff_vision.contract.io_rows import DType
from qeff_vision.spec.hardware import AI200

STATE_ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
DEVICE_MEMORY_UNPUBLISHED = {
    AI200: "Cloud AI 200's memory per device is not published (SDK documentation, QEfficient): "
    "compare these figures with the device's own report (qaic-util -q)",
}


def checkpoint_parameters(model_dir: Path | None) -> int | None:
    """Floating-point parameters in a local checkpoint's safetensors files (headers only), or None."""
    if model_dir is None:
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype", "").startswith(("F", "BF")):
                total += prod(entry.get("shape", []))
    return total


def _state_bytes(spec: Any) -> int:
    from qeff_vision.families import get_family
    from qeff_vision.spec.deployment import KV_ELEMENT_BYTES

    family, model = get_family(spec.family), spec.model_description
    slots = spec.full_batch_size or spec.batch_size
    values = {
        symbols.BATCH_SIZE: slots,
        symbols.FULL_BATCH_SIZE: slots,
        **family.language_dims(model),
        **family.kv_cache_lengths(model, spec.ctx_len),
        **family.request_symbols(model, spec.vision.max_images),
    }
    options = spec.compile.language
    cb = spec.full_batch_size is not None
    table = family.language_table(
        model, continuous_batching=cb, retain_full_kv=spec.deployment.retain_full_kv
    )
    sizes = {
        DType.KV: KV_ELEMENT_BYTES[options.kv_cache_dtype],
        DType.STATE: STATE_ELEMENT_BYTES[options.state_dtype],
    }
    dim0 = symbols.FULL_BATCH_SIZE if cb else symbols.BATCH_SIZE
    return int(sum(state.state_bytes(layer, values, sizes, dim0) for layer, state in enumerate(table.layers)))


def _size(count: float) -> str:
    return f"{count / 2**30:,.2f} GiB" if count >= 2**30 else f"{count / 2**20:,.2f} MiB"


def memory_lines(spec: Any) -> list[str]:
    """``validate``'s lines: per device, weights (when the checkpoint is here) and retained state."""
    target = spec.compile.hardware
    devices = spec.compile.language.num_devices
    state = _state_bytes(spec)
    dtype = spec.compute_dtype("language")
    parameters = checkpoint_parameters(spec.model_dir)
    if parameters is None:
        weights = "weights: unknown until the checkpoint is local (the spec names a hub id)"
    else:
        weights = (
            f"weights {_size(parameters * 2 / devices)} ({parameters:,} parameters at 2 bytes, "
            f"{dtype}; before -mxfp6-matmul)"
        )
    line = (
        f"memory per device ({target}, language program on {devices} device(s)): {weights}; "
        f"retained state {_size(state / devices)} ({state // devices:,} bytes, "
        f"{spec.compile.language.kv_cache_dtype} KV)"
    )
    unpublished = DEVICE_MEMORY_UNPUBLISHED.get(target)
    return [line, *([f"fit not judged: {unpublished}"] if unpublished else [])]
