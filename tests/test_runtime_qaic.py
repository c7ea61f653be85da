"""QaicProgram and the generator's device path, against a test double of the SDK runtime.

The double (tests/device_double) runs stand-in QPCs on onnxruntime and keeps retained state
resident like a device. This checks what the host sends (no KV cache, no decode vision_embeds)
and that generation through QaicProgram still matches transformers token for token.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from qeff_vision.runtime import session
from qeff_vision.runtime.artifacts import generator_for_artifacts
from qeff_vision.runtime.session import QaicProgram
from tests import helpers
from tests.compile_fixtures import stand_in

FAMILY = "qwen2_5_vl"
DOUBLE = Path(__file__).with_name("device_double")


@pytest.fixture
def device_runtime(monkeypatch):
    """Make the SDK-runtime double importable as ``qaicrt`` / ``QAicApi_pb2`` for one test."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    for name in ("qaicrt", "QAicApi_pb2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    qaicrt = importlib.import_module("qaicrt")
    yield qaicrt
    for name in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def qaic_out(tmp_path_factory, tiny_checkpoint, exported):
    """A tiny spec compiled with the stand-in compiler (backend qaic, two buckets, two resolutions)."""
    from qeff_vision import api

    root = tmp_path_factory.mktemp("qaic-compiled")
    compiler, _ = stand_in(root)
    spec = {
        "name": "qaic-tiny",
        "model": str(tiny_checkpoint(FAMILY)),
        "ctx_len": 256,
        "prefill": {"seq_lens": [16, 32]},
        "vision": {
            "images": [{"height": 112, "width": 112}, {"height": 140, "width": 196}],
            "vision_size": "chunk",
        },
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(
        root / "spec.yaml",
        root / "out",
        compiler=str(compiler),
        export_dir=exported(FAMILY),
        progress=None,
        status_stream=None,
    )
    return root / "out"


@pytest.mark.parametrize("protocol", ["chunk", "full"])
def test_generation_through_qaic_program_matches_transformers(qaic_out, device_runtime, hf_model, protocol):
    model, processor = hf_model(FAMILY)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "What is shown?"), [helpers.image(112, 112, 5)]
    )
    expected, _ = helpers.hf_generate(model, inputs, max_new_tokens=6)
    generator = generator_for_artifacts(qaic_out)
    assert isinstance(generator.language, QaicProgram) and generator.language.retains_state
    device_runtime.LOG.clear()
    result = generator.generate(helpers.as_numpy(inputs), max_new_tokens=6, protocol=protocol)
    assert result.tokens == expected
    language_calls = [sent for sent in device_runtime.LOG if "input_ids" in sent]
    assert len(language_calls) == len(result.chunks) + len(result.tokens) - 1
    for sent in language_calls:  # the KV cache never crosses to the device
        assert not any(name.startswith("past_") for name in sent)
    decode_calls = language_calls[len(result.chunks) :]
    assert decode_calls and all("vision_embeds" not in sent for sent in decode_calls)
    for chunk, sent in zip(result.chunks, language_calls):
        assert sent["vision_embeds"][1] == chunk.vision_size <= chunk.seq_len


def test_uncompiled_shape_is_refused_before_the_device(qaic_out, device_runtime):
    import numpy as np

    generator = generator_for_artifacts(qaic_out)
    feeds = {
        "input_ids": np.zeros((1, 24), np.int64),
        "position_ids": np.zeros((4, 1, 24), np.int64),
        "vision_embeds": np.zeros((1, 24, 64), np.float32),
        "image_idx": np.zeros((1, 1), np.int64),
    }
    calls_before = len(device_runtime.LOG)
    with pytest.raises(session.ShapeMismatch, match="seq_len=24"):
        generator.language.run(feeds)
    assert len(device_runtime.LOG) == calls_before  # nothing reached the device


def test_run_still_works_after_a_failed_forced_recompile(
    tmp_path, tiny_checkpoint, exported, device_runtime, hf_model
):
    """Issue 15 item 4: ``compile --force`` with a failing compiler keeps the previous result servable."""
    from qeff_vision import api
    from qeff_vision.compile.driver import CompileFailed

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_checkpoint(FAMILY)),
                "ctx_len": 256,
                "prefill": {"seq_lens": [32]},
                "vision": {"images": [{"height": 112, "width": 112}]},
            }
        )
    )
    out = tmp_path / "out"
    good, _ = stand_in(tmp_path)
    bad, _ = stand_in(tmp_path, mode="fail")
    quiet = {"progress": None, "status_stream": None, "export_dir": exported(FAMILY)}
    api.compile(spec, out, compiler=str(good), **quiet)
    with pytest.raises(CompileFailed) as failure:
        api.compile(spec, out, compiler=str(bad), force=True, **quiet)
    shutil.rmtree(failure.value.log_path.parent.parent)  # the failed log, kept outside OUT
    model, processor = hf_model(FAMILY)
    inputs = helpers.process(
        processor, helpers.user_turn("<image>", "Name it."), [helpers.image(112, 112, 7)]
    )
    expected, _ = helpers.hf_generate(model, inputs, max_new_tokens=4)
    result = generator_for_artifacts(out).generate(helpers.as_numpy(inputs), max_new_tokens=4)
    assert result.tokens == expected


def test_a_conversation_keeps_the_resident_prefix_only_while_nothing_else_ran(
    qaic_out, device_runtime, hf_model
):
    """The device keeps the KV resident: a turn prefills only what follows the prefix it holds, and
    starts over when another prompt reached the program since (its resident cache is not ours)."""
    import torch

    from qeff_vision.runtime.conversation import Conversation

    model, processor = hf_model(FAMILY)
    generator = generator_for_artifacts(qaic_out)
    chat = Conversation(generator, processor, max_new_tokens=6)

    def ask(images, text):
        result = chat.ask(images, text)
        inputs = {k: torch.as_tensor(v) for k, v in chat.last_inputs.processed.items()}
        assert result.tokens == helpers.hf_generate(model, inputs, max_new_tokens=6)[0], text
        return result

    first = ask([helpers.image(112, 112, 5)], "Describe this picture.")
    second = ask([], "What colour dominates?")
    assert first.prefilled_tokens == first.prompt_tokens
    assert 0 < second.prefilled_tokens < second.prompt_tokens
    assert not any(name.startswith("past_") for sent in device_runtime.LOG for name in sent)
    # Another prompt through the same program (no kept prefix) overwrites the resident cache.
    other = helpers.process(processor, helpers.user_turn("Hi"), [])
    generator.generate(helpers.as_numpy(other), max_new_tokens=2)
    third = ask([helpers.image(140, 196, 6)], "Compare them.")
    assert third.prefilled_tokens == third.prompt_tokens
    assert not device_runtime.ERRORS
