"""One call for a chat request with images, over the two ``vllm serve`` endpoints ``--print-serve`` prints.

vLLM 0.23 + vllm-qaic serves a dual-QPC model as two servers: a pooling instance on the vision
program (the *encode* endpoint) and a generate instance with ``--enable-mm-embeds`` on the
language program (the *language* endpoint). A client talks to both: each ``image_url`` goes to
the encode endpoint, and the embeddings it returns go to the language endpoint as ``image_embeds``
chat content. :class:`EncodeThenChat` does that, so a user's OpenAI chat request with images gets
its answer with one call.

How each hop is carried (read from vLLM 0.23.0):

* Encode: ``POST /v1/embeddings`` with chat ``messages`` (vLLM's ``EmbeddingChatRequest``) holding the
  one image. The pooled output is ``[1, rows, hidden]``, which the JSON forms cannot carry:
  ``encoding_format="float"`` fails validation (``EmbeddingResponseData.embedding`` is
  ``list[float] | str``) and ``"base64"`` flattens away the shape. ``encoding_format="bytes"``
  returns the raw tensor with a ``metadata`` header giving its shape, dtype and endianness
  (``entrypoints/pooling/utils.py``: ``build_pooling_bytes_streaming_response``). The OpenAI
  client has no call for chat-form embeddings nor for a binary body, so this hop is plain HTTP.
* Language: an ``image_embeds`` content part whose value is a base64 ``.npy`` file (vLLM's
  ``ImageEmbeddingMediaIO`` loads numpy's format as well as ``torch.save``'s, so no torch here).
  For the Qwen families the part is a dict ``{"image_embeds": ..., "image_grid_thw": ...}``;
  without a known grid the plugin's placeholder ``[-1, -1, -1]`` asks it to take the grid of the
  compiled resolution with that many rows (vllm-qaic ``qaic_custom_mm_processor.py``,
  ``QaicQwen2VLMultiModalDataParser._parse_image_data``). This hop uses the OpenAI client.

Each image is encoded alone: the plugin's pooling output stacks a request's images into one
tensor, which needs them of one size.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The model types the plugin treats as Qwen-VL (vllm-qaic qaic_multimodal.py, ``is_qwenvl``): their
# image_embeds travel with image_grid_thw.
GRID_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# The plugin's E-PD placeholder grid: "take the compiled resolution with this many rows".
PLACEHOLDER_GRID = (-1, -1, -1)
ENCODE_TIMEOUT_S = 30.0


class EncodeError(RuntimeError):
    """The encode endpoint did not return an image's embeddings (down, timed out or refused)."""


def npy_base64(array: np.ndarray) -> str:
    """``array`` as a base64 ``.npy`` file, the form vLLM's ``image_embeds`` content accepts."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_pooling_bytes(metadata: Mapping[str, Any], body: bytes) -> list[np.ndarray]:
    """The tensors of a ``encoding_format="bytes"`` pooling response (its ``metadata`` header, its body)."""
    dtypes = {"float32": "f4", "float16": "f2"}
    arrays = []
    for item in metadata["data"]:
        order = {"little": "<", "big": ">"}.get(item["endianness"], "=")
        if item["embed_dtype"] not in dtypes:
            raise EncodeError(f"unsupported embedding dtype {item['embed_dtype']!r} from the encode endpoint")
        dtype = np.dtype(order + dtypes[item["embed_dtype"]])
        arrays.append(np.frombuffer(body[item["start"] : item["end"]], dtype=dtype).reshape(item["shape"]))
    return arrays


class EncodeThenChat:
    """An OpenAI chat client for the encode + language endpoint pair.

    Args:
        encode_url: Base URL of the encode endpoint (``http://host:8001/v1``).
        language_url: Base URL of the language endpoint (``http://host:8002/v1``).
        model: The served model name (``vllm serve``'s model argument unless ``--served-model-name``).
        grid: Send ``image_grid_thw`` with each image's embeddings (the Qwen families; see
            :meth:`for_artifact`).
        encode_timeout: Seconds an encode call may take before :class:`EncodeError`.
        timeout: Seconds the language endpoint's OpenAI client waits per call.
        api_key: The servers' ``--api-key``, if any.
    """

    def __init__(
        self,
        encode_url: str,
        language_url: str,
        model: str,
        *,
        grid: bool = False,
        encode_timeout: float = ENCODE_TIMEOUT_S,
        timeout: float = 120.0,
        api_key: str = "EMPTY",
    ):
        from openai import OpenAI  # the optional extra: pip install 'qeff-vision[serve]'

        self.encode_url = encode_url.rstrip("/")
        self.model, self.grid, self.encode_timeout, self.api_key = model, grid, encode_timeout, api_key
        self.language = OpenAI(base_url=language_url, api_key=api_key, timeout=timeout, max_retries=0)

    @classmethod
    def for_artifact(
        cls, out_dir: str | Path, encode_url: str, language_url: str, **kwargs
    ) -> EncodeThenChat:
        """A client for compile's OUT served as printed (model ``model``; grid from its config)."""
        config = json.loads((Path(out_dir) / "model" / "config.json").read_text())
        kwargs.setdefault("grid", config.get("model_type") in GRID_MODEL_TYPES)
        return cls(encode_url, language_url, kwargs.pop("model", "model"), **kwargs)

    def encode(self, image_url: str) -> np.ndarray:
        """One image's embeddings (``[1, rows, hidden]`` float32) from the encode endpoint.

        Raises:
            EncodeError: The endpoint is down, did not answer within ``encode_timeout`` or refused.
        """
        message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}}]}
        body = {
            "model": self.model,
            "messages": [message],
            "encoding_format": "bytes",
            "embed_dtype": "float32",
        }
        request = urllib.request.Request(
            f"{self.encode_url}/embeddings",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
        )
        where = f"encode endpoint {self.encode_url}"
        try:
            with urllib.request.urlopen(request, timeout=self.encode_timeout) as response:
                metadata, payload = json.loads(response.headers["metadata"]), response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise EncodeError(f"{where} refused the image: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise EncodeError(f"{where} did not answer within {self.encode_timeout:g} s") from None
            raise EncodeError(f"{where} unreachable: {reason}") from None
        (embeds,) = decode_pooling_bytes(metadata, payload)
        return embeds.astype(np.float32, copy=False)

    def embeds_part(self, image_url: str, image_grid_thw: Sequence[int] | None = None) -> dict[str, Any]:
        """The ``image_embeds`` content part for one image (encoded now)."""
        embeds = npy_base64(self.encode(image_url))
        if not self.grid:
            return {"type": "image_embeds", "image_embeds": embeds}
        grid = np.asarray([image_grid_thw or PLACEHOLDER_GRID], dtype=np.int64)
        pair = {"image_embeds": embeds, "image_grid_thw": npy_base64(grid)}
        return {"type": "image_embeds", "image_embeds": pair}

    def with_embeds(
        self, messages: Iterable[Mapping[str, Any]], grids: Sequence[Sequence[int]] | None = None
    ) -> list[dict[str, Any]]:
        """``messages`` with every ``image_url`` part replaced by its ``image_embeds`` part.

        ``grids``: each image's ``image_grid_thw`` in message order (Qwen families; default the
        plugin's placeholder).
        """
        grids = list(grids or [])
        out, index = [], 0
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image_url":
                        url = part["image_url"]
                        url = url["url"] if isinstance(url, dict) else url
                        parts.append(self.embeds_part(url, grids[index] if index < len(grids) else None))
                        index += 1
                    else:
                        parts.append(dict(part))
                message = {**message, "content": parts}
            out.append(dict(message))
        return out

    def chat(self, messages: Iterable[Mapping[str, Any]], *, grids=None, **kwargs):
        """``chat.completions.create`` on the language endpoint after encoding the messages' images.

        Keyword arguments go to the OpenAI client as they are (``stream=True`` returns its stream).
        """
        kwargs.setdefault("model", self.model)
        return self.language.chat.completions.create(messages=self.with_embeds(messages, grids), **kwargs)


def image_data_url(path: str | Path) -> str:
    """A local image file as a ``data:`` URL (what an ``image_url`` part may carry)."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    kind = {"jpg": "jpeg"}.get(suffix, suffix or "png")
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode("ascii")
