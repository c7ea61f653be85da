"""Real-width random checkpoints: a pinned config, every width kept, only depth, vocabulary, experts cut.

Tiny checkpoints (``qeff-vision tiny``) hide what only real widths show: constants big enough to be
stored out of line, real head dims and rope tables, vocabulary- and expert-sized buffers, the
memory a stage needs. A real-width checkpoint starts from a pinned ``config.json`` under
``specs/configs`` and keeps every width; it cuts

* depth: the text decoder keeps the first layer of every distinct kind (attention type, per-layer
  flags such as Llama 4's ``no_rope_layers``, membership in a layer list such as
  ``cross_attention_layers``, KV-sharing), at least two layers; the vision tower keeps two layers
  (or as many as a layer list whose length sets a width needs, e.g. mllama's
  ``intermediate_layers_indices``, which fixes ``vision_output_dim``); any other tower one layer;
* vocabulary: the family's tiny byte tokenizer (its special tokens keep their meaning: every token
  id of the config is the tiny checkpoint's);
* experts: ``top_k + 2`` experts (at least 4), so routing still chooses among experts.

Weights are random (seeded): every all-zero parameter is made random, then the family tiny
module's ``finish_random_weights`` runs if it has one (mllama's opened gates). The model is built
in ``dtype`` (float32 by default; a published checkpoint's own dtype, e.g. bfloat16, halves the
build's memory) and saved in shards of :data:`SHARD_SIZE`, so the build holds the model once plus
one shard's serialized copy (a single-file save would add a second copy of every weight). Tokenizer and
processor are the tiny checkpoint's, with the pinned ``preprocessor_config.json`` over the image
processor, so images are resized and tokenized as the real checkpoint does. The result is saved
like a real checkpoint (config, safetensors, tokenizer, processor) and loads with
``from_pretrained``. Everything here imports torch and transformers lazily; picking a pinned
config is torch-free.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from qeff_vision.real_width_stored import StoredForm, copy_side_files, save_stored

#: The pinned configs of the repository (``specs/configs/<checkpoint>/config.json``).
PINNED_CONFIGS = Path(__file__).resolve().parent.parent / "specs" / "configs"

# Keys counting a tower's layers (Qwen vision towers say ``depth``).
_DEPTH_KEYS = ("num_hidden_layers", "depth")
# Lists of layer indices. A layer kept keeps its membership; indices follow the kept layers.
_LAYER_LISTS = (
    "cross_attention_layers",
    "moe_layers",
    "mlp_only_layers",
    "fullatt_block_indexes",
    "deepstack_visual_indexes",
    "intermediate_layers_indices",
    "rope_scaling_layers",  # Molmo2: the layers whose RoPE is scaled
)
# Layer lists whose length is a width or an IO count (mllama's vision_output_dim is the hidden
# size times one plus the intermediate layers; Qwen3-VL's deepstack count is the number of
# deepstack feature rows): their every entry is kept, on consecutive layers.
_COUNTED_LAYER_LISTS = ("intermediate_layers_indices", "deepstack_visual_indexes")
# Per-layer overrides keyed by layer index (transformers' heterogeneous configs).
_LAYER_MAPS = ("per_layer_config",)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "num_experts_per_token")
# Config keys naming token ids or the vocabulary: taken from the tiny checkpoint (Molmo2 names its
# image tokens ``image_patch_id`` / ``image_col_id`` / ``image_low_res_id`` and sizes its input-only
# image vocabulary with ``additional_vocab_size``).
_TOKEN_KEY = re.compile(
    r"(token_ids?|token_index|token_indices|^image_\w+_id)$|^vocab_size|^additional_vocab_size$"
)
# Sections that hold ``vision_feature_layer`` besides the top level (Molmo2's adapter).
_FEATURE_LAYER_SECTIONS = ("adapter_config",)
# Files of the tiny checkpoint that are its weights or configs, not its tokenizer/processor.
_MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|model.*\.safetensors(\.index\.json)?)$")
_PROCESSOR_FILE = "processor_config.json"
_PREPROCESSOR_FILE = "preprocessor_config.json"
# Image-processor keys that are the processor's own, not the image processor's.
_PROCESSOR_ONLY_KEYS = ("processor_class", "image_seq_length")
#: Largest safetensors shard the build writes: ``save_pretrained`` serializes a shard in memory
#: before writing it, so this bounds what the save adds to the model's own size.
SHARD_SIZE = "256MB"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_MIN_TEXT_LAYERS = 2
_VISION_LAYERS = 2
_OTHER_TOWER_LAYERS = 1


def pinned_configs(family_name: str) -> list[Path]:
    """Every pinned ``config.json`` whose architecture or model type belongs to ``family_name``."""
    from qeff_vision.families import get_family

    family = get_family(family_name)
    found = []
    for path in sorted(PINNED_CONFIGS.glob("*/config.json")):
        config = json.loads(path.read_text())
        if set(config.get("architectures") or ()) & set(family.architectures) or (
            config.get("model_type") in family.model_types
        ):
            found.append(path)
    return found


def smallest_pinned_config(family_name: str) -> Path:
    """The pinned config of ``family_name`` with the narrowest decoder (then the fewest experts).

    Raises:
        LookupError: No pinned config belongs to the family.
    """
    candidates = pinned_configs(family_name)
    if not candidates:
        raise LookupError(f"no pinned config under {PINNED_CONFIGS} belongs to family {family_name!r}")

    def size(path: Path) -> tuple[int, int, str]:
        config = json.loads(path.read_text())
        text = config.get("text_config") or config
        experts = max((int(text.get(key) or 0) for key in _EXPERT_KEYS), default=0)
        return int(text.get("hidden_size") or 0), experts, path.parent.name

    return min(candidates, key=size)


def build_real_width_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    config: str | Path | None = None,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    stored: StoredForm | None = None,
) -> Path:
    """Write a real-width random checkpoint of ``family`` to ``out_dir`` (absent or empty), atomically.

    Args:
        family: A registered family name.
        out_dir: Output directory.
        config: A pinned ``config.json`` (or its directory); the family's smallest by default.
        text_layers: Decoder layers; by default the first layer of every distinct kind (at least
            two). More layers add the following ones of the pinned layout in order.
        vision_layers: Vision tower layers (2 by default, more when a counted layer list needs it).
        num_experts: Experts per MoE layer (``top_k + 2``, at least 4, by default).
        vocab_size: Vocabulary size; the tiny tokenizer's by default. A larger one pads the
            embedding with ids no tokenizer produces; it may not be smaller than the tokenizer.
        dtype: Floating dtype the weights are drawn and saved in (``float32``, ``bfloat16`` or
            ``float16``). Export and transformers' reference load them in float32 either way.
        seed: Seed of the random weights.
        stored: Draw the checkpoint as a release stores it (the published layout, quantized
            weights; :mod:`qeff_vision.real_width_stored`), its dequantized copy beside.

    Returns:
        ``out_dir``.
    """
    from qeff_vision.checkpoint import quiet_transformers
    from qeff_vision.families import get_family
    from qeff_vision.fsutil import is_nonempty_dir, staged_directory

    quiet_transformers()
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_FLOAT_DTYPES)}, not {dtype!r}")
    family_obj = get_family(family)
    config_path = Path(config) if config is not None else smallest_pinned_config(family)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    out_dir = Path(out_dir)
    if is_nonempty_dir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty")
    with staged_directory(out_dir) as staging:
        _write_checkpoint(
            family_obj,
            config_path,
            staging,
            text_layers,
            vision_layers,
            num_experts,
            vocab_size,
            dtype,
            seed,
            stored,
        )
    if stored is not None:
        copy_side_files(out_dir, stored.reference_dir)
    return out_dir


def cut_pinned_config(family: str, config: str | Path, **cuts: int | None) -> dict[str, Any]:
    """The cut ``config.json`` of a pinned config (a path to it or its directory) as a dict.

    What :func:`build_real_width_checkpoint` writes beside its weights, for callers that write
    their own weights (``benchmarks/moe_decode.py`` streams float16 tensors): the pinned config
    through transformers' config class (its defaults filled in), cut by :func:`cut_config` with
    ``cuts`` (``text_layers``, ``vision_layers``, ``num_experts``, ``vocab_size``), the token ids
    those of ``family``'s tiny checkpoint.
    """
    from qeff_vision.checkpoint import quiet_transformers
    from qeff_vision.families import get_family

    quiet_transformers()
    config_path = Path(config)
    directory = config_path if config_path.is_dir() else config_path.parent
    with tempfile.TemporaryDirectory(prefix="qeff-real-width-") as scratch:
        tiny_dir = Path(scratch) / "tiny"
        get_family(family).write_tiny_checkpoint(tiny_dir, 0)
        tiny_config = json.loads((tiny_dir / "config.json").read_text())
    return _cut_pinned(directory, tiny_config, **cuts)[1]


def _cut_pinned(
    directory: Path, tiny_config: dict[str, Any], **cuts
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pinned config in ``directory`` through transformers' config class, and its cut."""
    import transformers

    full = transformers.AutoConfig.from_pretrained(directory).to_dict()
    return full, cut_config(full, tiny_config, **cuts)


def _write_checkpoint(
    family_obj,
    config_path,
    out_dir,
    text_layers,
    vision_layers,
    num_experts,
    vocab_size,
    dtype,
    seed,
    stored=None,
):
    """:func:`build_real_width_checkpoint`'s writing, into the staging directory ``out_dir``."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="qeff-real-width-") as scratch:
        tiny_dir = Path(scratch) / "tiny"
        family_obj.write_tiny_checkpoint(tiny_dir, seed)
        tiny_config = json.loads((tiny_dir / "config.json").read_text())
        full, cut = _cut_pinned(
            config_path.parent,
            tiny_config,
            text_layers=text_layers,
            vision_layers=vision_layers,
            num_experts=num_experts,
            vocab_size=vocab_size,
        )
        (Path(scratch) / "config.json").write_text(json.dumps(cut, indent=2))
        model_config = transformers.AutoConfig.from_pretrained(scratch)
        # A published config may name its remote-code class (Kimi-K2.5's KimiK25ForConditionalGeneration):
        # transformers' own class is the tiny checkpoint's.
        architecture = getattr(transformers, cut["architectures"][0], None) or getattr(
            transformers, tiny_config["architectures"][0]
        )
        torch.manual_seed(seed)
        # Drawn in ``dtype`` directly: a float32 model cast afterwards would be held twice.
        model = architecture._from_config(model_config, dtype=getattr(torch, dtype)).eval()
        randomize_zero_parameters(model, std=float(full.get("initializer_range") or 0.02))
        finish = _family_finish(family_obj)
        if finish is not None:
            finish(model)
        if stored is None:
            model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=SHARD_SIZE)
        else:
            save_stored(family_obj, model, out_dir, stored)
        del model
        for item in tiny_dir.iterdir():
            if not _MODEL_FILES.match(item.name) and item.name not in (_PROCESSOR_FILE, _PREPROCESSOR_FILE):
                shutil.copy2(item, out_dir / item.name)
        # The tiny generation config names the tiny tokenizer's stop and padding ids.
        shutil.copy2(tiny_dir / "generation_config.json", out_dir / "generation_config.json")
        pinned_processor = config_path.parent / _PREPROCESSOR_FILE
        pinned = json.loads(pinned_processor.read_text()) if pinned_processor.exists() else {}
        _write_processor(tiny_dir, out_dir, pinned, cut)


def cut_config(
    full: dict[str, Any],
    tiny: dict[str, Any],
    *,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """The pinned config ``full`` (a transformers ``to_dict``) with depth, experts and vocabulary cut.

    ``tiny`` is the family's tiny ``config.json``: its token ids and vocabulary replace the pinned
    ones section by section (top level, ``text_config``, ...).
    """
    cut = json.loads(json.dumps(full))
    text = cut.get("text_config") if isinstance(cut.get("text_config"), dict) else cut
    for key, section in list(cut.items()):
        if not isinstance(section, dict) or not any(k in section for k in _DEPTH_KEYS):
            continue
        if section is text:
            continue
        wanted = vision_layers if key == "vision_config" else None
        default = _VISION_LAYERS if key == "vision_config" else _OTHER_TOWER_LAYERS
        feature_layers = (
            _feature_layer_holder(cut).get("vision_feature_layer") if key == "vision_config" else None
        )
        if isinstance(feature_layers, list):
            # Each listed hidden state is a slice of the projector's input: keep them all distinct.
            default = max(default, len(feature_layers) - 1)
        _cut_tower(section, wanted, default)
    _cut_text(text, text_layers)
    _cut_experts(text, num_experts)
    _take_token_ids(cut, tiny)
    if vocab_size is not None:
        for section in _sections(cut):
            for key in [k for k in section if k.startswith("vocab_size")]:
                if vocab_size < int(section[key]):
                    raise ValueError(
                        f"vocab_size {vocab_size} is smaller than the tokenizer's {section[key]}"
                    )
                section[key] = vocab_size
    _cut_feature_layers(cut)
    return cut


def randomize_zero_parameters(model, *, std: float) -> None:
    """Give every all-zero parameter random values.

    transformers zero-initializes what gates or adds a path (projector weights, tanh gates,
    offset-norm weights): left at zero in a random checkpoint, an image would embed to zeros or
    a cross-attention layer add nothing, and a test could not see a wrong row. A one-element gate
    gets a spread of 0.5 (tanh of it is clearly non-zero); a tensor ``std`` (the config's
    ``initializer_range``).
    """
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and not parameter.any():
                parameter.normal_(0.0, 0.5 if parameter.numel() == 1 else std)


def _family_finish(family):
    """The family's ``finish_random_weights(model)``, if its tiny builder's module has one.

    The tiny builder knows what the family's random weights need besides (gates opened, norms at
    a trained scale); the real-width checkpoint gets the same.
    """
    import inspect

    module = inspect.getmodule(family.parts.tiny) if family.parts else None
    return getattr(module, "finish_random_weights", None)


# ---- depth ----


def _layer_count(section: dict[str, Any]) -> tuple[str, int]:
    key = next(k for k in _DEPTH_KEYS if isinstance(section.get(k), int))
    return key, int(section[key])


def _layer_maps(section: dict[str, Any]) -> list[str]:
    """Keys of per-layer maps present: dicts keyed by layer index (Gemma 4's keys are "04")."""
    return [name for name in _LAYER_MAPS if isinstance(section.get(name), dict)]


def _reindex(section: dict[str, Any], keep: Sequence[int], total: int) -> None:
    """Keep layers ``keep`` (original indices, ascending) of a tower of ``total`` layers."""
    key, _ = _layer_count(section)
    section[key] = len(keep)
    for name in _layer_maps(section):
        by_index = {int(k): v for k, v in section[name].items()}
        section[name] = {str(position): by_index[i] for position, i in enumerate(keep) if i in by_index}
    for name, value in list(section.items()):
        if isinstance(value, list) and len(value) == total and name not in _LAYER_LISTS:
            section[name] = [value[i] for i in keep]  # a per-layer list (layer_types, no_rope_layers)
    for name in _LAYER_LISTS:
        if isinstance(section.get(name), list):
            members = set(section[name])
            section[name] = [position for position, index in enumerate(keep) if index in members]


def _layer_signature(section: dict[str, Any], index: int, total: int) -> tuple:
    per_layer = tuple(
        (name, json.dumps(value[index]))
        for name, value in sorted(section.items())
        if isinstance(value, list) and len(value) == total and name not in _LAYER_LISTS
    )
    lists = tuple(
        name for name in _LAYER_LISTS if isinstance(section.get(name), list) and index in section[name]
    )
    maps = tuple(
        (name, json.dumps(v, sort_keys=True))
        for name in _layer_maps(section)
        for k, v in section[name].items()
        if int(k) == index
    )
    shared = int(section.get("num_kv_shared_layers") or 0)
    return per_layer, lists, maps, index >= total - shared


def _cut_text(text: dict[str, Any], layers: int | None) -> None:
    _, total = _layer_count(text)
    first_of_kind: dict[tuple, int] = {}
    for index in range(total):
        first_of_kind.setdefault(_layer_signature(text, index, total), index)
    keep = sorted(first_of_kind.values())
    wanted = max(layers or 0, _MIN_TEXT_LAYERS if layers is None else 1)
    if layers is not None and layers < len(keep):
        keep = keep[:layers]
    extra = (i for i in range(total) if i not in keep)
    keep = sorted(keep + [next(extra) for _ in range(min(wanted, total) - len(keep))])
    shared = int(text.get("num_kv_shared_layers") or 0)
    if shared:
        text["num_kv_shared_layers"] = sum(index >= total - shared for index in keep)
    _reindex(text, keep, total)


def _cut_tower(section: dict[str, Any], layers: int | None, default: int) -> None:
    _, total = _layer_count(section)
    counted = max(
        (len(section[k]) for k in _COUNTED_LAYER_LISTS if isinstance(section.get(k), list)), default=0
    )
    wanted = min(total, layers if layers is not None else max(default, counted))
    if counted > wanted:
        raise ValueError(f"{counted} listed layers need at least {counted} tower layers, not {wanted}")
    # Pattern lists (Qwen2.5-VL's full-attention blocks): keep the tower's mix of kinds by moving
    # the first listed layer to the last kept one.
    for name in _LAYER_LISTS:
        value = section.get(name)
        if not isinstance(value, list) or not value:
            continue
        if name in _COUNTED_LAYER_LISTS:
            section[name] = [i - len(value) + wanted for i in range(len(value))]
        elif not any(index < wanted for index in value):
            section[name] = [wanted - 1]
        else:
            section[name] = [index for index in value if index < wanted]
    _reindex_maps_prefix(section, wanted)
    key, _ = _layer_count(section)
    section[key] = wanted
    for name, value in list(section.items()):
        if isinstance(value, list) and len(value) == total and name not in _LAYER_LISTS:
            section[name] = value[:wanted]
    # mllama's tower has a second stack of global layers.
    if isinstance(section.get("num_global_layers"), int):
        section["num_global_layers"] = min(section["num_global_layers"], 1)


def _reindex_maps_prefix(section: dict[str, Any], layers: int) -> None:
    for name in _layer_maps(section):
        section[name] = {k: v for k, v in section[name].items() if int(k) < layers}


def _cut_feature_layers(config: dict[str, Any]) -> None:
    """Hidden-state indices into the vision tower (``vision_feature_layer``) that the cut removed.

    Negative indices count from the tower's last hidden state; a list keeps its length (the
    projector's input width is the tower width times that length), on the last states.
    """
    vision, config = config.get("vision_config"), _feature_layer_holder(config)
    if not isinstance(vision, dict) or "vision_feature_layer" not in config:
        return
    _, layers = _layer_count(vision)
    states = layers + 1  # the embeddings and one state per layer
    value = config["vision_feature_layer"]
    if isinstance(value, list):
        if len(value) > states:
            raise ValueError(
                f"vision_feature_layer {value} needs {len(value) - 1} vision layers, not {layers}"
            )
        if any(index < -states or index >= states for index in value):
            config["vision_feature_layer"] = list(range(-len(value), 0))
    elif isinstance(value, int) and not -states <= value < states:
        config["vision_feature_layer"] = -1


def _feature_layer_holder(config: dict[str, Any]) -> dict[str, Any]:
    """The section naming ``vision_feature_layer``: the top level, or a sub-config that holds it."""
    for name in _FEATURE_LAYER_SECTIONS:
        section = config.get(name)
        if (
            "vision_feature_layer" not in config
            and isinstance(section, dict)
            and "vision_feature_layer" in section
        ):
            return section
    return config


# ---- experts and vocabulary ----


def _cut_experts(text: dict[str, Any], experts: int | None) -> None:
    for key in _EXPERT_KEYS:
        if not text.get(key):
            continue
        top_k = max((int(text.get(k) or 0) for k in _TOP_K_KEYS), default=0)
        wanted = experts if experts is not None else max(4, top_k + 2)
        if wanted < top_k:
            raise ValueError(f"num_experts {wanted} is fewer than the {top_k} routed per token")
        text[key] = min(int(text[key]), wanted)


def _sections(config: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield config
    for value in config.values():
        if isinstance(value, dict):
            yield value


def _take_token_ids(config: dict[str, Any], tiny: dict[str, Any]) -> None:
    """Every token id and vocabulary size of ``config`` becomes the tiny checkpoint's (per section)."""
    for name, section in [("", config)] + [(k, v) for k, v in config.items() if isinstance(v, dict)]:
        source = tiny if not name else tiny.get(name)
        if not isinstance(source, dict):
            source = {}
        for key in [k for k in section if _TOKEN_KEY.search(k)]:
            if key in source:
                section[key] = source[key]
            else:
                del section[key]  # an id of the real tokenizer the tiny one does not have


# ---- processor ----


def _write_processor(tiny_dir: Path, out_dir: Path, pinned: dict[str, Any], config: dict[str, Any]) -> None:
    """The tiny processor with the pinned image-processor settings (and processor geometry) over it."""
    processor = json.loads((tiny_dir / _PROCESSOR_FILE).read_text())
    settings = {k: v for k, v in pinned.items() if k not in _PROCESSOR_ONLY_KEYS}
    if isinstance(processor.get("image_processor"), dict):
        processor["image_processor"].update(settings)
    video = processor.get("video_processor")
    if isinstance(video, dict):
        # The video processor shares the patch geometry, not the image size bounds.
        video.update(
            {k: v for k, v in settings.items() if k in video and k not in ("size", "image_processor_type")}
        )
    for key in list(processor):
        if isinstance(processor[key], dict):
            continue
        if key in pinned and key != "processor_class":
            processor[key] = pinned[key]
        elif key in config and not isinstance(config[key], dict):
            processor[key] = config[key]
    (out_dir / _PROCESSOR_FILE).write_text(json.dumps(processor, indent=2) + "\n")
