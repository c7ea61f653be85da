"""Fixed EVS cases for the vLLM comparison: clip embeddings, grids, rates and prompts, built from seeds.

Shared by ``tests/test_video_pruning_vllm.py`` (ours against the recording, and against vLLM itself
when its ``evs.py`` is installed) and ``python -m tests.evs_cases --record`` (which writes the
recording with vLLM's functions). Embeddings are small and seeded; the ``ties`` and ``static``
cases make scores that tie exactly or up to rounding, where only vLLM's own float32 arithmetic
and stable sort give vLLM's mask.

Prompts use the tiny Qwen checkpoints' special ids (``IDS``; the test checks they still hold).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

RECORDING = Path(__file__).resolve().parent / "golden" / "video_pruning" / "vllm_evs.json"
#: Where the opt-in check looks for vLLM's evs.py when vLLM is not importable here.
EVS_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm-evs"
EVS_PATH = Path("vllm") / "multimodal" / "video_prune" / "evs.py"
MERGE = 2
#: The tiny Qwen2.5-VL / Qwen3-VL checkpoints' ids and Qwen2.5-VL's tokens_per_second.
IDS = {"vision_start": 259, "vision_end": 260, "image": 261, "video": 262}
TOKENS_PER_SECOND = 4
TEXT = 40  # an ordinary token id

#: (name, kind, seed, merged grid (frames, rows, cols), row width, rate)
MASK_CASES = [
    ("random-half", "random", 0, (4, 3, 4), 16, 0.5),
    ("random-three-quarters", "random", 1, (4, 3, 4), 16, 0.75),
    ("random-truncated", "random", 2, (3, 3, 3), 8, 0.3),
    ("tiny-grid", "random", 3, (2, 1, 1), 8, 0.5),
    ("one-temporal-patch", "random", 4, (1, 2, 2), 8, 0.75),
    ("ties", "ties", 5, (4, 2, 3), 4, 0.5),
    ("static-scene", "static", 6, (3, 2, 2), 32, 0.5),
    ("zero-rows", "zeros", 7, (3, 2, 2), 8, 0.5),
    ("wide-rows", "random", 8, (4, 2, 2), 96, 0.6),
]
#: (name, family, mask case of the clip, image merged (rows, cols), image first, second_per_grid_ts).
#: vLLM v0.33.0's ``recompute_mrope_positions``, given several items in one call, advances its
#: token count by each item's rows, not by the prompt tokens around them; an item is then placed
#: at a vision start inside the previous item when that one is shorter than the text before it
#: (for a Qwen3-VL clip: when its last frame kept fewer rows than that text, or when it follows an
#: image shorter than the text before the image plus the clip's first timestamp). We position the
#: whole prompt at once and do not reproduce that; the cases keep every item longer than what
#: precedes it, as in real prompts of hundreds of rows per item.
PROMPT_CASES = [
    ("qwen2_5_vl-clip-then-tall-image", "qwen2_5_vl", "random-half", (3, 1), False, 1.0),
    ("qwen2_5_vl-image-then-clip-1.5s", "qwen2_5_vl", "ties", (2, 2), True, 1.5),
    ("qwen2_5_vl-image-then-tiny-clip", "qwen2_5_vl", "tiny-grid", (2, 2), True, 0.5),
    ("qwen3_vl-clip-then-tall-image", "qwen3_vl", "random-half", (3, 1), False, 1.0),
    ("qwen3_vl-image-then-clip", "qwen3_vl", "random-three-quarters", (3, 3), True, 1.0),
    ("qwen3_vl-image-then-static-clip", "qwen3_vl", "static-scene", (3, 3), True, 1.0),
]


def embeddings(kind: str, seed: int, grid: tuple[int, int, int], width: int) -> np.ndarray:
    """The clip's rows [frames * rows * cols, width], float32."""
    rng = np.random.default_rng(seed)
    frames, rows, cols = grid
    count = frames * rows * cols
    if kind == "ties":  # 0/1 rows: cosines of 0, 1/2, 1/sqrt(2), 1 ... repeat exactly
        values = rng.integers(0, 2, size=(count, width)).astype(np.float32)
        values[:, 0] = 1.0  # no zero row
        return values
    if kind == "static":  # every temporal patch the same: all later scores ~0 up to rounding
        frame = rng.standard_normal((rows * cols, width)).astype(np.float32)
        return np.tile(frame, (frames, 1))
    values = rng.standard_normal((count, width)).astype(np.float32)
    if kind == "zeros":  # zero rows: cosine's eps clamp makes their score 1
        values[[1, rows * cols + 2, count - 1]] = 0.0
    return values


def digest(array: np.ndarray) -> str:
    """Short hash of an array's bytes (the recording names the inputs it was made from)."""
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=8).hexdigest()


def mask_case(name: str) -> tuple:
    return next(case for case in MASK_CASES if case[0] == name)


def _timestamp(frame: int) -> list[int]:
    """Stand-in tokens of Qwen3-VL's "<t seconds>" text before a frame (ordinary ids)."""
    return [TEXT + 1, TEXT + 2 + frame, TEXT + 1]


def prompt(case: tuple, mask: np.ndarray) -> dict:
    """The unpruned and pruned prompt of a prompt case, and what each side needs to position it.

    Returns a dict: ``processed`` (the unpruned processor-like outputs our host reads), ``keep``
    (bool per unpruned token), ``masks`` (per item in prompt order, None for the image),
    ``pruned_ids``, and ``media`` (per item in prompt order: kind, merged grid, relative
    positions of every row/span token as vLLM's model code builds them before pruning).
    """
    _, family, clip_name, (image_rows, image_cols), image_first, seconds = case
    _, _, _, (frames, rows, cols), _, _ = mask_case(clip_name)
    per_frame = rows * cols
    image = [IDS["vision_start"], *[IDS["image"]] * (image_rows * image_cols), IDS["vision_end"]]
    if family == "qwen3_vl":  # one run per temporal patch, each after its timestamp
        clip = []
        for frame in range(frames):
            clip += [*_timestamp(frame), IDS["vision_start"], *[IDS["video"]] * per_frame, IDS["vision_end"]]
    else:
        clip = [IDS["vision_start"], *[IDS["video"]] * (frames * per_frame), IDS["vision_end"]]
    items = [image, clip] if image_first else [clip, image]
    ids = [TEXT] * 3 + items[0] + [TEXT] * 2 + items[1] + [TEXT] * 2
    ids = np.array(ids, dtype=np.int64)
    keep = np.ones(len(ids), dtype=bool)
    keep[np.flatnonzero(ids == IDS["video"])] = mask
    processed = {
        "input_ids": ids[None],
        "image_grid_thw": np.array([[1, image_rows * MERGE, image_cols * MERGE]], dtype=np.int64),
        "video_grid_thw": np.array([[frames, rows * MERGE, cols * MERGE]], dtype=np.int64),
        "second_per_grid_ts": np.array([seconds], dtype=np.float32),
        # Pixels are not read for positions; their keys say which modalities the prompt has.
        "pixel_values": np.zeros((0, 1), np.float32),
        "pixel_values_videos": np.zeros((0, 1), np.float32),
    }
    masks = [None, mask] if image_first else [mask, None]
    return {"processed": processed, "keep": keep, "masks": masks, "pruned_ids": ids[keep]}


def vllm_positions(evs, case: tuple, mask: np.ndarray) -> np.ndarray:
    """vLLM's recomputed M-RoPE positions [3, pruned length] of a prompt case (its functions, its rules).

    Builds each item's ``multimodal_positions`` as the model code does (ref: vLLM v0.33.0
    ``Qwen2_5_VLForConditionalGeneration._postprocess_*_embeds_evs``: ``compute_mrope_for_media``
    rows, a clip's kept ones only, ``second_per_grid_ts`` cast to long; ``Qwen3VLForConditionalGeneration``:
    5 channels, a clip's whole span of timestamp, marker and kept video tokens at their unpruned
    relative positions, channel 3 flagging vision starts and 4 video rows), then calls
    ``recompute_mrope_positions`` on the pruned ids from text-only initial positions.
    """
    import torch

    _, family, clip_name, (image_rows, image_cols), image_first, seconds = case
    _, _, _, (frames, rows, cols), _, _ = mask_case(clip_name)
    built = prompt(case, mask)
    ids = torch.as_tensor(built["pruned_ids"])
    image = evs.compute_mrope_for_media(torch.tensor([1, image_rows * MERGE, image_cols * MERGE]), MERGE)
    unmerged = torch.tensor([frames, rows * MERGE, cols * MERGE])
    if family == "qwen3_vl":
        image = torch.cat([image, torch.zeros_like(image[:, :1])], dim=1)
        span, relative, position = [], [], 0
        for frame in range(frames):  # HF/vLLM Qwen3-VL: timestamps are text, a frame is a (1, h, w) image
            for token in [*_timestamp(frame), IDS["vision_start"]]:
                span.append(token)
                relative.append([position] * 3)
                position += 1
            for row in range(rows):
                for col in range(cols):
                    span.append(IDS["video"])
                    relative.append([position, position + row, position + col])
            position += max(rows, cols)
            span.append(IDS["vision_end"])
            relative.append([position] * 3)
            position += 1
        span_ids = torch.tensor(span)
        keep = torch.ones(len(span), dtype=torch.bool)
        keep[span_ids == IDS["video"]] = torch.as_tensor(mask)
        clip = torch.zeros(len(span), 5, dtype=torch.long)
        clip[:, :3] = torch.tensor(relative)
        clip[:, 3] = span_ids == IDS["vision_start"]
        clip[:, 4] = span_ids == IDS["video"]
        clip = clip[keep]
    else:
        clip = evs.compute_mrope_for_media(
            unmerged, MERGE, tokens_per_second=TOKENS_PER_SECOND, video_second_per_grid=int(seconds)
        )[torch.as_tensor(mask)]
    media = [image, clip] if image_first else [clip, image]
    initial = torch.arange(len(ids)).expand(3, -1).clone()
    positions, _ = evs.recompute_mrope_positions(
        ids,
        [item.permute(1, 0).long() for item in media],
        initial,
        0,
        IDS["vision_start"],
        IDS["image"],
        IDS["video"],
    )
    return positions.numpy()


def vllm_results(evs) -> dict:
    """Every case through vLLM's functions: masks, kept counts and positions."""
    import torch

    masks, positions = {}, {}
    for name, kind, seed, grid, width, rate in MASK_CASES:
        rows = embeddings(kind, seed, grid, width)
        unmerged = (grid[0], grid[1] * MERGE, grid[2] * MERGE)
        mask = evs.compute_retention_mask(torch.from_numpy(rows), unmerged, MERGE, rate).numpy()
        kept = evs.compute_retained_tokens_count(grid[1] * grid[2], grid[0], rate)
        masks[name] = {"inputs": digest(rows), "kept": int(kept), "mask": mask.astype(int).tolist()}
    for case in PROMPT_CASES:
        mask = np.array(masks[case[2]]["mask"], dtype=bool)
        positions[case[0]] = vllm_positions(evs, case, mask).tolist()
    return {"masks": masks, "positions": positions}


def find_vllm_evs() -> tuple[object, str] | None:
    """vLLM's evs module and version: importable here, or installed in ``.venv-vllm-evs``; else None.

    The module is loaded from its file: ``import vllm`` runs vLLM's package init (its platform
    and compiled dependencies), while evs.py itself needs only torch.
    """
    from importlib import metadata

    found = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in found.submodule_search_locations] if found else []
    roots = [root.parent for root in roots]
    roots += sorted(EVS_VENV.glob("lib/python*/site-packages"))
    for root in roots:
        path = root / EVS_PATH
        if not path.is_file():
            continue
        infos = sorted(root.glob("vllm-*.dist-info"))
        version = infos[-1].name.removesuffix(".dist-info").split("-")[1] if infos else None
        if version is None:
            try:
                version = metadata.version("vllm")
            except metadata.PackageNotFoundError:
                version = "unknown"
        spec = importlib.util.spec_from_file_location("vllm_evs_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, version
    return None


def main(argv: list[str]) -> int:
    """``python -m tests.evs_cases --record``: write the recording with the installed vLLM."""
    if argv != ["--record"]:
        print("usage: python -m tests.evs_cases --record", file=sys.stderr)
        return 2
    found = find_vllm_evs()
    if found is None:
        print(f"vLLM's evs.py not found (importable vllm, or {EVS_VENV})", file=sys.stderr)
        return 2
    evs, version = found
    results = {"vllm": version, **vllm_results(evs)}
    RECORDING.parent.mkdir(parents=True, exist_ok=True)
    temporary = RECORDING.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=1) + "\n")
    temporary.replace(RECORDING)
    print(f"wrote {RECORDING} (vLLM {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
