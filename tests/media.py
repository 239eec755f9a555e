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
