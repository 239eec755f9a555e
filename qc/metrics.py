"""Per-frame and per-pair metrics over (F, H, W, 3) uint8 RGB frames.

The work is done on a copy downscaled so its long side is at most ``max_side`` pixels. Each
frame is compared with its motion-compensated neighbour: optical flow (OpenCV DIS) from frame
i to frame i+1, then frame i+1 warped back onto frame i. Legitimate motion (pans, zooms,
moving objects) is explained by the flow and leaves a small residual; broken frames are not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import cv2
import numpy as np

from clipmill.pipeline.flow import FlowEstimator, colour_flow, ssim_map, warp

GRID = 12  # cells per side for local (block) residuals
BORDER = 0.06  # fraction of each side left out of residuals: flow is unreliable at the edges

# Boiling (see boiling_map). The residual is split into a fine band (finer than BOIL_FINE px) and
# a band-pass (BOIL_FINE..BOIL_COARSE px): sensor grain is white, so almost all of its energy is
# in the fine band and its band-pass energy is a fixed share of that (0.07 for white noise, up to
# about 0.2 for grain clumped over half a pixel or smoothed by the warp and the codec); boiling
# texture a few px across is mostly band-pass.
BOIL_FINE = 1.0  # px (Gaussian sigma)
BOIL_COARSE = 3.0  # px; coarser residual is a flow error, not texture
BOIL_GRAIN_SHARE = 0.3  # band-pass energy allowed per unit of fine-band energy: the clip's own noise floor
BOIL_EDGE = 0.05  # band-pass energy allowed per unit of squared content gradient (flow errors, ringing at edges)
BOIL_WINDOW = 9  # px: the local window the energies are averaged over
BOIL_FAIL = 30.0  # a residual above this (luma) is a flow failure (occlusion, lost object), left out ...
BOIL_FAIL_GROW = 5  # ... with its 5x5 neighbourhood
BOIL_SAMPLES = 12  # frames sampled per clip
BOIL_COLOUR_BLUR = 3.0  # px (Gaussian sigma) before the colour edges' gradient
# The colour edges count for this share of their squared gradient in the edge allowance. They
# were counted whole while the boiling flow followed luma only, to excuse the residual a shape of
# its background's luma leaves at its outline. Since the flow follows colour too (twenty-sixth
# session) the generator's own clips read the same with half of it (1 of 192 rejected either
# way), and the whole of it, blurred over the window, excused the inside of small coloured
# shapes: a 64 px blue triangle on black re-rolling by 9 levels read 0.2-1.7, now 7 (thirty-eighth
# session, README "Boiling"). A quarter let a green square on grey read as boiling (2.1)
BOIL_COLOUR_EDGE = 0.5
BOIL_FLOW_PRESET = "fast"  # DIS preset of the boiling test's flow
BOIL_VALID_SHARE = 0.7  # a window is measured when more than this share of it is not a flow failure
# At a content edge the band-pass residual of a misplaced or re-drawn edge (sub-pixel placement,
# interpolation ghosts, codec ringing) varies across the edge only; boiling texture varies every
# way. There the band-pass energy is counted as twice its part along the edge (:func:`_isotropic_band`):
# an edge weighs g / (g + BOIL_EDGE_NOISE), g its squared content gradient (luma^2/px^2) summed
# over the blurred luma and the frame's three colour channels (a neutral edge's luma gradient
# counts about 4 times, so it weighs half at a luma gradient of about 1.4 levels/px)
BOIL_EDGE_NOISE = 8.0
# Under a fast camera move the pair is taken closer than boil_seconds apart, so that the content
# shifts at most this far (working-size px) between its two frames: DIS loses fine texture over
# longer shifts, and that residual read as boiling (pans over brick from 7 px/frame at 24 fps,
# over most photographs from 10-12: 13 of 135 fast-pan clips rejected, twenty-third session)
BOIL_MAX_SHIFT = 16.0
# Inside a small flat shape every window lies near the shape's own outline, so the edge allowance
# (averaged over the window) excused the whole inside, and a shape boiling 5-10 levels read 0
# (thirty-second session). So the same measure is also taken over the pixels away from strong
# content edges only (a gradient above BOIL_STRONG_EDGE levels/px, luma or a colour channel, at
# 1 px, in either frame; grown by BOIL_STRONG_GROW px), with the edge allowance of those pixels'
# own content (its gradient at 1 px, so an outline 3 px away does not count; at 1.5 px a fine
# check near a shape's outline was no longer excused), where they are more than BOIL_INSIDE_SHARE
# of the window; a window reads the larger of the two
BOIL_STRONG_EDGE = 25.0
BOIL_STRONG_GROW = 5
BOIL_INSIDE_SHARE = 0.35
# A shape's interior smaller than a window is never BOIL_INSIDE_SHARE of one (a moving object's windows
# were 4-24% inside): so each connected piece of those pixels (4-connected, at least
# BOIL_INSIDE_MIN_PX and at most BOIL_INSIDE_MAX_SHARE of the frame: a shape's interior, not the
# background) is also measured whole, its pixels' mean of the same inner excess, and that value is
# given to the pixels within BOIL_INSIDE_SPREAD px of it (its outline too, so that a small shape
# covers the area the score's quantile needs)
BOIL_INSIDE_MIN_PX = 6
BOIL_INSIDE_MAX_SHARE = 0.05
BOIL_INSIDE_SPREAD = 9


@dataclass
class Series:
    """Metric curves. Frame arrays have F entries; pair arrays F-1 (pair i = frames i, i+1)."""

    scale: float  # working size / original size
    luma: np.ndarray  # mean luma 0..255
    spread: np.ndarray  # luma standard deviation
    clipped: np.ndarray  # fraction of pixels with a channel >= 250
    saturation: np.ndarray  # mean HSV saturation 0..1
    sharpness: np.ndarray  # sharpness of the same content relative to frame 0 (see sharpness_trend)
    diff: np.ndarray  # mean |frame[i+1] - frame[i]|, no compensation
    change: np.ndarray  # the same per cell of a GRID x GRID grid, largest colour channel, in the cell that changed most
    flow: np.ndarray  # mean flow magnitude, working-size pixels per frame
    residual: np.ndarray  # mean |frame[i] - warp(frame[i+1])| inside the border
    ssim: np.ndarray  # SSIM of frame[i] and warp(frame[i+1])
    cells: np.ndarray  # (F-1, GRID, GRID) mean residual of each cell
    hp_ratio: np.ndarray  # residual high-frequency energy / frame high-frequency energy
    luma_drift: np.ndarray  # mean of warp(frame[i+1]) - frame[i]: brightness change of the same content
    sat_drift: np.ndarray  # the same for HSV saturation (0..1), away from saturation edges (_sat_drift)
    boil: np.ndarray  # per sampled frame: band-pass residual energy above the noise floor in its most boiling area
    boil_frames: np.ndarray  # the sampled frames (boil[j] is measured on frame boil_frames[j])
    boil_gap: np.ndarray  # frames between boil_frames[j] and each of the two it is compared with
    border_line: np.ndarray  # (F, 4, 3) frame_border_line: per frame, side (top, bottom, left, right) and RGB channel

    def as_lists(self) -> dict[str, list[float]]:
        return {k: [round(float(x), 4) for x in v] for k, v in self.__dict__.items()
                if isinstance(v, np.ndarray) and v.ndim == 1}


def working_size(h: int, w: int, max_side: int) -> tuple[int, int, int]:
    """(width, height, k) of the working copy of an h x w frame: shrunk by the integer factor k
    (OpenCV's fast area path) to at most ``max_side`` px a side. check_frames refuses frames
    whose working copy is under check.MIN_SIDE a side."""
    k = -(-max(h, w) // max_side)
    return w // k, h // k, k


def working_copy(frames: np.ndarray, max_side: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(gray float32 (F, h, w), small RGB uint8 (F, h, w, 3), scale)."""
    f, h, w = frames.shape[:3]
    ws, hs, k = working_size(h, w, max_side)
    size, scale = (ws, hs), 1.0 / k
    small = np.empty((f, size[1], size[0], 3), np.uint8)

    def shrink(i: int) -> None:
        small[i] = cv2.resize(frames[i], size, interpolation=cv2.INTER_AREA) if size != (w, h) else frames[i]

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(shrink, range(f)))
    gray = np.stack([cv2.cvtColor(x, cv2.COLOR_RGB2GRAY) for x in small]).astype(np.float32)
    return gray, small, scale


def _highpass(x: np.ndarray) -> np.ndarray:
    return x - cv2.GaussianBlur(x, (0, 0), 1.5)


def sharpness_trend(frames: np.ndarray, dx: np.ndarray, dy: np.ndarray, zoom: np.ndarray, scale: float,
                    samples: int = 9) -> np.ndarray:
    """Sharpness of the same content over time, at full resolution (blur is a full-resolution
    property), as a ratio to the first frame: a pan onto a smoother part of the scene keeps
    about 1.0; a clip collapsing into blur falls towards 0.

    Between sampled frames, a central window moved along with the camera (the summed median
    flow) is compared block by block (the median block ratio, so an object passing through a
    few blocks does not count), and the ratio is corrected for the zoom (the flow's
    divergence): magnified content is softer without being blurred.
    """
    n, h, w = frames.shape[:3]
    my, mx = h // 4, w // 4
    px, py = np.concatenate([[0], np.cumsum(dx)]) / scale, np.concatenate([[0], np.cumsum(dy)]) / scale

    def follow(a: int, b: int) -> list[int]:
        """Samples after ``a`` up to ``b``: halved while the window would move past its margin
        between two (it would be clipped there and compare other content: a 14 px/frame pan
        at 256 px read as a collapse into blur, twenty-third session)."""
        if b - a > 1 and (abs(px[b] - px[a]) >= mx - 1 or abs(py[b] - py[a]) >= my - 1):
            return follow(a, (a + b) // 2) + follow((a + b) // 2, b)
        return [b]

    even = np.unique(np.linspace(0, n - 1, min(n, samples)).round().astype(int))
    idx = [int(even[0])] + [i for a, b in zip(even[:-1], even[1:]) for i in follow(int(a), int(b))]
    mag = np.concatenate([[1.0], np.cumprod(zoom)])  # content scale relative to frame 0
    lap = [np.abs(cv2.Laplacian(cv2.cvtColor(frames[i], cv2.COLOR_RGB2GRAY), cv2.CV_32F)) for i in idx]
    out = [1.0]
    for k in range(1, len(idx)):
        a, b = idx[k - 1], idx[k]
        sy, sx = int(round(py[b] - py[a])), int(round(px[b] - px[a]))
        sy, sx = int(np.clip(sy, -my + 1, my - 1)), int(np.clip(sx, -mx + 1, mx - 1))
        wa = cv2.resize(lap[k - 1][my : h - my, mx : w - mx], (4, 4), interpolation=cv2.INTER_AREA)
        wb = cv2.resize(lap[k][my + sy : h - my + sy, mx + sx : w - mx + sx], (4, 4), interpolation=cv2.INTER_AREA)
        ratio = float(np.median((wb + 1e-3) / (wa + 1e-3)))
        out.append(out[-1] * ratio * (mag[b] / mag[a]))
    return np.interp(np.arange(n), idx, out)


def gradient(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gx, gy) of a float32 image (any number of channels), in levels/px: 3x3 Sobel over 8."""
    return cv2.Sobel(image, cv2.CV_32F, 1, 0, ksize=3) / 8, cv2.Sobel(image, cv2.CV_32F, 0, 1, ksize=3) / 8


def _lk_residual(r: np.ndarray, ref: np.ndarray, window: int, reg: float = 4.0) -> np.ndarray:
    """``r`` less what a small local shift of ``ref`` explains (one Lucas-Kanade step per window):
    the flow's sub-pixel misregistration of real detail is not texture that re-rolls."""
    gx, gy = gradient(ref)
    box = (window, window)
    sxx, syy, sxy = cv2.blur(gx * gx, box) + reg, cv2.blur(gy * gy, box) + reg, cv2.blur(gx * gy, box)
    sxr, syr = cv2.blur(gx * r, box), cv2.blur(gy * r, box)
    det = sxx * syy - sxy * sxy
    return r - gx * (syy * sxr - sxy * syr) / det - gy * (sxx * syr - sxy * sxr) / det


def structure_tensor(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The structure tensor (gx^2, gy^2, gx*gy) of a float32 (h, w) or (h, w, c) image, summed
    over its channels (:func:`gradient`)."""
    gx, gy = gradient(image)
    jxx, jyy, jxy = gx * gx, gy * gy, gx * gy
    if image.ndim == 3:
        jxx, jyy, jxy = jxx.sum(axis=-1), jyy.sum(axis=-1), jxy.sum(axis=-1)
    return jxx, jyy, jxy


class ColourGradients(NamedTuple):
    """One RGB frame's colour gradients, computed once per frame (:func:`colour_gradients`)."""

    edges: np.ndarray  # squared gradient blurred at BOIL_COLOUR_BLUR, the largest over the channels
    tensor: tuple[np.ndarray, np.ndarray, np.ndarray]  # the channels' structure tensor, same blur
    fine: np.ndarray  # squared gradient at 1 px, the largest over the channels (strong edges, step 5)


def colour_gradients(rgb: np.ndarray) -> ColourGradients:
    """A (h, w, 3) uint8 frame's colour gradients, computed once for all of their uses in
    ``boiling_map`` (a sampled frame is in two pairs, its neighbours in one or two).

    ``edges``: the squared gradient blurred at BOIL_COLOUR_BLUR, the largest over the three
    channels, on the same scale as the luma gradient ``boiling_map`` allows for: the edges that
    luma does not show (a saturated object on a background of about its brightness), where the
    luma flow cannot follow the content and leaves a residual that is not boiling. ``tensor``: the
    three channels' structure tensor at the same blur, which gives those edges their direction
    (:func:`_isotropic_band`). ``fine``: the squared gradient at 1 px (:func:`_gradient2`), which
    finds the strong edges that step 5 leaves out and the allowance of what is left."""
    g = cv2.GaussianBlur(rgb.astype(np.float32), (0, 0), BOIL_COLOUR_BLUR)
    gx, gy = gradient(g)
    jxx, jyy = gx * gx, gy * gy
    return ColourGradients((jxx + jyy).max(axis=-1), (jxx.sum(axis=-1), jyy.sum(axis=-1), (gx * gy).sum(axis=-1)),
                           _gradient2(None, rgb, 1.0))


def _edge_parts(band: np.ndarray, tensor: tuple[np.ndarray, np.ndarray, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w, along, across) for :func:`_isotropic_band`: each pixel's edge weight from the content's
    structure ``tensor``, and the squared gradient of ``band`` along and across that edge."""
    jxx, jyy, jxy = tensor
    half = 0.5 * (jxx + jyy)
    strength = half + np.sqrt(np.maximum(half * half - (jxx * jyy - jxy * jxy), 0.0))  # largest eigenvalue
    theta = 0.5 * np.arctan2(2 * jxy, jxx - jyy)  # edge normal
    nx, ny = np.cos(theta), np.sin(theta)
    bx, by = gradient(band)
    return strength / (strength + BOIL_EDGE_NOISE), (by * nx - bx * ny) ** 2, (bx * nx + by * ny) ** 2


def _isotropic_band(band: np.ndarray, tensor: tuple[np.ndarray, np.ndarray, np.ndarray],
                    box: tuple[int, int], mask: np.ndarray | None = None,
                    parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    iso: np.ndarray | None = None) -> np.ndarray:
    """Band-pass energy of ``band`` summed over ``box`` and divided by its area, where content
    edges are counted by the part of it that does not follow them: the content's structure
    ``tensor`` (jxx, jyy, jxy; :func:`structure_tensor`) gives each pixel's edge normal and
    strength; at an edge, the energy is scaled by twice the share of the band's gradient energy
    along the edge (1 for texture that varies every way, near 0 for a residual that varies across
    the edge only), at most 1. With ``mask`` (0..1 per pixel) only the pixels it keeps count.
    ``parts`` is :func:`_edge_parts` of the same band and tensor, and ``iso`` their
    :func:`_isotropy` over the same box and mask, where the caller has them."""
    parts = _edge_parts(band, tensor) if parts is None else parts
    w = parts[0]
    iso = _isotropy(parts, box, mask) if iso is None else iso
    e = band * band if mask is None else mask * band * band
    return cv2.blur((1 - w) * e, box) + cv2.blur(w * e, box) * iso


def _isotropy(parts: tuple[np.ndarray, np.ndarray, np.ndarray], box: tuple[int, int],
              mask: np.ndarray | None = None) -> np.ndarray:
    """Twice the share of the band's gradient energy along the content's edges, edge-weighted,
    over ``box`` (of the pixels ``mask`` keeps), at most 1: :func:`_isotropic_band`'s scale."""
    w, along, across = parts
    m = 1.0 if mask is None else mask
    return np.minimum(1.0, 2 * cv2.blur(m * w * along, box) / (cv2.blur(m * w * (along + across), box) + 1e-6))


def boiling_map(a: np.ndarray, b: np.ndarray, flow: FlowEstimator,
                edges: tuple[np.ndarray, np.ndarray] | None = None,
                rgb: tuple[np.ndarray, np.ndarray] | None = None,
                colour: tuple[ColourGradients, ColourGradients] | None = None) -> np.ndarray:
    """Per pixel of ``a`` (float32 gray): band-pass energy of the motion-compensated residual
    against ``b`` above what grain and content edges explain, luma^2, averaged over a local window.
    ``edges`` are the colour edges (:func:`colour_gradients`) of ``a`` and of ``b``; ``b``'s are
    warped onto ``a`` with the same flow as ``b`` itself, so that under a pan or a zoom they lie
    where ``b``'s content does in the residual.

    ``rgb`` (the RGB frames ``a`` and ``b`` were made from) lets the flow follow colour too, and
    ``a``'s colour channels give edges that luma does not show their direction (step 3);
    ``colour`` is :func:`colour_gradients` of both frames of ``rgb`` where the caller has them
    already (then ``edges`` left out are theirs), else they are computed here.

    1. flow a -> b (DIS on luma; with ``rgb`` and BOIL_CHROMA_FLOW, a chroma flow kept per pixel
       where it explains the colour frames better, :func:`~clipmill.pipeline.flow.colour_flow`),
       b warped onto a, residual r = a - warp(b), less a local sub-pixel shift;
    2. residuals above BOIL_FAIL (a flow failure) are left out with their neighbourhood;
    3. r split into a fine band F (< BOIL_FINE px) and a band-pass B (BOIL_FINE..BOIL_COARSE);
       at content edges B's energy counts by its part along the edge (:func:`_isotropic_band`);
    4. excess = (mean(B^2) - BOIL_GRAIN_SHARE * mean(F^2)) / max(valid share, 0.3)
       - BOIL_EDGE * mean(E) over the window, where E is the squared gradient of the pair's mean
       blurred at 3 px (content edges without the texture), or BOIL_COLOUR_EDGE times the colour
       edges where larger:
       the noise floor is the fine-band energy measured in the same place, so heavy grain raises
       its own allowance; a window whose valid share is BOIL_VALID_SHARE or less reads NaN (not
       measured);
    5. the same over the pixels away from strong content edges only (inside a shape), with the
       allowance of those pixels' own content gradient (BOIL_STRONG_EDGE and below), over the
       window where those pixels are more than BOIL_INSIDE_SHARE of it, and over each shape's
       interior whole (:func:`_interiors`); the largest is kept.
    """
    if edges is None and colour is not None:
        edges = (colour[0].edges, colour[1].edges)
    fl = flow(np.clip(a, 0, 255).astype(np.uint8), np.clip(b, 0, 255).astype(np.uint8))
    if rgb is not None and BOIL_CHROMA_FLOW:
        fl = colour_flow(flow, rgb[0], rgb[1], fl)
    wb = warp(b, fl)
    ref = 0.5 * (a + wb)
    r = _lk_residual(a - wb, ref, BOIL_WINDOW)
    fail = (np.abs(r) > BOIL_FAIL).astype(np.uint8)
    valid = 1.0 - cv2.dilate(fail, np.ones((BOIL_FAIL_GROW, BOIL_FAIL_GROW), np.uint8)).astype(np.float32)
    r *= valid
    g1 = cv2.GaussianBlur(r, (0, 0), BOIL_FINE)
    fine, band = r - g1, g1 - cv2.GaussianBlur(r, (0, 0), BOIL_COARSE)
    g = cv2.GaussianBlur(ref, (0, 0), 3.0)  # content edges, without the texture itself
    tensor = structure_tensor(g)
    grad2 = tensor[0] + tensor[1]
    if edges is not None:
        grad2 = np.maximum(grad2, BOIL_COLOUR_EDGE * np.maximum(edges[0], warp(edges[1], fl)))
    box = (BOIL_WINDOW, BOIL_WINDOW)
    share = cv2.blur(valid, box)
    # the edges' directions: luma, and each colour channel (an edge luma does not show)
    if rgb is not None:
        if colour is None:
            colour = (colour_gradients(rgb[0]), colour_gradients(rgb[1]))
        tensor = tuple(t + c for t, c in zip(tensor, colour[0].tensor))
    parts = _edge_parts(band, tensor)
    band_energy = _isotropic_band(band, tensor, box, parts=parts)
    excess = (band_energy - BOIL_GRAIN_SHARE * cv2.blur(fine * fine, box)) / np.maximum(share, 0.3)
    excess -= BOIL_EDGE * cv2.blur(grad2, box)
    excess = np.where(share > BOIL_VALID_SHARE, excess, np.nan)
    # 5. away from strong edges (inside a shape), with only those pixels' own edges allowed for
    own = _gradient2(ref, None, 1.0)
    if colour is not None:
        own = np.maximum(own, colour[0].fine)
    strong = _strong_edges(own, None if colour is None else colour[1].fine, fl)
    grown = cv2.dilate(strong, np.ones((BOIL_STRONG_GROW,) * 2, np.uint8))
    inside = valid * (1 - grown).astype(np.float32)
    inside_share = cv2.blur(inside, box)
    iso = _isotropy(parts, box, inside)  # the inside's, for the window (here) and each interior whole
    inner = (_isotropic_band(band, tensor, box, inside, parts, iso)
             - BOIL_GRAIN_SHARE * cv2.blur(inside * fine * fine, box)
             - BOIL_EDGE * cv2.blur(inside * own, box)) / np.maximum(inside_share, 1e-3)
    # (measured only where the window itself is: a flow failure leaves it to the pair on the other side)
    inner = np.where((inside_share > BOIL_INSIDE_SHARE) & (share > BOIL_VALID_SHARE), inner, np.nan)
    return np.fmax(excess, np.fmax(inner, _interiors(band, fine, own, parts[0], iso, inside, share)))


def _interiors(band: np.ndarray, fine: np.ndarray, own: np.ndarray, w: np.ndarray, iso: np.ndarray,
               inside: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Step 5 of :func:`boiling_map` pooled over each shape's interior: the connected pieces of
    ``inside`` (4-connected, BOIL_INSIDE_MIN_PX px to BOIL_INSIDE_MAX_SHARE of the frame) each read
    their pixels' mean inner excess (band-pass energy counted as :func:`_isotropic_band` counts it,
    less the grain floor and the pixel's own edge allowance), spread BOIL_INSIDE_SPREAD px around
    the piece (the larger where two meet); NaN elsewhere and where the window is not measured.
    ``w`` and ``iso`` are the edge weight and the inside's :func:`_isotropy` the window measure uses."""
    e = band * band
    excess = (1 - w) * e + w * e * iso - BOIL_GRAIN_SHARE * fine * fine - BOIL_EDGE * own
    n, lab = cv2.connectedComponents((inside > 0.5).astype(np.uint8), connectivity=4)
    count = np.bincount(lab.ravel(), minlength=n).astype(np.float64)
    mean = np.bincount(lab.ravel(), weights=excess.ravel().astype(np.float64), minlength=n) / np.maximum(count, 1)
    keep = (count >= BOIL_INSIDE_MIN_PX) & (count <= BOIL_INSIDE_MAX_SHARE * inside.size)
    keep[0] = False  # label 0: the pixels that are not inside
    out = np.where(keep, mean, -1e9).astype(np.float32)[lab]
    k = 2 * BOIL_INSIDE_SPREAD + 1
    out = cv2.dilate(out, np.ones((k, k), np.uint8)) if BOIL_INSIDE_SPREAD > 0 else out
    return np.where((out > -1e8) & (share > BOIL_VALID_SHARE), out, np.nan).astype(np.float32)


def _gradient2(gray: np.ndarray | None, rgb: np.ndarray | None, blur: float) -> np.ndarray:
    """Squared content gradient (levels^2/px^2) at ``blur`` px: the luma's, or a colour channel's
    where larger (either may be None)."""
    g2 = []
    if gray is not None:
        gx, gy = gradient(cv2.GaussianBlur(gray, (0, 0), blur))
        g2.append(gx * gx + gy * gy)
    if rgb is not None:
        cx, cy = gradient(cv2.GaussianBlur(rgb.astype(np.float32), (0, 0), blur))
        g2.append((cx * cx + cy * cy).max(axis=-1))
    return g2[0] if len(g2) == 1 else np.maximum(g2[0], g2[1])


def _strong_edges(own: np.ndarray, other: np.ndarray | None, fl: np.ndarray) -> np.ndarray:
    """uint8 mask of strong content edges (BOIL_STRONG_EDGE) at 1 px: ``own`` is the squared
    gradient of the pair's mean luma or the first frame's colour channels (:func:`_gradient2`);
    ``other``, the second frame's colour channels' (``ColourGradients.fine``), counts too, both
    where it is and warped onto the first with the pair's flow ``fl`` (where the flow lost an
    object, its outline is in the residual at both places)."""
    limit = BOIL_STRONG_EDGE * BOIL_STRONG_EDGE
    strong = own > limit
    if other is not None:
        far = other > limit
        strong |= far | (warp(far.astype(np.float32), fl) > 0.5)
    return strong.astype(np.uint8)


def _texture_speed(a: np.ndarray, fl: np.ndarray, inner: tuple) -> float:
    """How far the texture of ``a`` (float32 gray) moves under the flow ``fl``, px: the flow's
    component along the image gradient (what the pixels show of the motion), its RMS weighted by
    the gradient's energy, times sqrt(2) so that a texture of every orientation reads its full
    speed. Flat regions and the free component along stripes or edges, where the flow is noise,
    weigh nothing (on a shapes-world pan over vertical stripes moving 0.2 px/frame the mean
    flow read up to 14 px/frame and its vertical median up to 8)."""
    g = cv2.GaussianBlur(a, (0, 0), 1.0)
    gx, gy = cv2.Sobel(g, cv2.CV_32F, 1, 0, ksize=3)[inner], cv2.Sobel(g, cv2.CV_32F, 0, 1, ksize=3)[inner]
    along = fl[inner][..., 0] * gx + fl[inner][..., 1] * gy
    return float(np.sqrt(2.0 * (along * along).sum() / ((gx * gx + gy * gy).sum() + 1e-6)))


def boil_gaps(idx: np.ndarray, step: int, speed: np.ndarray | None) -> np.ndarray:
    """Per sampled frame, how far apart its pairs are: ``step``, or less where the view moves
    faster than BOIL_MAX_SHIFT / step px a frame (``speed``: the texture's speed in each pair,
    :func:`_texture_speed`, working-size px; the fastest pair within ``step`` of the frame counts)."""
    gaps = np.full(len(idx), step, int)
    if speed is None or len(speed) == 0:
        return gaps
    for j, i in enumerate(idx):
        v = float(np.max(speed[max(0, i - step):i + step]))
        if v * step > BOIL_MAX_SHIFT:
            gaps[j] = max(1, int(BOIL_MAX_SHIFT // v))
    return gaps


def boiling_series(gray: np.ndarray, step: int, area: float, inner: tuple,
                   rgb: np.ndarray | None = None, speed: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boiling score of up to BOIL_SAMPLES frames: each frame against the frames ``step`` before
    and after it (the smaller of the two maps per pixel, so a region occluded on one side is seen
    on the other), then the value exceeded by the ``area`` share of the frame's inner part. Under
    a fast move (``speed``, see :func:`boil_gaps`) the two frames are nearer.

    Returns (scores, frame indices, gaps)."""
    n = len(gray)
    step = max(1, min(step, (n - 1) // 2)) if n > 2 else 1
    both = n > 2 * step
    idx = np.arange(step if both else 0, n - step)
    if len(idx) > BOIL_SAMPLES:
        idx = idx[np.linspace(0, len(idx) - 1, BOIL_SAMPLES).round().astype(int)]
    scores = np.zeros(len(idx))
    gaps = boil_gaps(idx, step, speed)

    def run(part: np.ndarray) -> None:
        flow = FlowEstimator(BOIL_FLOW_PRESET)
        for j in part:
            i, k = idx[j], gaps[j]
            # colour edges of both frames of a pair: an object the luma flow misses leaves its
            # residual where it is in either (frame i's alone: ground-truth shapes clips at 30 fps
            # 2/60 rejected instead of 0/60; held-out boil set 45 caught instead of 42). The other
            # frame's are warped with the flow (until the fifteenth session they were not, so under
            # a camera move they excused the wrong places: README, Boiling)
            # (each frame's colour gradients are computed once: colour_gradients)
            grads = None if rgb is None else {o: colour_gradients(rgb[o]) for o in (i, i + k, i - k) if 0 <= o < n}

            def side(o: int) -> np.ndarray:
                if grads is None:
                    return boiling_map(gray[i], gray[o], flow)
                return boiling_map(gray[i], gray[o], flow, rgb=(rgb[i], rgb[o]), colour=(grads[i], grads[o]))

            m = side(i + k)
            if both:  # a window left out on one side (a flow failure, an occlusion) is read on the other
                m = np.fmin(m, side(i - k))
            m = np.nan_to_num(m, nan=0.0)
            scores[j] = np.quantile(m[inner], 1.0 - area)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for f in [pool.submit(run, part) for part in np.array_split(np.arange(len(idx)), 2)]:
            f.result()
    return scores, idx, gaps


BOIL_CHROMA_FLOW = True  # the boiling flow also follows colour (pipeline.flow.colour_flow)
BORDER_LINE_DEPTH = 3  # px (working size) between the frame's outermost line and the lines it is compared with
BORDER_LINE_SHARE = 0.65  # share of a side's positions that must stand apart the same way


def frame_border_line(frames: np.ndarray, depth: int = BORDER_LINE_DEPTH, share: float = BORDER_LINE_SHARE) -> np.ndarray:
    """(F, 4, 3) for (F, h, w, 3) frames: how far the outermost line of each side (top, bottom,
    left, right) stands apart from the picture inside it, per colour channel, in levels (0 where
    it does not).

    A decoder fed latents out of its range (the wrong VAE scaling) draws a bright or coloured line
    one or two pixels wide along the frame's edges: its convolutions' zero padding, amplified.
    Per position along a side, the outermost value against the lines ``depth`` and 2 ``depth`` px
    in, ``r0 - 2 r[depth] + r[2 depth]``: a smooth gradient (a vignette, a sky) cancels. The side's
    value is what ``share`` of its positions exceed in the same direction: such a line runs along
    the whole side, while content crossing the side, or checks aligned with it, go both ways."""
    x = frames.astype(np.float32)
    xt = x.transpose(0, 2, 1, 3)
    q = 100.0 * (1.0 - share)
    out = np.zeros((len(x), 4, 3), np.float32)
    for k, v in enumerate((x, x[:, ::-1], xt, xt[:, ::-1])):  # each view has its side in row 0
        d = v[:, 0, 2:-2] - 2.0 * v[:, depth, 2:-2] + v[:, 2 * depth, 2:-2]  # (F, positions, 3)
        lo, hi = np.percentile(d, [q, 100.0 - q], axis=1)
        out[:, k] = np.where(np.median(d, axis=1) > 0, np.maximum(lo, 0.0), np.maximum(-hi, 0.0))
    return out


SAT_EDGE = 0.04  # saturation change per pixel (0..1) that makes an edge for the saturation drift
SAT_EDGE_GROW = 2  # px the edges are grown by


def _sat_drift(a: np.ndarray, b: np.ndarray, inner) -> float:
    """Mean saturation gain from ``a`` to ``b`` (the next frame warped onto ``a``) away from
    saturation edges. The flow misplaces a saturated object's outline by a fraction of a pixel
    in every pair, and under a zoom or a move that error has one sign: summed over a clip, a
    green square growing in a zoom in read as +0.12 saturation of "the same content". A colour
    blow-out raises the saturation of flat regions too, which this still measures. Where edges
    leave a tenth of ``inner`` or less (saturated texture everywhere), the mean over all of it."""
    edges = np.zeros(a.shape, bool)
    for x in (a, b):
        gx, gy = gradient(x)
        edges |= np.hypot(gx, gy) > SAT_EDGE
    k = 2 * SAT_EDGE_GROW + 1
    edges = cv2.dilate(edges.astype(np.uint8), np.ones((k, k), np.uint8)) > 0
    d, keep = (b - a)[inner], ~edges[inner]
    return float(d[keep].mean()) if keep.mean() > 0.1 else float(d.mean())


def measure(frames: np.ndarray, max_side: int = 320, fps: float = 24.0, boil_seconds: float = 0.125,
            boil_area: float = 0.015) -> Series:
    gray, small, scale = working_copy(frames, max_side)
    n, h, w = gray.shape
    by, bx = max(1, int(h * BORDER)), max(1, int(w * BORDER))
    inner = (slice(by, h - by), slice(bx, w - bx))

    hsv = [cv2.cvtColor(x, cv2.COLOR_RGB2HSV) for x in small]
    luma = gray.mean(axis=(1, 2))
    spread = gray.std(axis=(1, 2))
    clipped = np.array([(x[..., 2] >= 250).mean() for x in hsv])  # HSV value = max(R, G, B)
    saturation = np.array([x[..., 1].mean() / 255.0 for x in hsv])

    m = max(n - 1, 0)
    diff, change, flow_m, residual, ssim = (np.zeros(m) for _ in range(5))
    hp_ratio, luma_drift, sat_drift, flow_dx, flow_dy = (np.zeros(m) for _ in range(5))
    texture_speed = np.zeros(m)
    zoom = np.ones(m)
    cells = np.zeros((m, GRID, GRID), np.float32)
    sat = [x[..., 1].astype(np.float32) / 255.0 for x in hsv]
    g8 = np.clip(gray, 0, 255).astype(np.uint8)
    hp = [_highpass(g) for g in gray]

    def pairs(lo: int, hi: int) -> None:
        flow_of = FlowEstimator("fast")  # one per thread; "fast" holds on quick pans over repetitive texture
        for i in range(lo, hi):
            a, b = gray[i], gray[i + 1]
            fl = flow_of(g8[i], g8[i + 1])
            wb = warp(b, fl)
            r = np.abs(a - wb)[inner]
            diff[i] = np.abs(b - a)[inner].mean()
            # where the frame changed most: a small, slow or iso-luminant object changes the mean
            # difference by a hundredth of a luma level at 60 fps, but its own cells by several
            dc = np.abs(small[i + 1][inner].astype(np.float32) - small[i][inner]).max(axis=-1)
            change[i] = cv2.resize(dc, (GRID, GRID), interpolation=cv2.INTER_AREA).max()
            flow_m[i] = np.sqrt((fl[inner] ** 2).sum(axis=-1)).mean()
            texture_speed[i] = _texture_speed(a, fl, inner)
            # content at x in frame i is at x + flow in frame i+1
            sub = fl[inner][::4, ::4]
            flow_dx[i], flow_dy[i] = np.median(sub[..., 0]), np.median(sub[..., 1])
            # zoom: divergence of the flow is 2 (s - 1) for a scale change s
            div = np.gradient(fl[..., 0], axis=1) + np.gradient(fl[..., 1], axis=0)
            zoom[i] = 1.0 + 0.5 * float(np.median(div[inner]))
            residual[i] = r.mean()
            ssim[i] = ssim_map(a, wb)[inner].mean()
            cells[i] = cv2.resize(r, (GRID, GRID), interpolation=cv2.INTER_AREA)
            luma_drift[i] = (wb - a)[inner].mean()
            sat_drift[i] = _sat_drift(sat[i], warp(sat[i + 1], fl), inner)
            hp_w = warp(hp[i + 1], fl)
            hp_ratio[i] = np.abs(hp[i] - hp_w)[inner].mean() / (
                0.5 * (np.abs(hp[i])[inner].mean() + np.abs(hp_w)[inner].mean()) + 1e-3
            )

    # OpenCV and numpy release the GIL: two threads use both cores of a small machine
    half = m // 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        for f in [pool.submit(pairs, 0, half), pool.submit(pairs, half, m)]:
            f.result()
    sharpness = sharpness_trend(frames, flow_dx, flow_dy, zoom, scale)
    boil, boil_frames, boil_gap = (
        boiling_series(gray, int(round(boil_seconds * fps)), boil_area, inner, small, texture_speed) if n > 1
        else (np.zeros(0), np.zeros(0, int), np.zeros(0, int)))
    border_line = frame_border_line(small)
    return Series(scale, luma, spread, clipped, saturation, sharpness, diff, change, flow_m, residual, ssim,
                  cells, hp_ratio, luma_drift, sat_drift, boil, boil_frames, boil_gap, border_line)


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
