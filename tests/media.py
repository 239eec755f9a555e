"""Video files written for tests by PyAV directly, not by ``pipeline.video.encode_h264``: other
codecs and containers, chosen timestamps, files as users' tools write them."""

from __future__ import annotations

from fractions import Fraction
from typing import Iterable

import numpy as np


def write_video(path, frames: Iterable[np.ndarray], rate: int = 24, codec: str = "libx264", container: str | None = None,
                pix_fmt: str = "yuv420p", options: dict | None = None, pts_ms: list[int] | None = None) -> None:
    """(H, W, 3) uint8 RGB ``frames`` (an array of them, or any iterable: a long clip need not be
    held whole) as ``codec`` in ``container`` (by default the one the
    name's suffix says) at ``rate``, converted to ``pix_fmt``, with the encoder's ``options``.
    ``pts_ms`` gives each frame's time in milliseconds (a variable-rate file); without it the
    muxer numbers the frames one a tick."""
    import av

    with av.open(str(path), "w", format=container) as c:
        s = c.add_stream(codec, rate=rate)
        for i, f in enumerate(frames):
            if i == 0:
                s.width, s.height, s.pix_fmt = f.shape[1], f.shape[0], pix_fmt
                if options:
                    s.options = options
                if pts_ms is not None:
                    s.codec_context.time_base = Fraction(1, 1000)
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            if pts_ms is not None:
                vf.pts, vf.time_base = pts_ms[i], Fraction(1, 1000)
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)



def write_with_sound(path, start: float, rate: int, hz: float, seconds: float = 1.0, side: int = 64, fps: int = 24,
                     container: str | None = None, damage: float = 0.0, seed: int = 0,
                     replace: dict[int, bytes] | None = None) -> None:
    """A clip of black frames from ``start`` for ``seconds`` (timestamps from ``start``: two
    MPEG-TS files written so and joined byte for byte are one clip, as a cut tool joins them)
    with a stereo AAC track at ``rate``: a sine of ``hz`` at 0.3 over the same time. ``damage``:
    the share of the audio packets whose bytes are replaced by random ones (drawn from
    ``seed``), as in a damaged copy; ``replace``: audio packet number -> the bytes it gets instead."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", format=container) as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = side, side, "yuv420p"
        a = c.add_stream("aac", rate=rate, layout="stereo")
        for k in range(round(seconds * fps)):
            vf = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
            vf.pts, vf.time_base = round(start * fps) + k, Fraction(1, fps)
            for p in v.encode(vf):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        n = round(seconds * rate)
        x = (0.3 * np.sin(2 * np.pi * hz * np.arange(n) / rate)).astype(np.float32)
        frames = []
        for i in range(0, n, 1024):
            af = av.AudioFrame.from_ndarray(np.stack([x[i:i + 1024]] * 2), format="fltp", layout="stereo")
            af.sample_rate, af.pts, af.time_base = rate, round(start * rate) + i, Fraction(1, rate)
            frames.append(af)
        for k, packet in enumerate([p for af in [*frames, None] for p in a.encode(af)]):
            if rng.random() < damage:
                packet.update(bytes(rng.integers(0, 256, packet.size, dtype=np.uint8)))
            if replace and k in replace:
                other = av.Packet(replace[k])
                other.pts, other.dts, other.time_base, other.duration = (packet.pts, packet.dts, packet.time_base,
                                                                         packet.duration)
                other.stream, packet = a, other
            c.mux(packet)
