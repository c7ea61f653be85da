"""Gemma 4's typed config view: every raw config read of the family, frozen in :class:`Gemma4Config`.

Read once per checkpoint through :mod:`qeff_vision.families.config_view` (a missing required field
is one line naming it; a default is stated once with its source and noted). Defaults are those of
transformers v5.23 ``Gemma4TextConfig`` / ``Gemma4Config`` / ``Gemma4ImageProcessor`` (ref:
models/gemma4/configuration_gemma4.py, image_processing_gemma4.py); a pinned config snapshot has no
processor config, so the processor's own defaults apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qeff_vision.contract.language_io import FULL_ATTENTION, SLIDING_ATTENTION
from qeff_vision.errors import UserError
from qeff_vision.families.config_view import ConfigReader, Section, TextGeometry

# Language fields the published configs may leave out (everything else of the text geometry is
# required: transformers always writes it and no default fits every Gemma 4 size).
TEXT_DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "sliding_window": 512,
}
TEXT_DEFAULTS_SOURCE = "transformers' Gemma4TextConfig default"
IMAGE_TOKEN_DEFAULT = 258_880
PROCESSOR_SOURCE = "transformers' Gemma4ImageProcessor default"
# Defaults of transformers v5.23 ``Gemma4ImageProcessor`` / ``Gemma4VisionConfig``.
PATCH_SIZE, POOLING_KERNEL_SIZE, MAX_SOFT_TOKENS = 16, 3, 280
# Every sixth layer is full when the config lists no layer types (Gemma4TextConfig.__post_init__).
FULL_EVERY = 6


def default_layer_types(num_layers: int) -> list[str]:
    """Every sixth layer full, the rest sliding (Gemma4TextConfig's rule when none are listed)."""
    return [SLIDING_ATTENTION if (i + 1) % FULL_EVERY else FULL_ATTENTION for i in range(num_layers)]


@dataclass(frozen=True)
class Gemma4Config:
    """The family's view of a checkpoint (per-layer cache shapes, KV sharing, image geometry).

    A config saved by transformers has ``per_layer_config`` (layer -> head_dim /
    num_key_value_heads overrides); a published one has ``global_head_dim`` and
    ``num_global_key_value_heads``, which :func:`read_gemma4_config` turns into the same overrides
    of the full layers.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...]
    num_kv_shared_layers: int
    bidirectional: str | None  # use_bidirectional_attention: None or "vision" ("all" is refused)
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int

    def reads(self, layer: int) -> int | None:
        """The layer whose cache ``layer`` reads, or None when it has its own.

        The last ``num_kv_shared_layers`` layers read the last earlier non-shared layer of their
        type (ref: configuration_gemma4.py, ``Gemma4TextConfig.kv_sharing_modes``).
        """
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer]
        producers = [i for i in range(first_shared) if self.layer_types[i] == kind]
        if not producers:
            raise UserError(f"shared layer {layer} ({kind}) has no earlier {kind} layer to read")
        return producers[-1]


def _layer_shapes(text: Section, types: Sequence[str], geometry: TextGeometry) -> list[tuple[int, int]]:
    """(KV heads, head dim) of every layer, from the saved or the published spelling.

    Saved by transformers: ``per_layer_config`` (layer -> ``head_dim`` / ``num_key_value_heads``
    overrides). Published: the full layers take ``global_head_dim`` and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``.
    """
    base = (geometry.num_kv_heads, geometry.head_dim)
    saved = text.sub("per_layer_config")
    if saved.data:
        shapes = []
        for layer in range(len(types)):
            override = saved.sub(str(layer))
            heads = override.optional("num_key_value_heads")
            dim = override.optional("head_dim")
            shapes.append((base[0] if heads is None else heads, base[1] if dim is None else dim))
        return shapes
    full_dim = text.default("global_head_dim", 512, int, TEXT_DEFAULTS_SOURCE)
    global_kv = text.optional("num_global_key_value_heads")
    full_heads = global_kv if text.optional("attention_k_eq_v", bool) and global_kv is not None else base[0]
    return [(full_heads, full_dim) if kind == FULL_ATTENTION else base for kind in types]


def read_gemma4_config(
    reader: ConfigReader, config: dict, processor: dict, geometry: TextGeometry, source: str
) -> Gemma4Config:
    """The view of one checkpoint from its configs and its already read text ``geometry``.

    Raises:
        UserError: A value of the wrong type, ``use_bidirectional_attention`` 'all', or layer types
            that do not match the layer count (one line each).
    """
    try:
        return _read(reader, config, processor, geometry, source)
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type
        raise UserError(f"{source}: unusable Gemma 4 config value ({exc})") from None


def _read(
    reader: ConfigReader, config: dict, processor: dict, geometry: TextGeometry, source: str
) -> Gemma4Config:
    top = reader.section(config)
    text, vision = top.sub("text_config"), top.sub("vision_config")
    image = reader.section(processor, "preprocessor_config")
    layers = geometry.num_layers
    types = list(geometry.layer_types)  # the last forced full (Gemma4.last_layer_type)
    bidirectional = text.optional("use_bidirectional_attention", str)
    if bidirectional == "all":
        raise UserError(
            f"{source}: use_bidirectional_attention 'all' (every token both ways, a halved "
            "window) is not a causal decoder; only None and 'vision' are supported"
        )
    if len(types) != layers:
        raise UserError(f"{source}: {len(types)} layer_types for {layers} layers")
    shapes = _layer_shapes(text, types, geometry)
    return Gemma4Config(
        hidden_size=geometry.hidden_size,
        num_layers=layers,
        num_heads=geometry.num_attention_heads,
        kv_heads=tuple(heads for heads, _ in shapes),
        head_dims=tuple(dim for _, dim in shapes),
        vocab_size=geometry.vocab_size,
        max_position_embeddings=geometry.max_position_embeddings,
        sliding_window=int(geometry.sliding_window or TEXT_DEFAULTS["sliding_window"]),
        layer_types=tuple(types),
        num_kv_shared_layers=int(text.optional("num_kv_shared_layers") or 0),
        bidirectional=bidirectional,
        patch_size=image.first(
            ((image, "patch_size"), (vision, "patch_size")), PATCH_SIZE, int, PROCESSOR_SOURCE
        ),
        pooling_kernel_size=vision.first(
            ((vision, "pooling_kernel_size"),),
            POOLING_KERNEL_SIZE,
            int,
            "transformers' Gemma4VisionConfig default",
        ),
        max_soft_tokens=image.first(((image, "max_soft_tokens"),), MAX_SOFT_TOKENS, int, PROCESSOR_SOURCE),
    )
