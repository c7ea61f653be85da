"""Chunk-aware runtime: the chunk planner, the per-image embedding cache, sessions, generation.

The planner and the cache are pure (numpy only); sessions import onnxruntime or the QAIC SDK in
their own modules, so importing this package stays cheap.
"""

from qeff_vision.contract.segments import PlanError, Segment, find_segments
from qeff_vision.runtime.embedding_cache import (
    CacheStats,
    EmbeddingCache,
    Encoder,
    PreparedImage,
    content_key,
    feed_chunks,
    fetch_embeddings,
)
from qeff_vision.runtime.planner import (
    Chunk,
    ChunkEnd,
    ChunkPlan,
    ImagePiece,
    PrefillBucket,
    VisionProtocol,
    assemble_vision_embeds,
    plan_chunks,
)

__all__ = [
    "CacheStats",
    "EmbeddingCache",
    "Encoder",
    "PreparedImage",
    "content_key",
    "feed_chunks",
    "fetch_embeddings",
    "Chunk",
    "ChunkEnd",
    "ChunkPlan",
    "ImagePiece",
    "Segment",
    "PlanError",
    "PrefillBucket",
    "VisionProtocol",
    "assemble_vision_embeds",
    "find_segments",
    "plan_chunks",
]
