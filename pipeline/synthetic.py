"""Synthetic clips over real photographs (scikit-image's bundled images): a virtual camera
panning, tilting or zooming, optional moving objects and sensor noise. Used to measure QC and
interpolation against known ground truth; the same on every machine for a given seed."""

from __future__ import annotations

import cv2
import numpy as np


def photo(name: str) -> np.ndarray:
    from skimage import data

    img = getattr(data, name)()
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    return np.ascontiguousarray(img[..., :3])


def camera_move(img: np.ndarray, motion: str, n: int, size: tuple[int, int], rng: np.random.Generator,
                speed: float | None = None, zoom: float | None = None) -> np.ndarray:
    """Frames of a virtual camera moving over ``img``; ``size`` is (width, height).

    ``speed``: pan/tilt pixels per frame at output size (default: random 1-6, either way);
    ``zoom``: total scale change over the clip (default: random 0.15-0.35)."""
    w, h = size
    ih, iw = img.shape[:2]
    base = max(w / iw, h / ih) * 1.5  # the view covers part of the photo, with room to move
    if speed is None:
        speed = rng.uniform(1.0, 6.0) * rng.choice([-1, 1])
    if zoom is None:
        zoom = rng.uniform(0.15, 0.35)
    frames = []
    for i in range(n):
        t = i / max(1, n - 1)
        s, dx, dy = base, 0.0, 0.0
        if motion.startswith("pan"):
            dx = speed * (i - n / 2)
        elif motion == "tilt":
            dy = speed * 0.6 * (i - n / 2)
        elif motion == "zoom":
            s = base * (1 + zoom * t)
        elif motion == "zoom-out":
            s = base * (1 + zoom * (1 - t))
        elif motion == "static":
            dx = 0.08 * i  # a near-static product shot drifts by a fraction of a pixel per frame
        m = np.array([[s, 0, w / 2 - s * iw / 2 + dx], [0, s, h / 2 - s * ih / 2 + dy]], np.float32)
        frames.append(cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT))
    out = np.stack(frames)
    if "object" in motion:
        out = add_object(out, rng)
    return out


def add_object(frames: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A textured disc that crosses the frame."""
    n, h, w = frames.shape[:3]
    r = int(min(h, w) * rng.uniform(0.12, 0.22))
    tex = cv2.resize(photo(str(rng.choice(["coffee", "chelsea", "astronaut"]))), (2 * r, 2 * r))
    yy, xx = np.mgrid[-r:r, -r:r]
    mask = (xx**2 + yy**2 < r * r)[..., None]
    y0, y1 = rng.uniform(r, h - r, 2)
    out = frames.copy()
    for i in range(n):
        t = i / max(1, n - 1)
        cx = int(r + t * (w - 2 * r))
        cy = int(y0 + t * (y1 - y0))
        ys, xs = slice(cy - r, cy + r), slice(cx - r, cx + r)
        out[i, ys, xs] = np.where(mask, tex, out[i, ys, xs])
    return out


def sensor_noise(frames: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    if sigma <= 0:
        return frames
    return np.clip(frames + rng.normal(0, sigma, frames.shape), 0, 255).astype(np.uint8)
