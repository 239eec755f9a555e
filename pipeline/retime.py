"""Frame-rate conversion, first version: linear blending of the two nearest frames.

The output keeps the clip's timing: ``round((n - 1) * fps_out / fps_in) + 1`` frames, output
frame k showing input time ``k * fps_in / fps_out``; the first equals the first input frame.
"""

from __future__ import annotations

import numpy as np


def output_count(n: int, fps_in: float, fps_out: float) -> int:
    if n < 1:
        raise ValueError(f"n={n}: need at least one frame")
    if fps_in <= 0 or fps_out <= 0:
        raise ValueError(f"fps_in={fps_in}, fps_out={fps_out}: frame rates must be positive")
    return int(round((n - 1) * fps_out / fps_in)) + 1


def source_times(n: int, fps_in: float, fps_out: float) -> np.ndarray:
    """Position of each output frame on the input's frame axis (0 .. n-1)."""
    m = output_count(n, fps_in, fps_out)
    if m == 1:
        return np.zeros(1)
    return np.minimum(np.arange(m) * fps_in / fps_out, n - 1)


def retime_linear(frames: np.ndarray, fps_in: float, fps_out: float) -> np.ndarray:
    """Convert (F, H, W, C) uint8 frames from ``fps_in`` to ``fps_out`` by blending neighbours."""
    n = len(frames)
    if fps_in == fps_out:
        return frames
    pos = source_times(n, fps_in, fps_out)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n - 1)
    w = (pos - lo)[:, None, None, None].astype(np.float32)
    out = frames[lo].astype(np.float32) * (1 - w) + frames[hi].astype(np.float32) * w
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
