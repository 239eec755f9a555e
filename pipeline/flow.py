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


def chroma_pair(a: np.ndarray, b: np.ndarray, spread: float = 40.0, max_gain: float = 8.0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """RGB uint8 frames ``a`` and ``b`` as (Lab a, Lab b, chroma a, chroma b): the Lab frames
    (float32) and each frame's chroma projected on the pair's main chroma axis about the
    pair's mean chroma (128 in the image), stretched so that its std is about ``spread``
    levels (at most ``max_gain`` times), as uint8 images a flow can follow. An object of about
    its background's luma (a green square on mid-grey) has little luma edge but a strong one
    here."""
    if a.dtype != np.uint8 or b.dtype != np.uint8 or a.shape != b.shape or a.ndim != 3 or a.shape[-1] != 3:
        raise ValueError(f"chroma_pair: frames must be uint8 RGB (H, W, 3) of one size, got {a.dtype} {a.shape} and "
                         f"{b.dtype} {b.shape} (float Lab has no +128 offset)")
    la, lb = (cv2.cvtColor(x, cv2.COLOR_RGB2LAB).astype(np.float32) for x in (a, b))
    ab = np.concatenate([la[..., 1:].reshape(-1, 2), lb[..., 1:].reshape(-1, 2)])
    mean = ab.mean(axis=0)
    ab -= mean
    var, vec = np.linalg.eigh(ab.T @ ab / len(ab))
    axis, gain = vec[:, -1], min(max_gain, spread / float(np.sqrt(max(var[-1], 1e-6))))
    # centred on the pair's own mean chroma, not on neutral: a tinted frame (a beige background)
    # stretched about neutral would clip to one level and leave the flow nothing to follow
    chroma = [np.clip(128 + ((x[..., 1] - mean[0]) * axis[0] + (x[..., 2] - mean[1]) * axis[1]) * gain,
                      0, 255).astype(np.uint8) for x in (la, lb)]
    return la, lb, chroma[0], chroma[1]


def colour_flow(flow: FlowEstimator, a: np.ndarray, b: np.ndarray, luma_flow: np.ndarray, keep: float = 0.8,
                window: int = 5) -> np.ndarray:
    """``luma_flow`` (a -> b, computed on luma) with, per pixel, the flow of the pair's chroma
    (:func:`chroma_pair`) where that explains the colour frames better: its Lab warp residual,
    averaged over ``window`` px, under ``keep`` times the luma flow's. ``a`` and ``b`` RGB uint8."""
    la, lb, ca, cb = chroma_pair(a, b)
    fc = flow(ca, cb)
    rl = cv2.blur(np.abs(la - warp(lb, luma_flow)).sum(axis=-1), (window, window))
    rc = cv2.blur(np.abs(la - warp(lb, fc)).sum(axis=-1), (window, window))
    return np.where((rc < keep * rl)[..., None], fc, luma_flow).astype(np.float32)


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
