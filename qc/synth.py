"""A labelled set of synthetic clips for measuring QC: good camera moves over real photographs,
and the same clips broken by each defect at two strengths.

Everything is made from scikit-image's bundled photographs with a seeded generator, so the set
is the same on every machine. ``clipmill qc --bench`` reports QC's confusion table on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from clipmill.pipeline.synthetic import camera_move, photo, sensor_noise

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
          "camera", "coins", "retina", "cat", "brick", "gravel", "moon")
MOTIONS = ("pan", "zoom", "static", "object", "pan+object", "tilt", "zoom-out")
DEFECTS = ("flicker", "garbage", "block", "black", "flat", "frozen", "cut", "exposure", "boiling", "blur")


@dataclass
class Clip:
    name: str
    frames: np.ndarray  # (F, H, W, 3) uint8
    fps: float
    label: str  # "good" or a defect name
    strength: int = 0  # 0 for good clips; 1 mild, 2 strong


def smooth_noise(shape: tuple, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Zero-mean, unit-std noise with blobs about ``scale`` pixels across."""
    z = cv2.GaussianBlur(rng.normal(0, 1, shape).astype(np.float32), (0, 0), scale)
    return z / (z.std() + 1e-6)


def apply_defect(frames: np.ndarray, defect: str, strength: int, rng: np.random.Generator, other: np.ndarray) -> np.ndarray:
    """``frames`` broken by ``defect``; ``other`` is an unrelated clip of the same shape (for cuts)."""
    f = frames.astype(np.float32)
    n, h, w = f.shape[:3]
    mid = int(rng.integers(n // 4, n // 2))
    if defect == "flicker":
        amp = (0.07, 0.18)[strength - 1]
        gain = 1 + amp * np.where(np.arange(n) % 2 == 0, 1, -1)
        f *= gain[:, None, None, None]
    elif defect == "garbage":
        k = (1, 3)[strength - 1]
        for i in range(mid, mid + k):
            f[i] = rng.integers(0, 256, f[i].shape)
    elif defect == "block":
        # decoder-style damage in part of the frame: noise, a solid macroblock colour, or
        # content from elsewhere in the frame; mild is smaller, shorter and half-transparent
        k = (2, 6)[strength - 1]
        frac = (rng.uniform(0.10, 0.18), rng.uniform(0.2, 0.35))[strength - 1]
        alpha = (0.6, 1.0)[strength - 1]
        bh, bw = int(h * frac), int(w * frac)
        y, x = int(rng.integers(0, h - bh)), int(rng.integers(0, w - bw))
        kind = rng.choice(["noise", "solid", "displaced"])
        colour = rng.integers(0, 256, 3)
        for i in range(mid, mid + k):
            if kind == "noise":
                patch = rng.integers(0, 256, (bh, bw, 3))
            elif kind == "solid":
                patch = np.broadcast_to(colour, (bh, bw, 3))
            else:
                patch = np.roll(f[i], (h // 2, w // 2), (0, 1))[y : y + bh, x : x + bw]
            f[i, y : y + bh, x : x + bw] = alpha * patch + (1 - alpha) * f[i, y : y + bh, x : x + bw]
    elif defect == "black":
        k = (2, 8)[strength - 1]
        f[mid : mid + k] = rng.uniform(0, 6)
    elif defect == "flat":
        level = rng.uniform(40, 200)
        f[:] = level + (rng.normal(0, 0.6, f.shape) if strength == 1 else 0)
    elif defect == "frozen":
        k = (10, 20)[strength - 1]
        f[mid : mid + k] = f[mid]
    elif defect == "cut":
        f[mid:] = other.astype(np.float32)[mid:]
    elif defect == "exposure":
        ramp = np.linspace(0, 1, n) ** 1.5
        if rng.random() < 0.5:  # over-exposure: brightness climbs until highlights clip
            gain = 1 + ((0.8, 2.0)[strength - 1]) * ramp
            f = f * gain[:, None, None, None] + (gain[:, None, None, None] - 1) * 25
        else:  # colour blow-out: saturation climbs until colours clip
            boost = 1 + ((1.5, 3.5)[strength - 1]) * ramp
            grey = f.mean(axis=3, keepdims=True)
            f = grey + (f - grey) * boost[:, None, None, None] + ((35, 70)[strength - 1] * ramp)[:, None, None, None] * np.array([1.0, -0.3, -0.6])
    elif defect == "boiling":
        amp = (10.0, 22.0)[strength - 1]
        for i in range(n):
            f[i] += amp * smooth_noise((h, w), 1.2, rng)[..., None]
    elif defect == "blur":
        top = (3.0, 7.0)[strength - 1]
        for i in range(n):
            s = top * (i / (n - 1)) ** 1.2
            if s > 0.3:
                f[i] = cv2.GaussianBlur(f[i], (0, 0), s)
    else:
        raise ValueError(f"defect={defect!r}: allowed {', '.join(DEFECTS)}")
    return np.clip(f, 0, 255).astype(np.uint8)


def make_set(seed: int = 0, per_motion: int = 3, size: tuple[int, int] = (320, 192), n: int = 48,
             fps: float = 24.0) -> list[Clip]:
    """Good clips (each motion over several photos, some with sensor noise) and broken twins."""
    rng = np.random.default_rng(seed)
    clips: list[Clip] = []
    goods: list[np.ndarray] = []
    k = 0
    for motion in MOTIONS:
        for _ in range(per_motion):
            img = photo(PHOTOS[k % len(PHOTOS)])
            k += 1
            frames = camera_move(img, motion, n, size, rng)
            frames = sensor_noise(frames, float(rng.choice([0, 0, 1.5, 3.0])), rng)
            goods.append(frames)
            clips.append(Clip(f"good-{motion}-{k}", frames, fps, "good"))
    for d_i, defect in enumerate(DEFECTS):
        for strength in (1, 2):
            for j in range(2):
                idx = (d_i * 4 + strength * 2 + j) % len(goods)
                other = goods[(idx + len(goods) // 2) % len(goods)]
                frames = apply_defect(goods[idx], defect, strength, rng, other)
                clips.append(Clip(f"bad-{defect}{strength}-{j}", frames, fps, defect, strength))
    return clips
