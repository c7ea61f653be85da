"""Chunk-aware generation on tiny Qwen2.5-VL: greedy tokens identical to transformers generate.

Every chunking edge case of the host protocol (docs/design.md, "Host protocol per prefill chunk"),
under both vision protocols. Each case checks on the chunk plan that the prompt really is the case
it names, then compares tokens and every step's logits. Logits matter: a random tiny model's
greedy tokens can survive wrong image rows (sending rows shifted by a chunk's offset moved the
logits by 4e-2 and kept all 8 tokens), so tokens alone would not catch a slicing bug. The ``full``
protocol needs buckets whose V holds every row of the prompt (``vision_size: max``), so it runs
with V = FULL_V.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.export_record import read_export
from qeff_vision.runtime.conversation import Conversation
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.generate import Generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers

FAMILY = "qwen2_5_vl"
NEW_TOKENS = 8
LOGIT_TOLERANCE = 1e-3
CTX_LEN = 512
FULL_V = 256
PROTOCOLS = ["chunk", "full"]


class Runtime:
    """The export's two sessions (loaded once) and transformers, with memoized reference tokens."""

    def __init__(self, export_dir, model, processor):
        manifest = read_export(export_dir)
        self.checkpoint = Checkpoint.open(manifest["model"], FAMILY)
        self.family, self.config = self.checkpoint.family, self.checkpoint.config
        self.vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
        self.language = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"])
        self.model, self.processor = model, processor
        self._references: dict[bytes, tuple[list[int], list[np.ndarray]]] = {}

    def generator(self, seq_lens, protocol: str, cache: EmbeddingCache | None = None) -> Generator:
        """V = S for ``chunk`` (the chunk policy), V = FULL_V for ``full``."""
        buckets = tuple(PrefillBucket(s, s if protocol == "chunk" else FULL_V) for s in seq_lens)
        shape = LanguageShape(buckets, max(b.vision_size for b in buckets), CTX_LEN)
        return Generator(self.checkpoint, self.vision, self.language, shape, cache)

    def reference(self, processed) -> tuple[list[int], list[np.ndarray]]:
        """transformers greedy tokens and logits for numpy processor outputs (memoized)."""
        key = b"".join(np.ascontiguousarray(value).tobytes() for value in processed.values())
        if key not in self._references:
            inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
            self._references[key] = helpers.hf_generate(self.model, inputs, NEW_TOKENS)
        return self._references[key]

    def forward_logits(self, processed, tokens) -> list[np.ndarray]:
        """Logits of one transformers forward over prompt + generated tokens (no KV cache)."""
        inputs = {name: torch.as_tensor(value) for name, value in processed.items()}
        new = torch.tensor([tokens[:-1]], dtype=torch.int64)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], new], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new)], dim=1)
        with torch.no_grad():
            logits = self.model(**inputs).logits[0, processed["input_ids"].shape[1] - 1 :]
        return list(logits.numpy())

    def check(self, result, processed, label: str, logits_from_forward: bool = False) -> None:
        """Tokens identical to transformers generate, every step's logits within tolerance.

        With ``logits_from_forward`` the logits are compared with one forward pass over the whole
        sequence instead of generate's incremental steps (see the very-end test for why).
        """
        tokens, logits = self.reference(processed)
        assert result.tokens == tokens, f"{label}: tokens differ from transformers"
        if logits_from_forward:
            logits = self.forward_logits(processed, tokens)
        worst = max(float(np.abs(ours - ref).max()) for ours, ref in zip(result.logits, logits))
        assert worst <= LOGIT_TOLERANCE, f"{label}: logits differ by {worst}"


@pytest.fixture(scope="module")
def runtime(exported, hf_model):
    return Runtime(exported(FAMILY), *hf_model(FAMILY))


def chat_inputs(runtime, parts, images):
    return helpers.as_numpy(helpers.process(runtime.processor, helpers.user_turn(*parts), images))


def generate(runtime, processed, seq_lens, protocol, logits_from_forward=False):
    generator = runtime.generator(seq_lens, protocol)
    plan = generator.plan(processed["input_ids"].reshape(-1), processed, protocol)
    result = generator.generate(processed, max_new_tokens=NEW_TOKENS, protocol=protocol, keep_logits=True)
    assert len(result.chunks) == len(plan.chunks)
    runtime.check(result, processed, protocol, logits_from_forward)
    return plan, result


def chunks_of_image(plan, image: int) -> list[int]:
    return [chunk.index for chunk in plan.chunks if image in chunk.images]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_straddling_two_chunks(runtime, protocol):
    processed = chat_inputs(runtime, ["<image>", "What is in the picture?"], [helpers.image(224, 224)])
    plan, result = generate(runtime, processed, [64], protocol)
    straddled = chunks_of_image(plan, 0)
    assert len(straddled) == 2
    if protocol == "chunk":
        rows = [result.chunks[index].rows for index in straddled]
        assert all(rows) and sum(rows) == 64, "each chunk sends its part of the image, once"
    else:
        assert all(result.chunks[index].rows == 64 for index in straddled)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_images_in_one_chunk(runtime, protocol):
    images = [helpers.image(112, 112, 1), helpers.image(112, 112, 2)]
    processed = chat_inputs(runtime, ["<image>", "<image>", "Same or different?"], images)
    plan, result = generate(runtime, processed, [128], protocol)
    assert any(chunk.images == (0, 1) for chunk in plan.chunks)
    assert result.images_encoded == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_image_then_a_text_only_chunk_then_a_second_image(runtime, protocol):
    text = "Look at the first picture closely, then at the second one, and tell me how they differ."
    images = [helpers.image(112, 112, 3), helpers.image(112, 112, 4)]
    processed = chat_inputs(runtime, ["<image>", text, "<image>", "Answer briefly."], images)
    plan, result = generate(runtime, processed, [32], protocol)
    first, second = chunks_of_image(plan, 0), chunks_of_image(plan, 1)
    if protocol == "chunk":
        between = plan.chunks[first[-1] + 1 : second[0]]
        assert between and all(chunk.images == () for chunk in between), "a text-only chunk between"
        assert all(result.chunks[c.index].rows == 0 for c in between)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_images_at_the_very_start_and_the_very_end(runtime, protocol):
    """No chat template: the prompt's first and last tokens are image placeholders.

    Tokens equal transformers generate. Logits are compared with transformers' forward over the
    whole sequence: for a prompt ending inside an image, transformers 5.x generate continues each
    M-RoPE row from the last prompt token's own position (+1 per step) instead of from the
    largest position, so its decode logits differ from its own forward by about 1e-3 (tokens
    unchanged here). Ours follow the forward's ``get_rope_index`` (max + 1) exactly.
    """
    images = [helpers.image(112, 112, 5), helpers.image(140, 196, 6)]
    processed = helpers.as_numpy(
        runtime.processor(
            text=["<|image_pad|>Describe both images.<|image_pad|>"], images=images, return_tensors="pt"
        )
    )
    plan, _ = generate(runtime, processed, [16, 32], protocol, logits_from_forward=True)
    assert plan.segments[0].start == 0
    assert plan.segments[-1].stop == plan.prompt_len


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prompt_shorter_than_one_chunk(runtime, protocol):
    processed = chat_inputs(runtime, ["<image>", "Hi"], [helpers.image(112, 112, 7)])
    plan, result = generate(runtime, processed, [256], protocol)
    assert len(plan.chunks) == 1 and plan.chunks[0].padding > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_last_chunk_is_padded(runtime, protocol):
    image = helpers.image(112, 112, 8)
    processed = chat_inputs(runtime, ["<image>", "Describe this image in detail."], [image])
    plan, result = generate(runtime, processed, [16, 32], protocol)
    assert len(plan.chunks) > 2
    assert all(chunk.padding == 0 for chunk in plan.chunks[:-1])
    assert plan.chunks[-1].padding > 0 and result.chunks[-1].tokens < result.chunks[-1].seq_len


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_images_of_different_resolutions(runtime, protocol):
    images = [helpers.image(112, 112, 9), helpers.image(140, 196, 10)]
    processed = chat_inputs(runtime, ["<image>", "and", "<image>", "Which is wider?"], images)
    plan, result = generate(runtime, processed, [32], protocol)
    assert [span.rows for span in plan.segments] == [16, 35]
    # One encoder call per resolution (two images, two resolutions).
    assert result.images_encoded == 2 and result.encoder_calls == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_three_turn_conversation_encodes_turn_one_image_once(runtime, protocol):
    cache = EmbeddingCache(16 * 2**20)
    chat = Conversation(
        runtime.generator([32, 64], protocol, cache), runtime.processor, max_new_tokens=NEW_TOKENS
    )
    first, second = helpers.image(112, 112, 11), helpers.image(140, 196, 12)
    turns = [([first], "Describe this picture."), ([], "What colour dominates?"), ([second], "Compare them.")]
    results = []
    for images, text in turns:
        result = chat.ask(images, text, keep_logits=True)
        runtime.check(result, chat.last_inputs.processed, f"{protocol}, turn {len(results) + 1}")
        results.append(result)
    assert [r.images for r in results] == [1, 1, 2]
    assert [r.images_encoded for r in results] == [1, 0, 1], "turn one's image is encoded once"
    # The language program holds turn one's image (KV) when turns two and three run: not fetched.
    assert [r.cache_hits for r in results] == [0, 0, 0]
    assert results[2].served[0] == "image 1: KV held from an earlier turn"
    assert cache.stats.images_encoded == 2 and cache.stats.encoder_calls == 2
    # The history holds the replies and is what the next turn renders.
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3
    assert chat.messages[1]["content"][0]["text"] == results[0].text
    assert results[0].text in chat.last_inputs.text


def test_failed_turn_leaves_the_history_unchanged(runtime):
    chat = Conversation(runtime.generator([32], "chunk"), runtime.processor, max_new_tokens=NEW_TOKENS)
    chat.ask([helpers.image(112, 112, 13)], "Hi")
    before = (list(chat.messages), list(chat.images))
    with pytest.raises(Exception, match="exceeds the compiled ctx_len"):
        chat.ask([], "x" * CTX_LEN)
    assert (chat.messages, chat.images) == before
