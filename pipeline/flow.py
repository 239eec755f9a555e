"""Dense optical flow (OpenCV DIS), backward warping and SSIM: shared by interpolation and QC."""

from __future__ import annotations

import cv2
import numpy as np

PRESETS = {
    "ultrafast": cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST,
    "fast": cv2.DISOPTICAL_FLOW_PRESET_FAST,
    "medium": cv2.DISOPTICAL_FLOW_PRESET_MEDIUM,
}


class FlowEstimator:
    """DIS optical flow; one instance per thread (it keeps buffers between calls)."""

    def __init__(self, preset: str = "ultrafast"):
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r}: allowed {', '.join(PRESETS)}")
        self.dis = cv2.DISOpticalFlow_create(PRESETS[preset])

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Flow (h, w, 2) with a(x) ~ b(x + flow(x)); ``a`` and ``b`` uint8 grayscale."""
        return self.dis.calc(a, b, None)


_GRIDS: dict = {}


def _grid(h: int, w: int) -> np.ndarray:
    grid = _GRIDS.get((h, w))
    if grid is None:
        gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
        grid = np.dstack([gx, gy])
        if len(_GRIDS) > 8:
            _GRIDS.clear()
        _GRIDS[(h, w)] = grid
    return grid


def warp(img: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """Backward warp: sample ``img`` at x + flow(x), bilinear, edges replicated."""
    m = (_grid(*flow.shape[:2]) + flow).astype(np.float32, copy=False)
    return cv2.remap(img, m, None, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def ssim_map(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SSIM map of two float32 grayscale images (0..255), Gaussian window sigma 1.5."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    blur = lambda x: cv2.GaussianBlur(x, (11, 11), 1.5)  # noqa: E731
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a * mu_a
    var_b = blur(b * b) - mu_b * mu_b
    cov = blur(a * b) - mu_a * mu_b
    return ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a * mu_a + mu_b * mu_b + c1) * (var_a + var_b + c2))
