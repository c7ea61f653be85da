"""Names of the symbolic ONNX dimensions shared by exporters, specializations and runtimes.

They are the contract between the exported graphs and the compiler's specialization files: a
specialization must bind exactly the symbols that appear in the graph, so every module refers to
these constants instead of repeating string literals.
"""

BATCH_SIZE = "batch_size"
# ``deployment: single`` (compile/single_program.py composes the vision graph into the language
# graph): the vision graph's image count there, and a fixed pixel side (InternVL's 448 px tiles)
# made symbolic so the side stays the encode signal.
NUM_IMAGES = "num_images"
PIXEL_SIDE = "pixel_side"
SEQ_LEN = "seq_len"
CTX_LEN = "ctx_len"
# Slot axis of a window layer's KV cache (QEfficient's name for Gemma 3's sliding layers).
SLIDING_WINDOW = "sliding_window"
# Slot axis of a chunked-attention layer's ring, min(ctx_len, attention_chunk_size) slots (QEfficient's
# name for Llama 4's RoPE layers).
CHUNK_CTX_LEN = "chunk_ctx_len"
# Compute-context length: the language input of this name (and its only axis) has as many elements
# as KV slots attention reads (QEfficient's name and mechanism).
COMP_CTX_LENGTHS = "comp_ctx_lengths"
VISION_BATCH_SIZE = "vision_batch_size"
# Continuous batching (QEfficient's names): KV caches hold ``full_batch_size`` sequence slots on
# dim 0; ``batch_index`` [batch_size, 1] names the slot of each row of a call. Prefill
# specializations also carry ``full_batch_exec_size`` (a specialization key, not a graph axis).
FULL_BATCH_SIZE = "full_batch_size"
FULL_BATCH_EXEC_SIZE = "full_batch_exec_size"
BATCH_INDEX = "batch_index"
# Specialization keys that name no graph dimension (the compiler reads them; QEfficient writes them).
SPECIALIZATION_ONLY = frozenset({FULL_BATCH_EXEC_SIZE})
VISION_SIZE = "vision_size"

# Language-program IO names (QEfficient-compatible, so vLLM's qaic backend can load our QPCs).
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
VISION_EMBEDS = "vision_embeds"
IMAGE_IDX = "image_idx"
LOGITS = "logits"
IMAGE_IDX_OUTPUT = "image_idx_output"
# Outputs of the pooling programs (spec ``task: embed`` / ``task: score``; contract/tasks.py).
EMBEDDINGS = "embeddings"
SCORES = "scores"
RETAINED_SUFFIX = "_RetainedState"
# A retained-state value inside a decoder-layer ONNX function (``compile.language.subfunctions``):
# the body is shared by every call, so it must not carry one layer's public retained name
# (ref: QEfficient ``utils/_utils.py`` ``_INTERNAL_RETAINED_STATE_SUFFIX``).
INTERNAL_RETAINED_SUFFIX = "_InternalRetainedState"
PIXEL_VALUES = "pixel_values"
# Each image's original (height, width), int64 [batch, 2] (the processor's and QEfficient's name).
# A graph that reads its values (LLaVA-NeXT) is fed, in generated inputs, the size of the
# image each vision specialization was built from.
IMAGE_SIZES = "image_sizes"
# Cross-attention decoder kind: which image (and which of its tiles) each token attends to,
# [batch, seq_len, max_num_images, tiles] (QEfficient's and transformers' mllama name).
CROSS_ATTENTION_MASK = "cross_attention_mask"
# Image slots of one request in a cross-attention program (QEfficient's mllama axis name).
MAX_NUM_IMAGES = "max_num_images"
# A cross-attention single program's [1] int64 input: the image slot the encoded images' K/V are
# written from (the images an earlier turn wrote stay in the slots before it). Ours; QEfficient's
# mllama single QPC has no such input (it re-encodes every image of every prompt).
FIRST_IMAGE_SLOT = "first_image_slot"


def past_key(layer: int) -> str:
    """Name of the key-cache input of decoder layer ``layer``."""
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    """Name of the value-cache input of decoder layer ``layer``."""
    return f"past_value.{layer}"


def conv_state(layer: int) -> str:
    """Name of the convolution-state input of linear-attention layer ``layer`` (QEfficient MoE's name)."""
    return f"conv_state.{layer}"


def recurrent_state(layer: int) -> str:
    """Name of the recurrent-state input of linear-attention layer ``layer`` (QEfficient MoE's name)."""
    return f"recurrent_state.{layer}"


def retained(name: str) -> str:
    """Output name the compiler pairs with input ``name`` to keep it resident on the device."""
    return f"{name}{RETAINED_SUFFIX}"
