"""Images and clips as a conversation takes them: RGB PIL images, and frames with their rate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision.bad_input import reading
from qeff_vision.errors import UserError

ImageSource = Any  # a path (str or Path) or a PIL image


def load_image(source: ImageSource):
    """An RGB PIL image from a path or a PIL image.

    Raises:
        UserError: The file is missing or is not an image PIL can read.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    path = Path(source)
    if not path.is_file():
        raise UserError(f"{path}: no such image file")
    # PIL refuses a header claiming more than Image.MAX_IMAGE_PIXELS (DecompressionBombError)
    # before decoding anything: the bound on the work one image may ask for.
    with reading(path, "a readable image"), Image.open(path) as image:
        image.load()
        return image.convert("RGB")


FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
DEFAULT_FPS = 2.0


@dataclass
class Clip:
    """A video as the processor takes it: RGB frames and the rate they were sampled at.

    Attributes:
        frames: PIL images, in order.
        fps: Frames per second of ``frames`` (Qwen-VL times its temporal positions by it).
        source: Where it came from, for messages.
    """

    frames: list
    fps: float = DEFAULT_FPS
    source: str = "<clip>"


def load_video(source: Any, fps: float | None = None) -> Clip:
    """A :class:`Clip` from a directory of frame images (sorted by name) or a video file.

    Video files are decoded with PyAV (``av``: FFmpeg's decoders in a wheel, no system FFmpeg;
    transformers' own video loader uses it too), keeping every frame, or every n-th to reach
    ``fps`` when given. A directory's frames are taken at ``fps`` (2 when not given, Qwen-VL's
    sampling rate).

    Raises:
        UserError: A missing path, a directory without frames, an unreadable frame or file.
    """
    if isinstance(source, Clip):
        return source
    if fps is not None and fps <= 0:
        raise UserError(f"--fps must be positive, got {fps}")
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise UserError(f"{path}: no frame images ({', '.join(FRAME_SUFFIXES)}) in the directory")
        return Clip([load_image(file) for file in files], fps or DEFAULT_FPS, str(path))
    if not path.is_file():
        raise UserError(f"{path}: no such video file or frame directory")
    return _decode_video_file(path, fps)


def _decode_video_file(path: Path, fps: float | None) -> Clip:
    try:
        import av
    except ImportError:
        raise UserError(
            f"{path}: reading video files needs PyAV (pip install av); or pass a directory of frames"
        ) from None
    with reading(path, "a readable video"), av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or 0) or DEFAULT_FPS
        frames = [frame.to_image().convert("RGB") for frame in container.decode(stream)]
    if not frames:
        raise UserError(f"{path}: not a readable video (no frames decoded)")
    if fps is None or fps >= rate:
        return Clip(frames, rate, str(path))
    step = rate / fps
    kept = [frames[int(i * step)] for i in range(int(len(frames) / step))]
    return Clip(kept, fps, str(path))
