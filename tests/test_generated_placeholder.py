"""A generated image-placeholder id is an ordinary token, in its turn and the next (issue 15, item 2).

Per registered family, the tiny checkpoint's output layer is edited so greedy decoding emits the
image placeholder id: the placeholder's ``lm_head`` row becomes 1.5 times the row of the token the
unedited model chooses first, so it wins wherever that token's logit is positive. transformers
embeds a generated placeholder as a token (it merges image features only into the placeholders
the processor expanded); our decode steps send ``image_idx`` at the end of the rows, so the
generated one takes no row either.

References, both transformers' own ``generate`` (greedy, fp32, eager):
  * turn 1: ``generate`` on the processed prompt;
  * turn 2: ``generate`` continued from turn 1's ``past_key_values`` with the whole token history
    (turn-1 prompt, turn-1 tokens, the new turn's tokens) and no new images, which is how a
    transformers user continues a chat: the cache holds everything but the last generated token,
    so that token and the new turn are the uncached part. (Re-processing the history as text
    cannot serve: the processor counts the generated placeholder as an image slot and refuses the
    prompt.) Ours continues from turn 1's ``continuation`` the same way.
"""

from __future__ import annotations

import pytest
import torch

from qeff_vision import families, symbols
from qeff_vision.exporter import export_model
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers

CTX_LEN = 320
NEW_TOKENS = 8
NEXT_TURN = " And what else do you see there?"
# One bucket large enough for every tiny prompt keeps each family's images whole in one chunk.
BUCKETS = (PrefillBucket(16, 16), PrefillBucket(64, 64))


def _biased_checkpoint(family: str, source, directory):
    """The tiny checkpoint with the placeholder's output row favoured; (model, processor, placeholder id)."""
    model, processor = helpers.load_hf(source)
    placeholder = families.get_family(family).image_token_id(families.describe_checkpoint(source))
    inputs = _prompt(processor)
    head = model.get_output_embeddings().weight
    if placeholder >= head.shape[0]:  # Molmo2: image tokens sit in an input-only additional vocabulary
        pytest.skip(f"placeholder {placeholder} is outside the {head.shape[0]}-token output vocabulary")
    with torch.no_grad():
        first = int(model(**inputs).logits[0, -1].argmax())
        head[placeholder] = 1.5 * head[first]
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor, placeholder


def _prompt(processor):
    messages = helpers.user_turn("<image>", "Describe this picture.")
    return helpers.process(processor, messages, [helpers.image(64, 80, seed=3)])


def _generator(export_dir):
    common = {symbols.BATCH_SIZE: 1, symbols.VISION_BATCH_SIZE: 1, symbols.CTX_LEN: CTX_LEN}
    compiled = [{**common, symbols.SEQ_LEN: b.seq_len, symbols.VISION_SIZE: b.vision_size} for b in BUCKETS]
    compiled.append({**common, symbols.SEQ_LEN: 1, symbols.VISION_SIZE: BUCKETS[-1].vision_size})
    shape = LanguageShape(BUCKETS, BUCKETS[-1].vision_size, CTX_LEN)
    return generator_for_export(export_dir, shape, language_specializations=compiled)


def _hf_turns(model, inputs, next_ids):
    """transformers: turn 1 from the prompt, turn 2 continued from turn 1's cache."""
    with torch.no_grad():
        first = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True
        )
        history = torch.cat([first.sequences, next_ids], dim=1)
        # mllama: the prompt's cross_attention_mask, which generate pads with its last row for
        # every later token (prepare_inputs_for_generation), as it does within a turn.
        cross = {k: inputs[k] for k in ("cross_attention_mask",) if k in inputs}
        second = model.generate(
            input_ids=history,
            attention_mask=torch.ones_like(history),
            **cross,
            past_key_values=first.past_key_values,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
        )
    prompt = inputs["input_ids"].shape[1]
    return first.sequences[0, prompt:].tolist(), second.sequences[0, history.shape[1] :].tolist()


@pytest.mark.parametrize("family", [family.name for family in families.all_families()])
def test_a_generated_placeholder_stays_a_token_in_its_turn_and_the_next(family, tiny_checkpoint, tmp_path):
    model, processor, placeholder = _biased_checkpoint(family, tiny_checkpoint(family), tmp_path / "ckpt")
    inputs = _prompt(processor)
    next_ids = processor.tokenizer(NEXT_TURN, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected_first, expected_second = _hf_turns(model, inputs, next_ids)
    assert placeholder in expected_first[:-1], f"the edited checkpoint must emit {placeholder} mid-turn"

    export_model(tmp_path / "ckpt", tmp_path / "export", progress=None)
    generator = _generator(tmp_path / "export")
    first = generator.generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS)
    assert first.tokens == expected_first
    second = generator.generate(
        {"input_ids": next_ids.numpy()}, max_new_tokens=NEW_TOKENS, history=first.continuation
    )
    assert second.tokens == expected_second
