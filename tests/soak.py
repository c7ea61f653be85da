"""A long ``run --requests`` on a tiny checkpoint: what the soak tests of issue 53 share.

:func:`compile_tiny` compiles a tiny checkpoint for onnxruntime in one deployment;
:func:`request_lines` writes a mixed request file (text only, one and two images of several
resolutions, prompts of several lengths, arrivals spread over the run); :func:`serve` runs it
through :func:`qeff_vision.api.run_requests` (the ``run --requests`` path) and measures the
process's RSS after the first ``first`` requests finished and after the last, each after handing
freed heap pages back (``malloc_trim``: what stays is what the run holds, not what glibc kept);
:func:`leftovers` lists every per-request structure still holding something after the run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from qeff_vision import api
from qeff_vision.fsutil import release_memory
from tests import helpers

# Image files beside the request file: three resolutions, two images each.
IMAGES = {
    f"img{i}.png": size
    for i, size in enumerate([(112, 112), (112, 112), (140, 196), (140, 196), (96, 160), (96, 160)])
}
WORDS = "describe the picture and tell me what colours shapes and objects you can see in it".split()


def compile_tiny(root: Path, checkpoint: Path, deployment: str, full_batch_size: int | None = 4) -> Path:
    """``compile --backend onnxruntime`` of a tiny checkpoint in ``deployment``; OUT's path."""
    spec = {
        "name": f"soak-{deployment}",
        "model": str(checkpoint),
        "ctx_len": 256,
        "prefill": {"seq_lens": [32, 128]},
        "vision": {"images": [{"height": 336, "width": 336}], "max_images": 2},
    }
    if deployment != "dual":
        spec["deployment"] = deployment
    if full_batch_size:
        spec["full_batch_size"] = full_batch_size
    root.mkdir(parents=True, exist_ok=True)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    api.compile(root / "spec.yaml", root / "out", backend="onnxruntime", progress=None, status_stream=None)
    return root / "out"


def request_lines(directory: Path, count: int, *, seed: int = 0, spread: int = 4) -> list[dict]:
    """``count`` mixed requests (a third each text only, one image, two images), images written beside.

    Arrival steps grow by 0..``spread`` per request, so requests keep arriving over the whole run.
    """
    for name, (height, width) in IMAGES.items():
        if not (directory / name).exists():
            helpers.image(height, width, seed=int(name[3:-4]) + 1).save(directory / name)
    rng = random.Random(seed)
    names, lines, arrival = sorted(IMAGES), [], 0
    for index in range(count):
        images = rng.sample(names, index % 3)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))
        lines.append(
            {"prompt": prompt, "images": images, "max_new_tokens": rng.randint(1, 4), "arrival_step": arrival}
        )
        arrival += rng.randint(0, spread)
    return lines


def write_requests(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def rss() -> int:
    """This process's resident bytes after freed heap pages went back to the system."""
    release_memory()
    return psutil.Process().memory_info().rss


@dataclass
class Soak:
    """A served request file and the RSS figures around it."""

    run: object  # qeff_vision.runtime.batch_run.BatchRun
    rss_first: int
    rss_end: int
    first: int

    @property
    def growth(self) -> float:
        """RSS at the end relative to after the first requests (0.01 = 1 % more)."""
        return self.rss_end / self.rss_first - 1.0

    def describe(self, label: str) -> str:
        count = len(self.run.requests)
        return (
            f"soak {label}: {count} requests, RSS after {self.first} {self.rss_first / 2**20:.1f} MiB, "
            f"after {count} {self.rss_end / 2**20:.1f} MiB ({self.growth * 100:+.2f} %)"
        )


def serve(out: Path, requests_file: Path, first: int) -> Soak:
    """``run --requests`` in-process; RSS once ``first`` requests finished and at the end."""
    measured: dict[str, int] = {}
    finished = [0]

    def on_finish(request, done) -> None:
        finished[0] += 1
        if finished[0] == first:
            measured["first"] = rss()

    run = api.run_requests(out, requests_file, on_finish=on_finish)
    return Soak(run, measured["first"], rss(), first)


def leftovers(run) -> list[str]:
    """Every per-request structure of the engine, its slots and its generator still holding something."""
    engine = run.engine
    generator = engine.generator
    found = []
    staging = getattr(engine.slots, "staging", None)
    if staging:
        found.append(f"disaggregated prefill staging of slots {sorted(staging)}")
    cache = generator.cache
    if cache._pins:
        found.append(f"{len(cache._pins)} embedding-cache entries still pinned")
    if cache.nbytes > cache.max_bytes:
        found.append(f"embedding cache over its bound ({cache.nbytes} > {cache.max_bytes} bytes)")
    if getattr(generator, "ccl_history", None):
        found.append(f"{len(generator.ccl_history)} CCL history entries on the generator")
    if getattr(generator, "retention", None):
        found.append(f"{len(generator.retention)} video retention masks on the generator")
    return found
