"""H.264 encoding and decoding with PyAV, and poster images."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..storage.local import replacing

CODEC = "libx264"
PIX_FMT = "yuv420p"  # what browsers play
# x264's own defaults, which every clip was encoded with: until the thirty-seventh session the
# CRF 18 and preset veryfast this module asked for were dropped (setting the codec context's
# options replaced the stream's), so every QC figure and test was measured on CRF 23, medium
CRF = 23
PRESET = "medium"


STILL_FORMATS = ("image2", "png_pipe", "jpeg_pipe", "webp_pipe", "bmp_pipe", "tiff_pipe")  # pictures, not clips
PREALLOC_BYTES = 1 << 30  # decode fills in place from a stated frame count its duration does not back up to this much
HOLD_BYTES = 2 << 30  # a variable-rate file may grow past 4x its stored frames, played at one rate, up to this much


class VideoError(ValueError):
    """A file that cannot be read as video."""


def local(path: str | Path) -> str:
    """``path`` as FFmpeg's name of a local file: ``file:`` and the absolute path. A bare name is
    read as a URL, so a name with a colon (``take1:final.mp4``, an ISO time) was taken for a
    protocol ("Protocol not found")."""
    return "file:" + os.path.abspath(path)


def encode_h264(frames: np.ndarray, fps: float, path: str | Path, crf: int = CRF, preset: str = PRESET,
                sound=None) -> None:
    """Write (F, H, W, 3) uint8 RGB frames to an H.264 MP4 that plays in a browser.

    Odd widths or heights cannot be stored in yuv420p; they are refused, not cropped. Written
    to a temporary file beside ``path`` and renamed over it (``replacing``); a write that fails
    (a full disk: ``OSError``) leaves no partial file. ``sound``, an
    :class:`.audio.Sound` (:func:`.audio.read_sound`), goes along as AAC, interleaved with the video
    (typed by name only: ``audio`` reads through this module).
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
    with replacing(path) as tmp:
        # the index (moov) first, so a browser starts playing before it has the whole file
        with av.open(local(tmp), mode="w", format="mp4", container_options={"movflags": "+faststart"}) as out:
            stream = out.add_stream(CODEC, rate=rate)
            stream.width, stream.height, stream.pix_fmt = w, h, PIX_FMT
            stream.options = {"crf": str(crf), "preset": preset}
            audio = sound.writer(out) if sound is not None else None  # every stream before the first packet
            mux_frames(out, stream, (av.VideoFrame.from_ndarray(f, format="rgb24") for f in frames), rate, audio)


def mux_frames(out, stream, frames, fps: float | Fraction, audio=None) -> None:
    """Encode ``frames`` (``av.VideoFrame``) into the video ``stream`` of the container ``out``
    and mux them; with ``audio`` (an :class:`.audio.AacWriter`), the sound up to each frame's
    end after it, so that the streams interleave. Then flush both encoders."""
    for i, frame in enumerate(frames):
        for packet in stream.encode(frame):
            out.mux(packet)
        if audio is not None:
            audio.until((i + 1) / fps)
    for packet in stream.encode():
        out.mux(packet)
    if audio is not None:
        audio.close()


def reason(e: Exception) -> str:
    """FFmpeg's reason without its errno and path: 'Invalid data found when processing input'."""
    if isinstance(e, IndexError):
        return "it has no video stream"
    return getattr(e, "strerror", None) or str(e)


def video_stream(container, path):
    """The first video stream that is a clip: not a still picture, not an audio file's cover art."""
    import av

    if container.format.name in STILL_FORMATS:
        raise VideoError(f"{path}: a still picture ({container.format.name}), not a video")
    streams = container.streams.video
    clips = [s for s in streams if not s.disposition & av.stream.Disposition.attached_pic]
    if streams and not clips:
        raise VideoError(f"{path}: it has no video stream, only a cover picture")
    return clips[0] if clips else streams[0]  # IndexError: no video stream


def probe(path: str | Path) -> dict:
    """Codec, size, frame rate and frame count of a video file's first video stream, read from
    its packets without decoding: ``frames`` as stored, ``decoded_frames`` as :func:`decode` will
    return them (a variable-rate file's held pictures repeated at one rate, :func:`constant_rate`)."""
    import av

    try:
        with av.open(local(path)) as container:
            stream = video_stream(container, path)
            stated = tuple(float(r) for r in (stream.guessed_rate, stream.average_rate) if r)
            packets = [p for p in container.demux(stream) if p.size]
            times = sorted(float(p.pts * p.time_base) for p in packets if p.pts is not None)
            info = {
                "codec": stream.codec_context.name,
                "pix_fmt": stream.codec_context.pix_fmt,
                "width": stream.codec_context.width,
                "height": stream.codec_context.height,
                "fps": float(stream.average_rate or stream.guessed_rate or 0),
                "frames": len(packets),
            }
    except (av.error.FFmpegError, IndexError) as e:
        raise VideoError(f"{path}: not a readable video ({reason(e)})") from e
    cfr = constant_rate(times, stated) if len(times) == len(packets) else None
    info["decoded_frames"] = len(cfr[0]) if cfr is not None else len(packets)
    return info


def decode(path: str | Path, min_frames: int = 1) -> tuple[np.ndarray, float]:
    """All frames of the first video stream as (F, H, W, 3) uint8 RGB, as a viewer sees them, and
    the frame rate.

    - Turned upright by the stream's display matrix (a phone's portrait clip is stored on its side).
    - At one constant rate: a variable-rate file (a screen or phone recording, ``-vsync vfr``
      output) stores a held picture once with a long duration; its frames are repeated on the
      grid of the rate most of its frames keep (``constant_rate``), as ``ffmpeg -vsync cfr``
      does, so that QC sees the hold as the frozen frames it is and interpolation keeps the
      clip's timing. A file already at one frame a tick is returned as stored.
    - Fewer than ``min_frames`` frames is a VideoError (QC compares frames: it needs 2).
    """
    import av

    try:
        with av.open(local(path)) as container:
            stream = video_stream(container, path)
            stream.thread_type = "AUTO"  # frame and slice threads
            stated = tuple(float(r) for r in (stream.guessed_rate, stream.average_rate) if r)
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            w, h = stream.codec_context.width, stream.codec_context.height
            out = None  # filled in place up to the frame count the container states, where it is believable
            if stream.frames and w and h:
                out = np.empty((_believable(stream, w * h * 3), h, w, 3), np.uint8)
            more, times, rotation, size, n = [], [], 0, None, 0
            for f in container.decode(stream):
                if size is None:
                    size, rotation = (f.width, f.height), int(getattr(f, "rotation", 0) or 0)
                elif (f.width, f.height) != size:
                    raise VideoError(f"{path}: frame {n} is {f.width}x{f.height} but frame 0 is "
                                     f"{size[0]}x{size[1]}; a clip must keep one frame size (was it joined from two videos?)")
                if out is not None and n < len(out) and (f.height, f.width) == out.shape[1:3]:
                    _rgb(f, out[n])
                else:
                    more.append(_rgb(f))
                times.append(f.time)
                n += 1
    except (av.error.FFmpegError, IndexError) as e:
        raise VideoError(f"{path}: not a readable video ({reason(e)})") from e
    if n == 0:
        raise VideoError(f"{path}: the video stream has no frames")
    if n < min_frames:
        raise VideoError(f"{path}: it has {n} frame{'s' if n != 1 else ''}; at least {min_frames} are needed "
                         "(frames are compared with each other: a still picture is not a clip)")
    if out is None:
        out = np.stack(more)
    elif more:  # more frames than stated, or frames of another size than stated: rare, take the slow path
        out = np.concatenate([out[: n - len(more)], np.stack(more)])
    else:
        out = out[:n]
    del more
    if (cfr := constant_rate(times, stated)) is not None:
        order, rate = cfr
        grown = len(order) * out[0].nbytes
        if len(order) > 4 * n and grown > HOLD_BYTES:
            raise VideoError(f"{path}: a variable-rate file of {n} frames that plays as {len(order)} at {rate:g} fps "
                             f"({grown / 2**30:.1f} GiB of {w}x{h} frames; a long held picture, or broken timestamps); "
                             f"clips are read whole, at most {HOLD_BYTES / 2**30:g} GiB and 4x the stored frames this "
                             "way: cut it shorter")
        out, fps = out[order], rate
    if rotation % 360:
        out = np.ascontiguousarray(np.rot90(out, k=round(rotation / 90) % 4, axes=(1, 2)))
    return out, fps


def _believable(stream, frame_bytes: int) -> int:
    """The frames to make room for: the count the container states, when its duration backs it
    up (a header may claim 2e9 frames: 335 TiB), else at most ``PREALLOC_BYTES`` of them."""
    limit = PREALLOC_BYTES // frame_bytes + 1
    try:
        seconds = float(stream.duration * stream.time_base)
        rate = float(stream.average_rate or stream.guessed_rate)
        limit = max(limit, int(seconds * rate * 1.1) + 16)
    except (TypeError, ZeroDivisionError):  # no duration or no rate stated
        pass
    return min(stream.frames, limit)


def constant_rate(times: list[float | None], rates: tuple[float, ...] = ()) -> tuple[list[int], float] | None:
    """For frames shown from ``times`` (seconds), the frame on screen at each tick of the clip's
    own rate, and that rate (``ffmpeg -vsync cfr``: a held frame repeats); None when they already
    are one frame a tick (within half a tick), or carry no times. The rate is the one most
    frames keep, the median interval (snapped to one of the stated ``rates`` within 2%): a held
    picture stretches one interval, not the median. The last frame counts one tick (a
    container's last duration is often wrong). Pure: a function of the timestamps alone."""
    if len(times) < 3 or any(t is None for t in times):
        return None
    t = np.asarray(times, dtype=np.float64)
    gaps = np.diff(t)
    if np.any(gaps <= 0):  # times that go back (segments joined byte for byte) or repeat: read as stored
        return None
    tick = float(np.median(gaps))
    on_grid = [r for r in (*rates, 1.0 / tick) if r > 0 and _fits(t, 1.0 / r)]
    if on_grid:  # one frame a tick of a stated rate or its own (millisecond timestamps of 120 fps included)
        return None
    rate = next((r for r in rates if r > 0 and abs(r * tick - 1) < 0.02), 1.0 / tick)
    tick, t0 = 1.0 / rate, times[0]
    order, i = [], 0
    for k in range(round((times[-1] - t0) * rate) + 1):
        t = t0 + k * tick + tick / 2  # the frame on screen at the middle of the tick
        while i + 1 < len(times) and times[i + 1] <= t:
            i += 1
        order.append(i)
    return order, rate


def _fits(t: np.ndarray, tick: float) -> bool:
    """Whether frame i of times ``t`` lies within half a tick of the i-th tick after the first."""
    return bool(np.all(np.abs(t - t[0] - np.arange(len(t)) * tick) < tick / 2))


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
