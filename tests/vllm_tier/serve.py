"""Serve one compiled OUT through the real vLLM + vllm-qaic plugin (runs in the vLLM venv).

Usage: ``python serve.py JOB.json RESULT.json``. The job names OUT's model directory, its vision
and language program directories, the engine sizes and the requests (prompt text, optional image
files). Like the plugin's ``examples/qaic_vision_language.py``: a pooling instance on the vision
program encodes each image, a generate instance on the language program (``enable_mm_embeds``)
generates from the embeddings; a ``single_program`` job has the generate instance only, on the
one-program artifact (the plugin's ``kv_offload: False``), and sends it the images.
``VLLM_QAIC_QPC_PATH=vision:language`` gives each instance its program (index 0 to the pooling
runner, 1 to the generate runner). The result records each
request's prompt and output token ids and every plugin warning.

The device runtime is the stand-in (tests/device_double, first on ``PYTHONPATH``); this script
never imports qeff_vision (another venv, another transformers).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


class Collect(logging.Handler):
    """Keeps every WARNING+ record of the vllm_qaic loggers."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def main(job_file: str, result_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    # One process: the engine core's warnings and the stand-in's call log are seen here.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_QAIC_QPC_PATH"] = job["qpc_path"]
    from PIL import Image
    from vllm import LLM, SamplingParams

    collect = Collect()
    for name in ("vllm_qaic", "vllm"):
        logging.getLogger(name).addHandler(collect)
    # The printed plugin form's arguments; the tier adds only determinism (seed, no media cache).
    extra = {"seed": 0, "mm_processor_cache_gb": 0}
    language = LLM(**job["engine_args"]["language"], **extra)
    # The single-program artifact (the plugin's kv_offload=False) takes pixels: no pooling instance.
    single_program = job.get("single_program", False)
    vision = None if single_program else LLM(**job["engine_args"]["vision"], **extra)
    max_tokens = job["max_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    import qaicrt  # the stand-in runtime the engine runs in this process: what reached the "device"

    results, calls = [], []
    for batch in job["batches"]:
        first_call = len(qaicrt.LOG)
        inputs = []
        for request in batch:
            item = {"prompt": request["prompt"]}
            images = [Image.open(path).convert("RGB") for path in request.get("images", [])]
            if images and single_program:
                item["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
            elif images:
                # Each image encoded alone (its one-image prompt): the plugin's pooling output
                # stacks a prompt's images, which needs them of one size.
                embeds = [
                    vision.encode(
                        [{"prompt": prompt, "multi_modal_data": {"image": image}}], pooling_task="embed"
                    )[0].outputs.data
                    for prompt, image in zip(request["image_prompts"], images, strict=True)
                ]
                if len(embeds) > 1:  # one [rows, hidden] item per image (each came as [1, rows, hidden])
                    embeds = [embed.reshape(-1, embed.shape[-1]) for embed in embeds]
                if request.get("image_grid_thw"):
                    import torch

                    item["multi_modal_data"] = {
                        "image": {
                            "image_embeds": torch.cat(embeds) if len(embeds) > 1 else embeds[0],
                            "image_grid_thw": torch.tensor(request["image_grid_thw"]),
                        }
                    }
                else:
                    item["multi_modal_data"] = {"image": embeds[0] if len(embeds) == 1 else embeds}
            inputs.append(item)
        outputs = language.generate(inputs, sampling_params=params)
        results.append(
            [
                {"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids)}
                for o in outputs
            ]
        )
        calls.append(qaicrt.LOG[first_call:])
    record = {
        "batches": results,
        "warnings": collect.messages,
        "device_calls": calls,
        "device_errors": qaicrt.ERRORS,
    }
    Path(result_file).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:3])
