"""Per-frame and frame-pair metrics over (F, H, W, 3) uint8 RGB frames.

Work is done on a grayscale copy downscaled to at most ``max_side`` pixels on its long side:
the defects QC looks for are visible there, and the cost stays small next to rendering.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np


@dataclass
class FrameSeries:
    luma_mean: np.ndarray  # (F,) mean luma 0..255
    luma_std: np.ndarray  # (F,) spatial standard deviation of luma
    diff: np.ndarray  # (F-1,) mean absolute difference of consecutive frames, 0..255
    ssim: np.ndarray  # (F-1,) SSIM of consecutive frames, -1..1


def gray_small(frames: np.ndarray, max_side: int = 320) -> np.ndarray:
    """(F, h, w) float32 luma, downscaled so the long side is at most ``max_side``."""
    f, h, w = frames.shape[:3]
    scale = min(1.0, max_side / max(h, w))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    out = np.empty((f, size[1], size[0]), np.float32)
    for i, frame in enumerate(frames):
        g = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
        if scale < 1.0:
            g = cv2.resize(g, size, interpolation=cv2.INTER_AREA)
        out[i] = g
    return out


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM of two float32 grayscale images (0..255) with an 11x11 Gaussian window, sigma 1.5."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    blur = lambda x: cv2.GaussianBlur(x, (11, 11), 1.5)  # noqa: E731
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a * mu_a
    var_b = blur(b * b) - mu_b * mu_b
    cov = blur(a * b) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a * mu_a + mu_b * mu_b + c1) * (var_a + var_b + c2)
    return float(np.mean(num / den))


def frame_series(frames: np.ndarray, max_side: int = 320) -> FrameSeries:
    g = gray_small(frames, max_side)
    diff = np.array([np.mean(np.abs(g[i + 1] - g[i])) for i in range(len(g) - 1)], np.float64)
    ss = np.array([ssim(g[i], g[i + 1]) for i in range(len(g) - 1)], np.float64)
    return FrameSeries(
        luma_mean=g.mean(axis=(1, 2)).astype(np.float64),
        luma_std=g.std(axis=(1, 2)).astype(np.float64),
        diff=diff,
        ssim=ss,
    )


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Inclusive (start, end) index ranges where ``mask`` is true."""
    out, start = [], None
    for i, v in enumerate(mask):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i - 1))
            start = None
    if start is not None:
        out.append((start, len(mask) - 1))
    return out
