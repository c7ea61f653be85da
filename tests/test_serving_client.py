"""qeff_vision.serving.client without servers: the wire forms and the errors (the vLLM tier runs it
against the real ``vllm serve`` endpoints, tests/vllm_tier/test_vllm_online.py)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from qeff_vision.families import all_families, get_family
from qeff_vision.serving import client as serving


def _fake_client(grid: bool, encoded: list) -> serving.EncodeThenChat:
    """A client whose encode hop returns a distinct array per image (recorded in ``encoded``)."""
    chat = serving.EncodeThenChat("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1", "model", grid=grid)

    def encode(url):
        encoded.append(url)
        return np.full((1, 2, 3), len(encoded), dtype=np.float32)

    chat.encode = encode
    return chat


def _npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_pooling_bytes_decode_to_the_tensors_with_their_shapes(dtype, endianness):
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    tensors = [np.arange(24, dtype=dtype).reshape(1, 4, 6) - 3.5, np.ones((2, 3), dtype=dtype)]
    body, items, offset = b"", [], 0
    for index, tensor in enumerate(tensors):
        raw = tensor.astype(np.dtype(order + {"float32": "f4", "float16": "f2"}[dtype])).tobytes()
        items.append(
            {
                "index": index,
                "embed_dtype": dtype,
                "endianness": endianness,
                "start": offset,
                "end": offset + len(raw),
                "shape": list(tensor.shape),
            }
        )
        body, offset = body + raw, offset + len(raw)
    decoded = serving.decode_pooling_bytes({"data": items}, body)
    assert [d.shape for d in decoded] == [t.shape for t in tensors]
    for got, want in zip(decoded, tensors, strict=True):
        np.testing.assert_array_equal(got, want)


def test_pooling_bytes_of_an_unknown_dtype_are_refused():
    item = {"embed_dtype": "bfloat16", "endianness": "little", "start": 0, "end": 4, "shape": [2]}
    with pytest.raises(serving.EncodeError, match="bfloat16"):
        serving.decode_pooling_bytes({"data": [item]}, b"\0" * 4)


def test_npy_base64_is_what_numpy_loads_back():
    array = np.random.default_rng(0).standard_normal((1, 5, 7)).astype(np.float32)
    text = serving.npy_base64(array[:, ::2])  # a non-contiguous view goes out contiguous
    assert base64.b64decode(text)[:6] == b"\x93NUMPY"  # vLLM's ImageEmbeddingMediaIO checks this prefix
    np.testing.assert_array_equal(_npy(text), array[:, ::2])


def test_every_image_url_becomes_image_embeds_in_order_and_text_stays():
    encoded = []
    chat = _fake_client(grid=False, encoded=encoded)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": "data:image/png;base64,BBB"},
            ],
        },
    ]
    out = chat.with_embeds(messages)
    assert encoded == ["data:image/png;base64,AAA", "data:image/png;base64,BBB"]
    assert out[0] == messages[0]
    first, text, second = out[1]["content"]
    assert text == {"type": "text", "text": "and"}
    assert first["type"] == second["type"] == "image_embeds"
    assert _npy(first["image_embeds"]).tolist() == np.full((1, 2, 3), 1.0).tolist()
    assert _npy(second["image_embeds"]).tolist() == np.full((1, 2, 3), 2.0).tolist()
    assert messages[1]["content"][0]["type"] == "image_url"  # the caller's messages are not changed


def test_qwen_images_carry_their_grid_or_the_plugins_placeholder():
    chat = _fake_client(grid=True, encoded=[])
    content = [{"type": "image_url", "image_url": {"url": f"u{i}"}} for i in range(2)]
    out = chat.with_embeds([{"role": "user", "content": content}], grids=[[1, 8, 12]])
    known, unknown = (part["image_embeds"] for part in out[0]["content"])
    assert _npy(known["image_grid_thw"]).tolist() == [[1, 8, 12]]
    assert _npy(unknown["image_grid_thw"]).tolist() == [list(serving.PLACEHOLDER_GRID)]
    assert _npy(known["image_grid_thw"]).dtype == np.int64


@pytest.mark.parametrize("family", [f.name for f in all_families()])
def test_a_client_for_an_artifact_reads_its_model_type(tmp_path, family):
    """Every family: the Qwen ones (their processors return image_grid_thw) send the grid."""
    (model_type,) = get_family(family).model_types
    grid = model_type.startswith("qwen")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": model_type}))
    chat = serving.EncodeThenChat.for_artifact(tmp_path, "http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1")
    assert (chat.grid, chat.model, chat.encode_url) == (grid, "model", "http://127.0.0.1:1/v1")


def test_a_closed_encode_port_is_a_clear_error_at_once():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free again once closed: nothing listens there
    chat = serving.EncodeThenChat(f"http://127.0.0.1:{port}/v1", "http://127.0.0.1:9/v1", "model")
    began = time.monotonic()
    with pytest.raises(serving.EncodeError, match=f"encode endpoint http://127.0.0.1:{port}/v1 unreachable"):
        chat.encode("data:image/png;base64,AAA")
    assert time.monotonic() - began < 5


def test_a_stalled_encode_endpoint_times_out_at_the_stated_timeout():
    with socket.socket() as listener:  # accepts connections (the backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        chat = serving.EncodeThenChat(
            f"http://127.0.0.1:{port}/v1", "http://127.0.0.1:9/v1", "model", encode_timeout=1.0
        )
        began = time.monotonic()
        with pytest.raises(serving.EncodeError, match=r"did not answer within 1 s"):
            chat.encode("data:image/png;base64,AAA")
        assert 0.9 < time.monotonic() - began < 5


def test_image_data_url_names_the_image_type(tmp_path):
    for name, kind in (("a.png", "png"), ("b.JPG", "jpeg"), ("c.jpeg", "jpeg"), ("d.webp", "webp")):
        (tmp_path / name).write_bytes(b"xyz")
        assert serving.image_data_url(tmp_path / name) == f"data:image/{kind};base64,eHl6"


def test_the_client_is_torch_free():
    code = "import sys, qeff_vision.serving.client as c; c.EncodeThenChat; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"
