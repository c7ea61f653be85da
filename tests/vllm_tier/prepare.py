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
        second: A second image size for the two-image request (None: no such request).
        text: The text-only request. The stand-in keeps KV in the compiled fp16, so a prompt whose
            fp32 greedy choice is a near tie can flip against transformers' fp32 reference.
    """

    family: str
    seq_len: int
    image: tuple[int, int]
    whole_images: bool = False
    ctx_len: int = CTX_LEN
    vision_size: str | None = "chunk"
    second: tuple[int, int] | None = None
    text: str = "Hello, how are you today?"


CASES = {
    "llava": Case("llava", 8, (336, 336), second=(200, 300)),
    "qwen2_5_vl": Case("qwen2_5_vl", 8, (112, 112), second=(112, 168)),
    # 336x448 tiles as 448x448 does (one vision specialization: the plugin's assumption).
    "internvl": Case("internvl", 8, (448, 448), second=(336, 448)),
    "gemma3": Case("gemma3", 32, (896, 896), whole_images=True),
    "qwen3_vl": Case("qwen3_vl", 8, (128, 128), second=(128, 192)),
    "qwen3_vl_moe": Case("qwen3_vl_moe", 8, (128, 128), second=(128, 192)),
    # 100x150 lands on the 2x2 pinpoint of 4 tiles: 70 rows of the 88 its vision output holds;
    # 150x100 on the same pinpoint (72 rows): one vision specialization serves both, as the
    # plugin's one-specialization assumption for non-Qwen vision programs needs.
    "llava_next": Case("llava_next", 8, (100, 150), ctx_len=1024, second=(150, 100)),
    "mistral3": Case("mistral3", 8, (112, 112)),
    # "Hello, how are you today?" is a near tie on the tiny Gemma 4 (its 2nd token's top two fp32
    # logits 3.3e-05 apart, flipped by fp16 KV); this prompt's smallest gap over 8 tokens is 7.9e-03.
    "gemma4": Case("gemma4", 8, (100, 150), second=(150, 100), text="Hello, how are you?"),
    "qwen3_5": Case("qwen3_5", 8, (128, 128), second=(128, 192)),
    "qwen3_5_moe": Case("qwen3_5_moe", 8, (128, 128), second=(128, 192)),
    "llama4": Case("llama4", 8, (80, 80)),
    "mllama": Case("mllama", 8, (100, 150), vision_size=None),
}


def compile_case(
    case: Case,
    root: Path,
    checkpoint: Path,
    *,
    full_batch_size: int | None,
    images: tuple[tuple[int, int], ...] | None = None,
    name: str | None = None,
    deployment: str | None = None,
    sampler: dict | None = None,
) -> Path:
    """OUT of a spec with the case's one bucket (``vision_size: chunk`` makes it equal the bucket).

    ``images``: the compiled sizes (the case's image by default; a request may hold them all);
    ``deployment``: ``single`` for the one-program artifact (the plugin's ``kv_offload=False``);
    ``sampler``: ``compile.language.sampler`` (the on-device sampler).
    """
    name = name or (f"{case.family}-cb" if full_batch_size else case.family)
    images = images or (case.image,)
    spec = {
        "name": name,
        "model": str(checkpoint),
        "ctx_len": case.ctx_len,
        "prefill": {"seq_lens": [case.seq_len]},
        "vision": {"images": [{"height": h, "width": w} for h, w in images], "max_images": len(images)},
    }
    if case.vision_size and deployment is None:
        spec["vision"]["vision_size"] = case.vision_size
    if full_batch_size:
        spec["full_batch_size"] = full_batch_size
    if deployment:
        spec["deployment"] = deployment
    if sampler is not None:
        spec["compile"] = {"language": {"sampler": sampler}}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    out = root / name
    api.compile(root / f"{name}.yaml", out, backend="onnxruntime")
    for role in ("vision", "lang"):
        # The plugin loads a program directory only when it holds programqpc.bin (its
        # check_qpc_exists); the stand-in runtime reads the directory's own files.
        if (out / role).is_dir():
            (out / role / "programqpc.bin").write_text("onnxruntime program (stand-in runtime)\n")
    return out


class Requests:
    """A family's tiny checkpoint, transformers model and processor: requests with their references."""

    def __init__(self, case: Case, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.case, self.root = case, root
        self.checkpoint = helpers.write_tiny(case.family, root / "checkpoint")
        self.model, self.processor = helpers.load_hf(self.checkpoint)

    def image(self, size: tuple[int, int], seed: int) -> tuple[object, Path]:
        image = helpers.image(*size, seed=seed)
        path = self.root / f"image-{size[0]}x{size[1]}-{seed}.png"
        image.save(path)
        return image, path

    def prompt(self, parts) -> str:
        return self.processor.apply_chat_template(helpers.user_turn(*parts), add_generation_prompt=True)

    def request(self, parts, images=()) -> dict:
        """One request: its prompt, processor token ids, transformers' greedy tokens and image files.

        With images, ``image_prompts`` holds a one-image prompt per image: the pooling instance
        encodes each image alone (the plugin's pooling output stacks a prompt's images, which
        needs equal sizes).
        """
        messages = helpers.user_turn(*parts)
        pictures = [image for image, _ in images]
        processed = helpers.process(self.processor, messages, pictures or None)
        tokens, _ = helpers.hf_generate(self.model, processed, NEW_TOKENS, eos_token_ids=[])
        entry = {
            "parts": list(parts),  # the user turn (helpers.user_turn), for the chat endpoint
            "prompt": self.prompt(parts),
            "input_ids": processed["input_ids"][0].tolist(),
            "reference": tokens,
        }
        if images:
            entry["images"] = [str(path) for _, path in images]
            entry["image_prompts"] = [self.prompt(["<image>", "Describe."]) for _ in images]
            if "image_grid_thw" in processed:
                entry["image_grid_thw"] = processed["image_grid_thw"].tolist()
        return entry

    def job(self, label: str, out: Path, batches: list, **extra) -> dict:
        """The printed plugin form's engine arguments, with OUT's absolute paths, and the requests."""
        spec = load_spec(self.root / f"{out.name}.yaml")
        handoff = handoff_for_spec(spec, str(out / "vision"), str(out / "lang"), str(out / "model"))
        job = {
            "family": self.case.family,
            "qpc_path": handoff["qpc_path"],
            "engine_args": handoff["plugin"]["engine_args"],
            "max_tokens": NEW_TOKENS,
            "batches": batches,
            **extra,
        }
        (self.root / f"job-{label}.json").write_text(json.dumps(job, indent=1))
        return job


TEXT = "Describe this picture in a few words, please."


def build(case: Case, root: Path) -> dict:
    """Compile the case's two artifacts, write the images and return the jobs with references."""
    requests = Requests(case, root)
    image = requests.image(case.image, 1)
    single = [
        [requests.request(["<image>", TEXT], [image])],
        [requests.request([case.text])],
    ]
    concurrent = [
        [
            requests.request(["<image>", TEXT], [image]),
            requests.request(["Tell me a story about a cat."]),
            requests.request(["<image>", "What colour dominates?"], [image]),
        ]
    ]
    jobs = {}
    for label, batches, slots in (("single", single, None), ("cb", concurrent, 3)):
        out = compile_case(case, root, requests.checkpoint, full_batch_size=slots)
        # The printed plugin form's engine arguments: the tier serves exactly what
        # --print-serve tells a user to run.
        jobs[label] = requests.job(label, out, batches)
    return jobs


def build_two_images(case: Case, root: Path) -> dict:
    """One prompt with two images of different sizes (both compiled), like the plugin's
    ``examples/qaic_vision_language_multi_image.py``."""
    requests = Requests(case, root)
    first, second = requests.image(case.image, 1), requests.image(case.second, 2)
    batches = [[requests.request(["<image>", "First.", "<image>", "What differs?"], [first, second])]]
    out = compile_case(
        case, root, requests.checkpoint, full_batch_size=None, images=(case.image, case.second), name="two"
    )
    return requests.job("two", out, batches)


def build_single_program(case: Case, root: Path) -> dict:
    """``deployment: single``: one program holding the tower, served by one generate instance with the
    plugin's ``kv_offload: False`` (its single-QPC mode: pixels in, no pooling instance)."""
    requests = Requests(case, root)
    image = requests.image(case.image, 1)
    batches = [
        [requests.request(["<image>", TEXT], [image])],
        [requests.request(["Hello, how are you today?"])],
    ]
    out = compile_case(case, root, requests.checkpoint, full_batch_size=None, name="one", deployment="single")
    job = requests.job("one", out, batches)
    language = dict(job["engine_args"]["language"])
    language.pop("enable_mm_embeds", None)
    config = dict(language.get("additional_config") or {})
    config["override_qaic_config"] = {**(config.get("override_qaic_config") or {}), "kv_offload": False}
    language["additional_config"] = config
    job.update(qpc_path=str(out / "lang"), engine_args={"language": language}, single_program=True)
    (root / "job-one.json").write_text(json.dumps(job, indent=1))
    return job


#: The sampler artifact's top-k width (below the tiny vocabulary; QEfficient's default is 512).
SAMPLER_TOP_K = 32


def build_sampler(case: Case, root: Path) -> dict:
    """A continuous-batching artifact with the on-device sampler, served with the plugin's
    ``aic_include_sampler`` (and ``max_top_k_ids``) in ``override_qaic_config``, greedy requests."""
    requests = Requests(case, root)
    image = requests.image(case.image, 1)
    batches = [
        [requests.request(["<image>", TEXT], [image]), requests.request(["Tell me a story about a cat."])]
    ]
    sampler = {"max_top_k_ids": SAMPLER_TOP_K}
    out = compile_case(case, root, requests.checkpoint, full_batch_size=2, name="sampler", sampler=sampler)
    job = requests.job("sampler", out, batches)
    language = dict(job["engine_args"]["language"])
    config = dict(language.get("additional_config") or {})
    override = {**(config.get("override_qaic_config") or {}), "aic_include_sampler": True}
    config["override_qaic_config"] = {**override, "max_top_k_ids": SAMPLER_TOP_K}
    language["additional_config"] = config
    job["engine_args"] = {**job["engine_args"], "language": language}
    (root / "job-sampler.json").write_text(json.dumps(job, indent=1))
    return job
