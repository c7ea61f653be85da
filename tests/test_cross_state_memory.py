"""mllama's cross-attention states live in the bounded embedding cache (issue 38, item 4).

Before, ``CrossAttentionGenerator.encoded`` kept every image's states ever encoded: under
``run --requests`` a server's memory grew by one image's states per distinct image (hundreds of
MB each at 11B scale). Here 50 requests with 50 distinct images go through the batched engine
(the ``run --requests`` path) with a cache bound of four images' states: once the bound is
reached, the arrays the generator holds (every numpy array reachable from it, the cache
included) stay flat, and the peak process RSS does not grow with the images served (the old dict
grew by one image's states per request). A repeated image is still a cache hit.
"""

from __future__ import annotations

import gc
import resource
import types

import numpy as np

from qeff_vision.checkpoint import Checkpoint
from qeff_vision.export_record import read_export
from qeff_vision.runtime.embedding_cache import EmbeddingCache
from qeff_vision.runtime.engine import BatchedEngine, EngineRequest
from qeff_vision.runtime.generate import make_generator
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from qeff_vision.runtime.session import OnnxProgram
from tests import helpers
from tests.family_runtime import CTX_LEN

FAMILY = "mllama"
IMAGES = 50
BOUND_IMAGES = 4


def held_array_bytes(root: object) -> int:
    """Bytes of every numpy array reachable from ``root`` (each buffer counted once)."""
    seen, buffers, total = {id(root)}, set(), 0
    frontier = [root]
    while frontier:
        found = []
        for obj in gc.get_referents(*frontier):
            if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
                continue
            seen.add(id(obj))
            if isinstance(obj, np.ndarray):
                base = obj if not isinstance(obj.base, np.ndarray) else obj.base
                if id(base) not in buffers:
                    buffers.add(id(base))
                    total += base.nbytes
                continue
            found.append(obj)
        frontier = found
    return total


def test_fifty_distinct_images_keep_host_memory_flat_after_the_bound(exported):
    export_dir = exported(FAMILY)
    manifest = read_export(export_dir)
    checkpoint = Checkpoint.open(manifest["model"], FAMILY)
    vision = OnnxProgram(export_dir / manifest["programs"]["vision"]["path"])
    language = OnnxProgram(export_dir / manifest["programs"]["lang"]["path"])
    shape = LanguageShape((PrefillBucket(16, 1),), 1, CTX_LEN)
    probe = make_generator(checkpoint, vision, language, shape, EmbeddingCache(2**30))
    processor = checkpoint.processor

    def request(seed: int) -> dict:
        image = helpers.image(90 + seed % 7 * 10, 120, seed)
        turn = helpers.user_turn("<image>", "Describe it.")
        return helpers.as_numpy(helpers.process(processor, turn, [image]))

    prompts = [request(seed) for seed in range(IMAGES)] + [request(IMAGES - 1)]  # the last one again
    # One image's states, as the cache holds them: the bound is four of them.
    states, _ = probe._cross_states(prompts[0])
    per_image = sum(array.nbytes for array in states.values()) // max(probe.image_slots or 1, 1)
    cache = EmbeddingCache(BOUND_IMAGES * per_image)
    generator = make_generator(checkpoint, vision, language, shape, cache)
    engine = BatchedEngine(generator)
    held, peak_rss = [], []

    def finished(done) -> None:
        held.append(held_array_bytes(generator))
        peak_rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

    requests = [EngineRequest(processed, 1, number) for number, processed in enumerate(prompts)]
    report = engine.run(requests, on_finish=finished)
    assert report.encoder_calls == IMAGES, "each distinct image encoded once, the repeat a cache hit"
    assert report.requests[-1].result.cache_hits == 1
    stats = cache.stats
    assert stats.entries <= BOUND_IMAGES and stats.bytes <= cache.max_bytes
    assert stats.evictions == IMAGES - BOUND_IMAGES
    # After the bound is reached (request 10 on), the generator holds no more than it did then:
    # the old per-generator dict grew by one image's states per request (40 of them by the end).
    growth = max(held[10:]) - held[10]
    assert growth <= 0, f"held arrays grew by {growth} bytes ({growth / per_image:.1f} images)"
    rss = (peak_rss[-1] - peak_rss[10]) * 1024
    assert rss < 30 * per_image, f"peak RSS grew by {rss} bytes ({rss / per_image:.1f} images' states)"
