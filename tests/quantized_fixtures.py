"""Tiny checkpoints written in published quantized formats, with their dequantized references.

``write_quantized(dense_dir, out_dir, fmt)`` quantizes a tiny checkpoint's linear weights into
``fmt`` and writes it as the format's releases are laid out (config.json's
``quantization_config``, the format's tensor names); ``reference`` is a plain checkpoint holding
the same weights dequantized by the format's own reference, for transformers to run:

- ``fp8-block``: our writer of transformers' FineGrainedFP8 layout (per-block amax / 448, as
  ``Fp8Quantize._quantize_one``), dequantized by transformers' own ``_dequantize_fp8_weight``
  (transformers 5.23 dequantizes FP8 checkpoints on a CPU-only host through its quantizer's
  ``dequantize`` fallback, which needs ``accelerate``, absent here: the function is called directly).
- ``fp8-channel`` (``fbgemm_fp8``, Llama-4-Maverick's release format): per output channel, as
  transformers' ``FbgemmFp8Quantize.convert`` lays it out (fbgemm's kernels are GPU-only), the
  reference being its published formula ``q * scale``.
- ``ct-fp8-tensor``, ``ct-fp8-channel``, ``ct-int4``: quantized, compressed and decompressed by
  the ``compressed-tensors`` library itself (``calculate_qparams``, the registered compressor's
  ``compress`` / ``decompress``, ``QuantizationConfig.to_dict``).
- ``awq``, ``gptq``, ``gptq-act-order``, ``gptq8``: integers packed by our writers of AutoAWQ's
  ``WQLinear_GEMM.from_linear`` and AutoGPTQ's ``QuantLinear.pack``; the reference is
  ``(q - zero) * scale`` computed from the integers before packing.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FORMATS = (
    "fp8-block",
    "fp8-channel",
    "ct-fp8-tensor",
    "ct-fp8-channel",
    "ct-int4",
    "awq",
    "gptq",
    "gptq-act-order",
    "gptq8",
)
# Tensors never quantized in the published releases: embeddings, norms, routers, the head,
# convolutions and position tables.
DENSE = re.compile(r"embed|norm|lm_head|router|\.gate\.weight|pos_emb|positional|conv1d|\.bias$")
# Modules each fixture lists as not converted (kept dense although linear), to test the rule.
NOT_CONVERTED = re.compile(r"merger|multi_modal_projector|mm_projector|shared_expert")
BLOCK = (16, 32)  # small FP8 blocks, so the tiny widths hold several (and ragged edge) blocks
GROUP = 32  # compressed-tensors int4 group size (Kimi-K2.5's)
AWQ_GROUP = 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantizable(key: str, tensor: torch.Tensor, fmt: str, only: str | None = None) -> bool:
    """Whether the fixture stores ``key`` quantized in ``fmt`` (``only``: a pattern it must match)."""
    if DENSE.search(key) or NOT_CONVERTED.search(key) or not tensor.is_floating_point():
        return False
    if (only and not re.search(only, key)) or (fmt == "awq" and key.startswith("visual")):
        return False  # Qwen2.5-VL-7B-Instruct-AWQ keeps its vision tower in float16
    stacked = tensor.dim() == 3 and key.endswith(("gate_up_proj", "down_proj"))
    if fmt in ("fp8-block", "fp8-channel") and stacked:
        return True  # transformers' FP8 experts (FP8Experts, FbgemmFp8Llama4TextExperts) are stacked
    if tensor.dim() != 2 or not key.endswith(".weight"):
        return False
    rows, cols = tensor.shape
    if fmt == "ct-int4":
        return cols % 8 == 0
    if fmt == "awq":
        return rows % 8 == 0 and cols % AWQ_GROUP == 0
    if fmt.startswith("gptq"):
        return rows % 8 == 0 and cols % 8 == 0 and cols % AWQ_GROUP == 0
    return True


def write_quantized(
    dense_dir: Path, out_dir: Path, fmt: str, reference_dir: Path | None = None, only: str | None = None
) -> Path:
    """``dense_dir``'s linear weights stored in ``fmt`` at ``out_dir``, dequantized at ``reference_dir``.

    ``only``: a pattern of the tensors to quantize (Kimi-K2.5 quantizes its routed experts only).
    compressed-tensors groups must divide the rows: a tiny width that 32 does not divide gets 8.
    """
    state = {}
    for path in sorted(dense_dir.glob("*.safetensors")):
        state.update(load_file(path))
    stored, reference = {}, {}
    targets = sorted(k for k, t in state.items() if quantizable(k, t, fmt, only))
    group = GROUP if all(state[k].shape[-1] % GROUP == 0 for k in targets) else 8
    writer = tensor_writer(fmt, group)
    for key, tensor in state.items():
        if key in targets:
            parts, dense = writer(key, tensor.float())
            stored.update(parts)
            reference[key] = dense.to(tensor.dtype)
        else:
            stored[key] = tensor
            reference[key] = tensor
    config = json.loads((dense_dir / "config.json").read_text())
    _copy(
        dense_dir,
        out_dir,
        stored,
        {**config, "quantization_config": quantization_config(fmt, bool(only), group)},
    )
    if reference_dir is not None:
        _copy(dense_dir, reference_dir, reference, config)
    return out_dir


def _copy(dense_dir: Path, out_dir: Path, state: dict, config: dict) -> None:
    shutil.copytree(dense_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def tensor_writer(fmt: str, group: int = GROUP, block: tuple[int, int] = BLOCK):
    """``write(key, weight) -> (stored tensors, dequantized weight)`` of ``fmt``."""
    if fmt.startswith("ct-"):
        return _write_ct(fmt, group)
    if fmt == "fp8-block":
        return lambda key, weight: _write_fp8_block(key, weight, block)
    return WRITERS[fmt]


def real_width_form(fmt: str, reference_dir: Path, only: str | None = None, block=(128, 128), group=GROUP):
    """A :class:`~qeff_vision.real_width_stored.StoredForm` drawing a real-width checkpoint in ``fmt``.

    The published block (128 x 128) and group (32) sizes; ``only`` as in :func:`write_quantized`.
    """
    from qeff_vision.real_width_stored import StoredForm

    writer = tensor_writer(fmt, group, block)

    def write(key, tensor):
        if not quantizable(key, tensor, fmt, only):
            return None
        return writer(key, tensor.float())  # dequantized in float32: the reference is written so

    return StoredForm(write, quantization_config(fmt, bool(only), group, block), reference_dir)


def quantization_config(fmt: str, experts_only: bool, group: int = GROUP, block=BLOCK) -> dict:
    """The ``quantization_config`` a release in ``fmt`` carries (``experts_only``: Kimi-K2.5's targets)."""
    skip = ["lm_head", "merger", "multi_modal_projector", "mm_projector", "shared_expert"]
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": skip,
        }
    if fmt == "fp8-channel":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": skip}
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": AWQ_GROUP,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["visual"],
        }
    if fmt.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 8 if fmt == "gptq8" else 4,
            "group_size": AWQ_GROUP,
            "desc_act": fmt == "gptq-act-order",
            "sym": fmt != "gptq-act-order",
            "checkpoint_format": "gptq",
        }
    from compressed_tensors.quantization import QuantizationConfig

    scheme = _ct_scheme(fmt, group)
    # Targets as releases write them: a regular expression for the routed experts (Kimi-K2.5), the
    # class name otherwise; the ignore list names the linear layers left dense, one a regex.
    scheme.targets = ["re:.*mlp\\.experts\\.\\d+\\..*"] if experts_only else ["Linear"]
    ignore = ["lm_head", "re:.*(merger|multi_modal_projector|mm_projector|shared_expert).*"]
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=_ct_format(fmt),
        ignore=ignore,
        quantization_status="compressed",
    )
    return config.to_dict()


def _ct_scheme(fmt: str, group: int = GROUP):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if fmt == "ct-fp8-tensor":
        return preset_name_to_scheme("FP8", ["Linear"])  # static per-tensor activations
    if fmt == "ct-fp8-channel":
        return preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])  # dynamic per-token activations
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def _ct_format(fmt: str) -> str:
    return "pack-quantized" if fmt == "ct-int4" else "float-quantized"


def ct_compressor(fmt: str):
    """The compressed-tensors compressor registered for the fixture's format."""
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.load_from_registry(_ct_format(fmt))


def _write_ct(fmt: str, group: int):
    def write(key: str, weight: torch.Tensor):
        from compressed_tensors.quantization.utils import calculate_qparams

        scheme = _ct_scheme(fmt, group)
        args = scheme.weights
        if args.strategy == "tensor":
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        elif args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        scale, zero = calculate_qparams(low, high, args)
        compressor = ct_compressor(fmt)
        compressed = compressor.compress(
            {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme
        )
        dense = compressor.decompress(dict(compressed), scheme)["weight"]
        module = key.rsplit(".", 1)[0]
        return {f"{module}.{name}": value for name, value in compressed.items()}, dense.float()

    return write


def _write_fp8_block(key: str, weight: torch.Tensor, block=BLOCK):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    rows, cols = weight.shape[-2:]
    grid = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(*weight.shape[:-2], grid[-2] * block[0], grid[-1] * block[1])
    padded[..., :rows, :cols] = weight
    blocks = padded.unflatten(-2, (grid[-2], block[0])).unflatten(-1, (grid[-1], block[1]))
    scale = blocks.abs().amax((-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., grid rows, grid cols]
    expanded = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    quantized = (weight / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    dense = _dequantize_fp8_weight(quantized, scale, list(block), torch.float32)
    return {key: quantized, f"{key}_scale_inv": scale}, dense


def _write_fp8_channel(key: str, weight: torch.Tensor):
    if weight.dim() == 2:  # [out, in], one scale per row
        scale = weight.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        quantized = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {key: quantized, f"{key}_scale": scale}, quantized.float() * scale
    # Llama 4's stacked experts [experts, in, out]: one scale per output column, stored
    # [experts, 1, out] for gate_up_proj and [experts, out, 1] for down_proj (FbgemmFp8Quantize).
    columns = weight.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [experts, 1, out]
    quantized = (weight / columns).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    stored = columns if key.endswith("gate_up_proj") else columns.transpose(1, 2).contiguous()
    return {key: quantized, f"{key}_scale": stored}, quantized.float() * columns


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> [rows, cols / 8] int32, AutoAWQ's ``WQLinear_GEMM.from_linear`` loop."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (i * 4)
    return _to_int32(packed)


def pack_rows(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[rows, cols] -> [rows * bits / 32, cols] int32, AutoGPTQ's ``QuantLinear.pack`` qweight loop."""
    per = 32 // bits
    packed = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(per):
            packed[row] |= values[row * per + j].to(torch.int64) << (bits * j)
    return _to_int32(packed)


def pack_columns(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[rows, cols] -> [rows, cols * bits / 32] int32, the ``QuantLinear.pack`` qzeros loop."""
    return pack_rows(values.t().contiguous(), bits).t().contiguous()


def _asymmetric(
    transposed: torch.Tensor, groups: torch.Tensor, count: int, symmetric: bool = False, bits: int = 4
):
    """4-bit min/max quantization of [in, out] rows by group: (q [in, out], scale, zero [groups, out])."""
    maxq = 2**bits - 1
    scale = torch.empty(count, transposed.shape[1])
    zero = torch.empty(count, transposed.shape[1], dtype=torch.int64)
    for g in range(count):
        rows = transposed[groups == g]
        if symmetric:
            top = rows.abs().amax(0).clamp(min=1e-8)
            scale[g], zero[g] = 2 * top / maxq, (maxq + 1) // 2
        else:
            low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale[g] = ((high - low) / maxq).clamp(min=1e-8)
            zero[g] = torch.round(-low / scale[g]).clamp(0, maxq).to(torch.int64)
    scale = scale.half().float()  # stored in float16, as both writers do
    q = torch.clamp(torch.round(transposed / scale[groups]) + zero[groups], 0, maxq).to(torch.int64)
    return q, scale, zero


def _write_awq(key: str, weight: torch.Tensor):
    transposed = weight.t().contiguous()  # [in, out]
    groups = torch.arange(transposed.shape[0]) // AWQ_GROUP
    q, scale, zero = _asymmetric(transposed, groups, int(groups.max()) + 1)
    dense = ((q - zero[groups]).float() * scale[groups]).t()
    module = key.rsplit(".", 1)[0]
    parts = {
        f"{module}.qweight": pack_awq(q),
        f"{module}.qzeros": pack_awq(zero),
        f"{module}.scales": scale.half(),
    }
    return parts, dense


def _write_gptq(act_order: bool, bits: int = 4):
    def write(key: str, weight: torch.Tensor):
        transposed = weight.t().contiguous()  # [in, out]
        rows = transposed.shape[0]
        if act_order:  # rows quantized in a permuted order: groups of the permutation
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(rows))
            groups = torch.empty(rows, dtype=torch.int64)
            groups[order] = torch.arange(rows) // AWQ_GROUP
        else:
            groups = torch.arange(rows) // AWQ_GROUP
        q, scale, zero = _asymmetric(transposed, groups, int(groups.max()) + 1, not act_order, bits)
        dense = ((q - zero[groups]).float() * scale[groups]).t()
        module = key.rsplit(".", 1)[0]
        parts = {
            f"{module}.qweight": pack_rows(q, bits),
            # v1 stores zero - 1, -1 wrapping to all ones
            f"{module}.qzeros": pack_columns((zero - 1) & (2**bits - 1), bits),
            f"{module}.scales": scale.half(),
            f"{module}.g_idx": groups.to(torch.int32),
        }
        return parts, dense

    return write


WRITERS = {
    "fp8-block": _write_fp8_block,
    "fp8-channel": _write_fp8_channel,
    "awq": _write_awq,
    "gptq": _write_gptq(False),
    "gptq-act-order": _write_gptq(True),
    "gptq8": _write_gptq(False, 8),
}
