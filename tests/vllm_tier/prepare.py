"""Build one family's case of the vLLM tier (runs in the project venv).

For a family: a tiny random checkpoint, a spec compiled with ``--backend onnxruntime``, the
requests (one image prompt whose image rows span several prefill chunks, one text-only prompt, and
on the continuous-batching artifact three concurrent requests), and transformers' greedy tokens on
the same processor outputs. ``serve.py`` (the vLLM venv) serves the job; the test compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from qeff_vision import api
from qeff_vision.compile.vllm_handoff import handoff_for_spec
from qeff_vision.spec import load_spec
from tests import helpers

NEW_TOKENS = 8
CTX_LEN = 256


@dataclass(frozen=True)
class Case:
    """What one family's job compiles and asks.

    Attributes:
        family: The family.
        seq_len: The one prefill bucket (the plugin's ``long_prefill_token_threshold``).
        image: (height, width) of the compiled and requested image.
        whole_images: The family keeps an image in one chunk (its image tokens attend both ways),
            so the bucket holds a whole image and the "several chunks" request is the prompt, not
            the image.
        ctx_len: Context length (a LLaVA-NeXT image is hundreds of tokens even when tiny).
        vision_size: The spec's ``vision.vision_size`` (None for a cross-attention family, which
            has no image rows in the token sequence).
    """

    family: str
    seq_len: int
    image: tuple[int, int]
    whole_images: bool = False
    ctx_len: int = CTX_LEN
    vision_size: str | None = "chunk"


CASES = {
    "llava": Case("llava", 8, (336, 336)),
    "qwen2_5_vl": Case("qwen2_5_vl", 8, (112, 112)),
    "internvl": Case("internvl", 8, (448, 448)),
    "gemma3": Case("gemma3", 32, (896, 896), whole_images=True),
    "qwen3_vl": Case("qwen3_vl", 8, (128, 128)),
    "qwen3_vl_moe": Case("qwen3_vl_moe", 8, (128, 128)),
    "llava_next": Case("llava_next", 8, (40, 40), ctx_len=1024),
    "mistral3": Case("mistral3", 8, (112, 112)),
    "gemma4": Case("gemma4", 8, (100, 150)),
    "qwen3_5": Case("qwen3_5", 8, (128, 128)),
    "qwen3_5_moe": Case("qwen3_5_moe", 8, (128, 128)),
    "llama4": Case("llama4", 8, (80, 80)),
    "mllama": Case("mllama", 8, (100, 150), vision_size=None),
}


def compile_case(case: Case, root: Path, checkpoint: Path, *, full_batch_size: int | None) -> Path:
    """OUT of a spec with the case's one bucket (``vision_size: chunk`` makes it equal the bucket)."""
    name = f"{case.family}-cb" if full_batch_size else case.family
    spec = {
        "name": name,
        "model": str(checkpoint),
        "ctx_len": case.ctx_len,
        "prefill": {"seq_lens": [case.seq_len]},
        "vision": {"images": [{"height": case.image[0], "width": case.image[1]}]},
    }
    if case.vision_size:
        spec["vision"]["vision_size"] = case.vision_size
    if full_batch_size:
        spec["full_batch_size"] = full_batch_size
    (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    out = root / name
    api.compile(root / f"{name}.yaml", out, backend="onnxruntime")
    for role in ("vision", "lang"):
        # The plugin loads a program directory only when it holds programqpc.bin (its
        # check_qpc_exists); the stand-in runtime reads the directory's own files.
        (out / role / "programqpc.bin").write_text("onnxruntime program (stand-in runtime)\n")
    return out


def build(case: Case, root: Path) -> dict:
    """Compile the case's two artifacts, write the images and return the job with references."""
    root.mkdir(parents=True, exist_ok=True)
    checkpoint = helpers.write_tiny(case.family, root / "checkpoint")
    model, processor = helpers.load_hf(checkpoint)
    image = helpers.image(*case.image, seed=1)
    image_file = root / "image.png"
    image.save(image_file)
    text = "Describe this picture in a few words, please."

    def request(parts, with_image):
        messages = helpers.user_turn(*parts)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        processed = helpers.process(processor, messages, [image] if with_image else None)
        tokens, _ = helpers.hf_generate(model, processed, NEW_TOKENS, eos_token_ids=[])
        entry = {"prompt": prompt, "input_ids": processed["input_ids"][0].tolist(), "reference": tokens}
        if with_image:
            entry["image"] = str(image_file)
            if "image_grid_thw" in processed:
                entry["image_grid_thw"] = processed["image_grid_thw"].tolist()
        return entry

    single = [[request(["<image>", text], True)], [request(["Hello, how are you today?"], False)]]
    concurrent = [
        [
            request(["<image>", text], True),
            request(["Tell me a story about a cat."], False),
            request(["<image>", "What colour dominates?"], True),
        ]
    ]
    jobs = {}
    for label, batches, slots in (("single", single, None), ("cb", concurrent, 3)):
        out = compile_case(case, root, checkpoint, full_batch_size=slots)
        # The printed plugin form's engine arguments, with OUT's absolute paths: the tier serves
        # exactly what --print-serve tells a user to run.
        spec = load_spec(root / f"{out.name}.yaml")
        handoff = handoff_for_spec(spec, str(out / "vision"), str(out / "lang"), str(out / "model"))
        jobs[label] = {
            "family": case.family,
            "qpc_path": handoff["qpc_path"],
            "engine_args": handoff["plugin"]["engine_args"],
            "max_tokens": NEW_TOKENS,
            "batches": batches,
        }
        (root / f"job-{label}.json").write_text(json.dumps(jobs[label], indent=1))
    return jobs
