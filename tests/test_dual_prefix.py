"""A dual conversation prefills only what follows the prefix its language program holds.

The registry-wide three-turn check (tests/test_family_harness.py) counts the prefilled tokens;
here, on the families whose caches cannot be rolled back (sliding-window rings: Gemma 3 and 4;
chunked-attention rings: Llama 4; recurrent state: Qwen3.5), on a plain one (LLaVA) and on the
cross-attention kind (mllama): decodes longer than the window, a history edited after the
fact, a reset conversation with another image and a failed turn, each turn token-identical to
transformers generate on the whole rendered conversation. Reuses the session exports.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_vision.errors import UserError
from qeff_vision.exporter import load_adapter
from qeff_vision.families.base import CROSS_ATTENTION
from qeff_vision.inputs.prompt import assistant_message
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from tests import helpers
from tests.family_runtime import CTX_LEN, LOGIT_TOLERANCE, FamilyRuntime

LONG = 12  # new tokens per turn: past the tiny Gemma window (8) and across a Llama 4 block (16)
FAMILIES = ["llava", "gemma3", "gemma4", "llama4", "qwen3_5", "mllama"]


def _ask(runtime: FamilyRuntime, chat: Conversation, images, text: str):
    """One turn, checked against transformers generate on the whole rendered conversation."""
    result = chat.ask(images, text, keep_logits=True)
    tokens, logits = helpers.hf_generate(runtime.model, chat.last_inputs.processed, LONG)
    assert result.tokens == tokens, f"{text!r}: tokens differ from transformers"
    worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(result.logits, logits))
    assert worst <= LOGIT_TOLERANCE, f"{text!r}: logits differ by {worst}"
    return result


def _kept(result) -> int:
    return result.prompt_tokens - result.prefilled_tokens


def _shared(held, chat: Conversation) -> int:
    """Leading tokens the last rendered conversation shares with what the program held before it."""
    ids = chat.last_inputs.processed["input_ids"].reshape(-1)
    limit = min(len(ids), len(held.tokens))
    differs = np.flatnonzero(ids[:limit] != held.tokens[:limit])
    return int(differs[0]) if len(differs) else limit


@pytest.fixture(params=FAMILIES)
def chat(request, exported, hf_model):
    family = request.param
    runtime = FamilyRuntime(family, exported(family), *hf_model(family))
    generator = runtime.generator([16, 64], "chunk", EmbeddingCache(16 * 2**20))
    return runtime, Conversation(generator, runtime.processor, max_new_tokens=LONG)


def test_edited_and_reset_histories_keep_only_what_the_program_holds(chat):
    runtime, chat = chat
    generator = chat.generator
    rings = bool(generator._unpositioned)  # caches that cannot be rolled back
    sizes = load_adapter(runtime.family).test_image_sizes
    first = _ask(runtime, chat, [helpers.image(*sizes[0], 5)], "Describe this picture.")
    held = generator.held
    assert first.prefilled_tokens == first.prompt_tokens
    assert (held.prompt_len, len(held.tokens)) == (first.prompt_tokens, first.prompt_tokens + LONG - 1)

    second = _ask(runtime, chat, [], "What colour dominates?")
    # A ring or a recurrent state resumes where it stopped or from its copy at the prompt's end.
    assert _kept(second) in ((held.prompt_len, len(held.tokens)) if rings else range(1, len(held.tokens) + 1))
    assert f"{_kept(second)} of {second.prompt_tokens} prompt tokens already held" in second.notes[-1]

    # The first reply edited: the history differs from what the program holds soon after the
    # first prompt, before the end of the last prompt (where a ring kept a copy): a ring starts
    # over, a positional cache keeps the tokens before the first difference.
    chat.messages[1] = assistant_message("An edited reply.")
    held = generator.held
    third = _ask(runtime, chat, [], "And now?")
    shared = _shared(held, chat)
    assert shared < held.prompt_len and first.prompt_tokens <= shared + 2
    assert _kept(third) == (0 if rings else shared)

    # A reset conversation with another image keeps at most the template's opening tokens (none
    # on mllama: its image set changed).
    chat.reset()
    held = generator.held
    fourth = _ask(runtime, chat, [helpers.image(*sizes[-1], 7)], "Hello.")
    _, spans = generator.prefix_images(chat.last_inputs.processed)
    cross = runtime.family.decoder_kind == CROSS_ATTENTION
    assert _kept(fourth) == (0 if rings or cross else min(_shared(held, chat), spans[0][0]))
    assert fourth.images_encoded == 1 and not any("held" in line for line in fourth.served)


def test_a_failed_turn_leaves_nothing_held(chat):
    runtime, chat = chat
    sizes = load_adapter(runtime.family).test_image_sizes
    _ask(runtime, chat, [helpers.image(*sizes[0], 5)], "Describe this picture.")
    with pytest.raises(UserError, match="exceeds the compiled ctx_len"):
        chat.ask([], "x " * CTX_LEN)
    assert chat.generator.held is None
    after = _ask(runtime, chat, [], "What colour dominates?")
    assert after.prefilled_tokens == after.prompt_tokens  # started over
    again = _ask(runtime, chat, [], "Thanks.")
    assert 0 < again.prefilled_tokens < again.prompt_tokens  # and holds a prefix again


def _extended(processed, ids: np.ndarray) -> dict:
    """``processed`` with its token ids replaced by the longer ``ids`` (text appended).

    Per-token inputs [1, L] grow with the text: the attention mask with ones, token type ids
    (Gemma 3's image marks, Qwen's modality marks) with zeros. mllama's cross-attention mask
    [1, L, images, tiles] repeats its last row, as transformers pads it for later tokens
    (``prepare_inputs_for_generation``).
    """
    length = processed["input_ids"].shape[-1]
    out = {}
    for name, value in processed.items():
        if name == "input_ids":
            out[name] = ids.reshape(1, -1)
        elif name == "cross_attention_mask":
            out[name] = np.concatenate([value, np.repeat(value[:, -1:], len(ids) - length, axis=1)], axis=1)
        elif getattr(value, "shape", None) is not None and value.ndim == 2 and value.shape == (1, length):
            fill = 1 if name == "attention_mask" else 0
            out[name] = np.concatenate([value, np.full((1, len(ids) - length), fill, value.dtype)], axis=1)
        else:
            out[name] = value
    return out


def test_a_prompt_that_continues_every_held_token_resumes_where_the_caches_stopped(chat):
    """The rings and the recurrent state are not rolled back: they continue after the decode."""
    runtime, chat = chat
    generator = chat.generator
    sizes = load_adapter(runtime.family).test_image_sizes
    processed = runtime.inputs(["<image>", "What is in this image?"], [helpers.image(*sizes[0], 5)])
    # A random tiny model may generate a placeholder id, which appended as prompt text would
    # read as an image: the first turn stops at one (unfed, so not among the held tokens).
    generator.eos_token_ids = {*generator.eos_token_ids, *generator.host.placeholder_ids()}
    first = generator.generate(processed, max_new_tokens=LONG, keep_prefix=True)
    held = generator.held
    # A decode to continue after (tiny Qwen3.5 opens every reply with its video placeholder: its
    # state continues from the prefill's end, where it stopped; its conversations above resume
    # from the copy kept there after 12 decode steps).
    assert len(held.tokens) > held.prompt_len + 2 or runtime.family.name == "qwen3_5", first.tokens
    more = runtime.processor.tokenizer(" And more?", add_special_tokens=False)["input_ids"]
    longer = _extended(processed, np.concatenate([held.tokens, more]).astype(np.int64))
    second = generator.generate(longer, max_new_tokens=LONG, keep_prefix=True, keep_logits=True)
    assert _kept(second) == len(held.tokens) and second.prefilled_tokens == len(more)
    tokens, logits = helpers.hf_generate(runtime.model, longer, LONG)
    assert second.tokens == tokens
    worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(second.logits, logits))
    assert worst <= LOGIT_TOLERANCE
