"""H.264 encoding and decoding with PyAV, and poster images."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

CODEC = "libx264"
PIX_FMT = "yuv420p"  # what browsers play


class VideoError(ValueError):
    """A file that cannot be read as video."""


def encode_h264(frames: np.ndarray, fps: float, path: str | Path, crf: int = 18) -> None:
    """Write (F, H, W, 3) uint8 RGB frames to an H.264 MP4 that plays in a browser.

    Odd widths or heights cannot be stored in yuv420p; they are refused, not cropped.
    """
    import av

    frames = np.ascontiguousarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames: expected (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    f, h, w, _ = frames.shape
    if f == 0:
        raise ValueError("frames: no frames to encode")
    if h % 2 or w % 2:
        raise ValueError(f"frames: {w}x{h} has an odd side; yuv420p needs even width and height")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format="mp4") as out:
        stream = out.add_stream(CODEC, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, PIX_FMT
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        stream.codec_context.options = {"movflags": "+faststart"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _why(e: Exception) -> str:
    """FFmpeg's reason without its errno and path: 'Invalid data found when processing input'."""
    if isinstance(e, IndexError):
        return "it has no video stream"
    return getattr(e, "strerror", None) or str(e)


def probe(path: str | Path) -> dict:
    """Codec, size, frame rate and frame count of a video file's first video stream."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = sum(1 for _ in container.demux(stream) if _.size)
            return {
                "codec": stream.codec_context.name,
                "pix_fmt": stream.codec_context.pix_fmt,
                "width": stream.codec_context.width,
                "height": stream.codec_context.height,
                "fps": float(stream.average_rate or stream.guessed_rate or 0),
                "frames": frames,
            }
    except (av.error.FFmpegError, IndexError) as e:
        raise VideoError(f"{path}: not a readable video ({_why(e)})") from e


def decode(path: str | Path) -> tuple[np.ndarray, float]:
    """All frames of the first video stream as (F, H, W, 3) uint8 RGB, and the frame rate."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame and slice threads
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            out = None  # filled in place when the container states its frame count
            if stream.frames and stream.codec_context.width and stream.codec_context.height:
                out = np.empty((stream.frames, stream.codec_context.height, stream.codec_context.width, 3), np.uint8)
            frames, n, size = [], 0, None
            for f in container.decode(stream):
                if size is None:
                    size = (f.width, f.height)
                elif (f.width, f.height) != size:
                    raise VideoError(f"{path}: frame {n} is {f.width}x{f.height} but frame 0 is {size[0]}x{size[1]}; "
                                     "a clip must keep one frame size (was it joined from two videos?)")
                if out is not None and n < len(out) and (f.height, f.width) == out.shape[1:3]:
                    _rgb(f, out[n])
                else:
                    frames.append(_rgb(f))
                n += 1
    except (av.error.FFmpegError, IndexError) as e:
        raise VideoError(f"{path}: not a readable video ({_why(e)})") from e
    if n == 0:
        raise VideoError(f"{path}: the video stream has no frames")
    if out is None:
        return np.stack(frames), fps
    if frames:  # more frames than stated, or frames of another size than stated: rare, take the slow path
        return np.concatenate([out[: n - len(frames)], np.stack(frames)]), fps
    return out[:n], fps


def _rgb(frame, dst: np.ndarray | None = None) -> np.ndarray:
    """RGB of a decoded frame (into ``dst`` if given); yuv420p through OpenCV, about twice as
    fast as swscale."""
    import cv2

    if frame.format.name == "yuv420p" and frame.width % 2 == 0 and frame.height % 2 == 0:
        return cv2.cvtColor(frame.to_ndarray(), cv2.COLOR_YUV2RGB_I420, dst=dst)
    rgb = frame.to_ndarray(format="rgb24")
    if dst is not None:
        dst[...] = rgb
        return dst
    return rgb


def poster_jpeg(frames: np.ndarray, quality: int = 90) -> bytes:
    """A JPEG of the middle frame."""
    import cv2

    frame = frames[len(frames) // 2]
    ok, buf = cv2.imencode(".jpg", frame[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("poster: JPEG encoding failed")
    return buf.tobytes()
