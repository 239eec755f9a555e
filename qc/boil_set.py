"""An independent labelled set for QC's boiling test: boiling clips against grainy good footage.

Boiling is fine texture that re-rolls every frame: a band-pass pattern (spatially correlated over
a few pixels), drawn anew for each frame, a few luma levels above the clip's sensor noise, over
the whole frame, over a region, or only on a moving object. Grain is the legitimate look-alike:
temporally independent noise at the sensor's level (Gaussian, signal-dependent Poisson-like, or
film grain clumped over about a pixel), up to heavy "grainy" footage (sigma 6).

Each seed draws one scene (content, motion, frame rate, length, size, codec quality) and makes
two clips of it: a good one with grain, and a boiling one with light sensor noise and boiling on
top. Both go through H.264 (``pipeline.video``) and are decoded again, as in the real pipeline,
so QC sees what viewers will see. Content: scikit-image photographs under a virtual camera
(static, slow pan below 1 px/frame, moderate pan, zoom, a textured disc moving over a static
shot) and the shapes world (``pipeline.shapes``: textured backgrounds, a moving shape, camera
moves). Clips at 24 fps (12-48 frames) and 8 fps (8-16 frames); some 8 fps clips are converted
to 24 fps by the pipeline's own frame interpolation, as the post stage does.

Nothing here was used to tune the old boiling test (``qc/synth.py``'s boiling is a strong
Gaussian blob texture over the whole frame). Seeds in :data:`TUNE_SEEDS` are the ones the
new test's thresholds were looked at with; :data:`HELDOUT_SEEDS` and :data:`TEST_SEEDS` were only
ever measured. ``clipmill qc --bench`` reports QC's confusion on the held-out seeds.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import cv2
import numpy as np

from clipmill.pipeline.interpolate import interpolate
from clipmill.pipeline.shapes import VOCAB, Spec
from clipmill.pipeline.shapes import render as render_shapes
from clipmill.pipeline.synthetic import camera_move, photo
from clipmill.pipeline.video import decode, encode_h264

# Thresholds were chosen looking at these: 0-59 first; 5000-5059 was the first held-out range,
# measured once (README), then looked at and used for tuning too, so it is no longer held out;
# 9000-9059 the same, later (measured four times while choosing).
TUNE_SEEDS = (*range(0, 60), *range(5000, 5060), *range(9000, 9060))
# measured only, never tuned on: the thirteenth session's test once and one rejected variant once; the
# fifteenth session's test before and after the colour-edge warp, and one rejected variant (README, Boiling)
HELDOUT_SEEDS = range(13000, 13080)
TEST_SEEDS = range(7000, 7020)  # tests/test_boiling.py: unseen too

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "cat", "brick", "gravel", "moon",
          "grass", "hubble_deep_field", "immunohistochemistry", "retina", "page", "text")
PHOTO_MOTIONS = ("static", "slow-pan", "pan", "zoom", "object")
REGIONS = ("frame", "region", "object")
GRAINS = ("gauss", "poisson", "film")
# The CRFs the set varies over (x264, preset medium). Until the thirty-eighth session they were
# drawn and not applied (encode_h264 dropped the CRF it was given until the thirty-seventh), so
# every figure measured before then is of the same clips at CRF 23 (README, "Boiling")
CRFS = (18, 18, 18, 14, 23, 28)
VISIBLE = 1.5  # luma RMS of boiling left after H.264 below which a clip is labelled "faint", not "boiling"


@dataclass
class BoilClip:
    name: str
    frames: np.ndarray  # (F, H, W, 3) uint8, decoded from H.264
    fps: float
    label: str  # "good", "boiling", or "faint" (boiling that H.264 smoothed away: counted apart)
    meta: dict = field(default_factory=dict)


def bandpass_noise(shape: tuple[int, int], scale: float, rng: np.random.Generator) -> np.ndarray:
    """Zero-mean, unit-std texture with detail about ``scale`` px across: white noise blurred at
    ``scale`` minus the same blurred at 3x ``scale`` (no broad blotches, no pixel-level grain)."""
    z = rng.normal(0, 1, shape).astype(np.float32)
    b = cv2.GaussianBlur(z, (0, 0), scale) - cv2.GaussianBlur(z, (0, 0), 3 * scale)
    return b / (b.std() + 1e-6)


def grain(shape: tuple, kind: str, sigma: float, frames: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Temporally independent sensor/film grain, (F, H, W, 3) float32, std about ``sigma``.

    gauss: white, independent per channel; poisson: white, std growing as sqrt(signal), ``sigma``
    at mid grey; film: clumped (blurred 0.3-0.55 px) and mostly in luma."""
    n, h, w = shape[:3]
    if kind == "gauss":
        return rng.normal(0, sigma, (n, h, w, 3)).astype(np.float32)
    if kind == "poisson":
        level = np.sqrt(np.maximum(frames.astype(np.float32), 4.0) / 128.0)
        return (rng.normal(0, sigma, (n, h, w, 3)) * level).astype(np.float32)
    s = float(rng.uniform(0.3, 0.55))
    out = np.empty((n, h, w, 3), np.float32)
    for i in range(n):
        lum = cv2.GaussianBlur(rng.normal(0, 1, (h, w)).astype(np.float32), (0, 0), s)
        lum /= lum.std() + 1e-6
        out[i] = sigma * (0.9 * lum[..., None] + 0.3 * rng.normal(0, 1, (h, w, 3)))
    return out


def _disc_over(frames: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A textured disc moving 1-6 px/frame in a random direction over ``frames``; (frames, mask)."""
    n, h, w = frames.shape[:3]
    r = int(min(h, w) * rng.uniform(0.14, 0.24))
    tex = cv2.resize(photo(str(rng.choice(["coffee", "chelsea", "astronaut", "rocket"]))), (2 * r, 2 * r))
    yy, xx = np.mgrid[-r:r, -r:r]
    disc = (xx**2 + yy**2 < r * r).astype(np.float32)
    speed, ang = rng.uniform(1.0, 6.0), rng.uniform(0, 2 * np.pi)
    v = speed * np.array([np.cos(ang), np.sin(ang)])
    travel = v * (n - 1)
    lo = np.array([r, r]) + np.maximum(0, -travel)
    hi = np.array([w - r, h - r]) - np.maximum(0, travel)
    if np.any(hi <= lo):  # too far for the frame: slow down to fit
        v *= 0.5 * min((w - 2 * r), (h - 2 * r)) / (np.abs(travel).max() + 1e-6)
        travel = v * (n - 1)
        lo = np.array([r, r]) + np.maximum(0, -travel)
        hi = np.maximum(lo + 1, np.array([w - r, h - r]) - np.maximum(0, travel))
    start = rng.uniform(lo, hi)
    out = frames.copy()
    mask = np.zeros((n, h, w), np.float32)
    for i in range(n):
        cx, cy = start + v * i
        # sub-pixel placement by an affine warp of the disc and its texture
        m = np.array([[1, 0, cx - r], [0, 1, cy - r]], np.float32)
        a = cv2.warpAffine(disc, m, (w, h), flags=cv2.INTER_LINEAR)
        t = cv2.warpAffine(tex, m, (w, h), flags=cv2.INTER_LINEAR)
        out[i] = (a[..., None] * t + (1 - a[..., None]) * out[i]).astype(np.uint8)
        mask[i] = a
    return out, mask


def _ellipse(n: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A soft ellipse fixed on screen covering roughly 10-40% of the frame."""
    cy, cx = rng.uniform(0.3, 0.7) * h, rng.uniform(0.3, 0.7) * w
    ay, ax = rng.uniform(0.18, 0.35) * h, rng.uniform(0.18, 0.35) * w
    yy, xx = np.mgrid[0:h, 0:w]
    d = np.sqrt(((yy - cy) / ay) ** 2 + ((xx - cx) / ax) ** 2)
    m = np.clip((1.15 - d) / 0.3, 0, 1).astype(np.float32)
    return np.broadcast_to(m, (n, h, w))


def scene(rng: np.random.Generator, seed: int) -> dict:
    """The draw for one seed: content, motion, timing, size, codec."""
    d: dict = {}
    d["source"] = "shapes" if rng.random() < 0.35 else "photo"
    r = rng.random()
    d["fps"], d["interp"] = (8.0, False) if r < 0.35 else ((24.0, True) if r < 0.55 else (24.0, False))
    if d["fps"] == 8.0 or d["interp"]:
        d["n"] = int(rng.integers(8, 17))
    else:
        d["n"] = int(rng.choice([12, 16, 24, 36, 48]))
    if d["source"] == "shapes":
        d["spec"] = Spec(*(str(rng.choice(VOCAB[k])) for k in ("colour", "shape", "motion", "background", "camera")))
        d["side"] = int(rng.choice([64, 96, 128, 192]))
        d["shape_seed"] = int(seed * 7919 + 1)
    else:
        d["photo"] = str(rng.choice(PHOTOS))
        d["motion"] = str(rng.choice(PHOTO_MOTIONS))
        d["size"] = [(320, 192), (256, 144), (320, 180), (384, 216), (640, 360)][int(rng.choice(5, p=[.3, .25, .2, .15, .1]))]
        d["speed"] = float(rng.uniform(0.2, 0.9) if d["motion"] == "slow-pan" else rng.uniform(1.2, 4.0))
        d["speed"] *= float(rng.choice([-1, 1]))
        d["zoom"] = float(rng.uniform(0.08, 0.3))
    d["crf"] = int(rng.choice(CRFS))
    return d


def content(d: dict, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """The clean clip and the moving object's mask (None when there is no moving object)."""
    n = d["n"]
    if d["source"] == "shapes":
        clip = render_shapes(d["spec"], d["shape_seed"], frames=n, size=d["side"])
        return clip.frames, clip.alpha
    motion = {"slow-pan": "pan", "object": "static"}.get(d["motion"], d["motion"])
    frames = camera_move(photo(d["photo"]), motion, n, d["size"], rng, speed=d["speed"], zoom=d["zoom"])
    if d["motion"] == "object":
        return _disc_over(frames, rng)
    return frames, None


def _h264(frames: np.ndarray, fps: float, crf: int) -> np.ndarray:
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        encode_h264(frames, fps, path, crf=crf)
        return decode(path)[0]
    finally:
        os.unlink(path)


def make_pair(seed: int) -> list[BoilClip]:
    """The good (grainy) and the boiling clip of ``seed``'s scene, both through H.264."""
    rng = np.random.default_rng([seed, 0xB011])
    d = scene(rng, seed)
    clean, obj = content(d, rng)
    n, h, w = clean.shape[:3]
    base = clean.astype(np.float32)
    where = d["source"] + ("" if d["source"] == "shapes" else "-" + d["photo"] + "-" + d["motion"])
    if d["source"] == "shapes":
        where += "-" + d["spec"].camera.replace(" ", "") + "-" + d["spec"].motion.replace(" ", "")
    fps_in = 8.0 if d["interp"] else d["fps"]

    # good: grain at a realistic level, a fifth of clips nearly clean
    kind = str(rng.choice(GRAINS))
    sigma = float(rng.uniform(0.0, 1.0) if rng.random() < 0.2 else rng.uniform(1.0, 6.0))
    good = np.clip(base + grain(base.shape, kind, sigma, clean, rng), 0, 255).astype(np.uint8)

    # boiling: light sensor noise, then band-pass texture re-drawn every frame
    noise = float(rng.uniform(0.0, 3.0))
    amp = noise + float(rng.uniform(2.0, 8.0))
    # detail a few px across at QC's working size (the clip shrunk by an integer factor to <= 320 px)
    scale = float(rng.uniform(1.0, 2.2)) * int(np.ceil(max(h, w) / 320))
    regions = [r for r in REGIONS if r != "object" or obj is not None]
    region = str(rng.choice(regions, p=[0.2, 0.2, 0.6] if obj is not None else None))
    mask = np.ones((n, h, w), np.float32) if region == "frame" else (_ellipse(n, h, w, rng) if region == "region" else obj)
    noisy = base + rng.normal(0, noise, base.shape).astype(np.float32)
    bad = noisy.copy()
    for i in range(n):
        bad[i] += (amp * mask[i] * bandpass_noise((h, w), scale, rng))[..., None]
    bad = np.clip(bad, 0, 255).astype(np.uint8)
    twin = np.clip(noisy, 0, 255).astype(np.uint8)  # the same clip without the boiling

    def deliver(frames: np.ndarray) -> np.ndarray:
        if d["interp"]:
            frames = interpolate(frames, fps_in, 24.0)
        return _h264(frames, d["fps"], d["crf"])

    good_dec, bad_dec, twin_dec = deliver(good), deliver(bad), deliver(twin)
    # how much boiling the viewer gets: the part of (boiling clip - its twin) that changes from
    # one source frame to the next (an encoder that freezes the texture leaves none), luma RMS
    src = np.minimum(np.round(np.arange(len(bad_dec)) * fps_in / d["fps"]).astype(int), n - 1)
    k = int(round(d["fps"] / fps_in))
    diff = _luma(bad_dec) - _luma(twin_dec)
    wgt = np.minimum(mask[src][k:], mask[src][:-k])
    change = (diff[k:] - diff[:-k]) / np.sqrt(2)
    visible = float(np.sqrt((wgt * change**2).sum() / max(wgt.sum(), 1.0)))

    out = []
    for label, dec, extra in (("good", good_dec, {"grain": kind, "sigma": round(sigma, 2)}),
                              ("boiling" if visible >= VISIBLE else "faint", bad_dec,
                               {"noise": round(noise, 2), "amp": round(amp, 2), "scale": round(scale, 2),
                                "region": region, "visible": round(visible, 2)})):
        meta = {"seed": seed, "content": where, "fps": d["fps"], "interp": d["interp"], "frames": len(dec),
                "size": f"{w}x{h}", "crf": d["crf"], **extra}
        tag = "-".join(f"{k}{v}" for k, v in extra.items())
        out.append(BoilClip(f"{label}-{where}-{tag}", dec, d["fps"], label, meta))
    return out


def _luma(frames: np.ndarray) -> np.ndarray:
    return frames.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)


def make_boil_set(seeds=TUNE_SEEDS) -> list[BoilClip]:
    """Good and boiling clips, two per seed."""
    return [c for s in seeds for c in make_pair(s)]
