"""A second reader of the shapes world, built apart from ``qc.adherence``, to check it.

``clipmill run`` keeps, of up to ``--draws`` renders of a shapes-world clip, the first one that
``qc.adherence`` (the analyzer) reads clearly as its prompt asks. The same analyzer then scores the
delivered clips, so its figure is an upper bound for what an independent reader agrees with.
This module is that independent reader, as far as one written in the same project can be: it
shares no code or measurement with the analyzer, only the conventions the issue states.

- **Background**: the median colour of the frame's outer ring, by luma and warmth (black is
  dark; beige is red well above blue; grey neither).
- **Shape**: the pixels no background can make, by HSV: saturated colour, or near-white; the
  largest such blob per frame. Colour by the blob's mean hue (or white by its low saturation);
  shape by its taper (an upright triangle is a third as wide a quarter of the way down as three
  quarters down) and how much of its bounding box it fills (a square all, a circle pi/4),
  median over the frames.
- **Camera**: per frame pair, a grid search (not optical flow) for the magnification about the
  centre and the horizontal shift that carry one frame onto the next with the least difference
  on the background, the shape left out. Chained over the clip.
- **Motion**: the blob's centre mapped back through the chained camera to the first frame's
  background, and its net travel (last against first, the ends averaged over two frames) as a
  fraction of the frame side.

The thresholds are the issue's figures, halved where it gives a minimum (a moving shape travels
at least 10% of the side, a pan at least 5%): travel 5%, pan 2.5%, zoom 1.08x. They were set
before the reader was run on any model's clip. Pure numpy/OpenCV.
"""

from __future__ import annotations

import cv2
import numpy as np

SIDE = 64  # working size
TRAVEL_MIN = 0.05  # half the 10% of the side
PAN_MIN = 0.025  # half the 5% of the side
ZOOM_MIN = 1.08
SCALES = 1.0 + np.arange(-0.02, 0.0801, 0.005)  # zoom steps tried per frame pair
HUES = {"red": 0.0, "yellow": 55.0, "green": 125.0, "blue": 225.0}  # degrees


def _frames(frames: np.ndarray) -> np.ndarray:
    f = np.asarray(frames)
    if f.ndim != 4 or f.shape[-1] != 3 or len(f) < 2:
        raise ValueError(f"frames: expected (T>=2, H, W, 3) RGB, got {f.shape}")
    if len(f) > 12:  # interpolated clips: a dozen frames, evenly, ends included
        f = f[np.unique(np.rint(np.linspace(0, len(f) - 1, 12)).astype(int))]
    if f.shape[1:3] != (SIDE, SIDE):
        f = np.stack([cv2.resize(x, (SIDE, SIDE), interpolation=cv2.INTER_AREA) for x in f])
    return f.astype(np.uint8)


def _background(f: np.ndarray) -> str:
    ring = np.concatenate([f[:, :4].reshape(-1, 3), f[:, -4:].reshape(-1, 3),
                           f[:, :, :4].reshape(-1, 3), f[:, :, -4:].reshape(-1, 3)]).astype(np.float32)
    r, g, b = np.median(ring, axis=0)
    luma = 0.299 * r + 0.587 * g + 0.114 * b
    if luma < 70:
        return "black"
    return "beige" if r - b > 35 else "grey"


def _shape_mask(frame: np.ndarray) -> np.ndarray:
    hsv = cv2.cvtColor(frame, cv2.COLOR_RGB2HSV_FULL).astype(np.float32)
    s, v = hsv[..., 1] / 255.0, hsv[..., 2] / 255.0
    colourful = (s > 0.55) & (v > 0.35)
    white = (s < 0.2) & (v > 0.84)
    return colourful | white


def _blob(mask: np.ndarray) -> np.ndarray | None:
    n, labels, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=4)
    if n <= 1:
        return None
    i = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    return labels == i if stats[i, cv2.CC_STAT_AREA] >= 8 else None


def _colour(pixels: np.ndarray) -> str:
    hsv = cv2.cvtColor(pixels.reshape(-1, 1, 3), cv2.COLOR_RGB2HSV_FULL).reshape(-1, 3).astype(np.float32)
    if np.median(hsv[:, 1]) < 0.3 * 255:
        return "white"
    ang = hsv[:, 0] * (2 * np.pi / 256.0)
    hue = np.degrees(np.arctan2(np.sin(ang).mean(), np.cos(ang).mean())) % 360
    return min(HUES, key=lambda k: min(abs(hue - HUES[k]), 360 - abs(hue - HUES[k])))


def _profile(blob: np.ndarray) -> tuple[float, float]:
    """(fill of the bounding box, width a quarter of the way down / width three quarters down)."""
    ys, xs = np.nonzero(blob)
    box = blob[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    h = box.shape[0]
    widths = box.sum(axis=1).astype(np.float32)
    upper, lower = widths[int(0.25 * (h - 1))], widths[int(round(0.75 * (h - 1)))]
    return float(box.mean()), float(upper / max(lower, 1.0))


def _shape(profiles: list[tuple[float, float]]) -> str:
    """An upright triangle narrows upward (a third of its lower width); a square fills its box,
    a circle pi/4 of it."""
    fill, taper = (float(v) for v in np.median(np.array(profiles), axis=0))
    if taper < 0.65:
        return "triangle"
    return "square" if fill > 0.89 else "circle"


def _fit_pair(a: np.ndarray, b: np.ndarray, keep: np.ndarray, scales, shifts) -> tuple[float, float, float]:
    """(error, s, dx) of the grid's best ``b ~ a`` magnified by s about the centre, shifted by dx."""
    c = SIDE / 2.0
    best = (np.inf, 1.0, 0.0)
    for s in scales:
        for dx in shifts:
            warp = np.array([[s, 0, c * (1 - s) + dx], [0, s, c * (1 - s)]], np.float32)
            aw = cv2.warpAffine(a, warp, (SIDE, SIDE), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
            err = float(np.abs(aw - b)[keep].mean())
            if err < best[0]:
                best = (err, float(s), float(dx))
    return best


def _camera(gray: np.ndarray, masks: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per frame, the chained (zoom, x drift in px) of the background from the first frame.

    Per pair, a grid search (then a finer one around its best) for the magnification about the
    centre and the horizontal shift that carry frame t onto frame t+1 with the smallest mean
    difference on the background: the frame's edge and the shape of either frame, grown, are
    left out."""
    zs, ds = [1.0], [0.0]
    for t in range(len(gray) - 1):
        keep = np.zeros((SIDE, SIDE), bool)
        keep[6:-6, 6:-6] = True
        for m in (masks[t], masks[t + 1]):
            if m is not None:
                keep &= ~cv2.dilate(m.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)
        if keep.sum() < 200:
            keep[6:-6, 6:-6] = True
        _, s, dx = _fit_pair(gray[t], gray[t + 1], keep, SCALES, np.arange(-4.0, 4.01, 0.5))
        _, s, dx = _fit_pair(gray[t], gray[t + 1], keep, s + np.arange(-0.005, 0.0051, 0.0025),
                             dx + np.arange(-0.5, 0.51, 0.125))
        zs.append(zs[-1] * s)
        ds.append(ds[-1] * s + dx)
    return np.array(zs), np.array(ds)


def read(frames: np.ndarray) -> dict[str, str | None]:
    """What a clip, (T, H, W, 3) uint8 RGB, shows in the grammar's words (colour, shape and
    motion None when no shape is found in most frames)."""
    f = _frames(frames)
    gray = np.stack([cv2.cvtColor(x, cv2.COLOR_RGB2GRAY) for x in f]).astype(np.float32)
    masks = [_blob(_shape_mask(x)) for x in f]
    z, d = _camera(gray, masks)
    total_z, drift = float(z[-1]), float(d[-1]) / SIDE
    if total_z >= ZOOM_MIN:
        camera = "zoom in"
    elif drift <= -PAN_MIN:
        camera = "pan right"  # the background drifts left on screen
    elif drift >= PAN_MIN:
        camera = "pan left"
    else:
        camera = "static shot"
    out: dict[str, str | None] = {"colour": None, "shape": None, "motion": None,
                                  "background": _background(f), "camera": camera}
    seen = [t for t, m in enumerate(masks) if m is not None]
    if len(seen) < len(f) / 2:
        return out
    c = SIDE / 2.0
    pix, profiles, world = [], [], {}
    for t in seen:
        m = masks[t]
        ys, xs = np.nonzero(m)
        pix.append(f[t][cv2.erode(m.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)] if m.sum() > 30 else f[t][m])
        profiles.append(_profile(m))
        x, y = xs.mean() + 0.5, ys.mean() + 0.5
        world[t] = np.array([(x - c - d[t]) / z[t] + c, (y - c) / z[t] + c])
    out["colour"] = _colour(np.concatenate(pix))
    out["shape"] = _shape(profiles)
    first, last = seen[:2], seen[-2:]
    dx, dy = (np.mean([world[t] for t in last], axis=0) - np.mean([world[t] for t in first], axis=0))
    span = (np.mean(last) - np.mean(first)) / max(len(f) - 1, 1)  # extrapolate to the whole clip
    dx, dy = dx / SIDE / max(span, 1e-6), dy / SIDE / max(span, 1e-6)
    if max(abs(dx), abs(dy)) < TRAVEL_MIN:
        out["motion"] = "stays still"
    elif abs(dx) >= abs(dy):
        out["motion"] = "moves right" if dx > 0 else "moves left"
    else:
        out["motion"] = "moves down" if dy > 0 else "moves up"
    return out
