"""Frame interpolation by bidirectional optical flow, for any frame-rate change.

For an output frame at time t between input frames 0 and 1:

1. flows F01 and F10 between the two frames (DIS, on a copy at most ``flow_side`` pixels long);
2. flows from time t back to each frame, by the linear-motion approximation of Super SloMo:
   F_t0 = -(1-t)·t·F01 + t²·F10 and F_t1 = (1-t)²·F01 - t·(1-t)·F10;
3. both frames warped to time t;
4. occlusion handling: forward/backward consistency says which pixels of each frame are seen
   in the other; a warped sample is trusted less where the content it stands in front of is
   not visible in the other frame;
5. blend, weighted by time and trust.

At a cut (a pair that the flow cannot explain) the nearest frame is repeated instead, so no
ghost of two scenes is ever blended. The output has ``round((n-1)·fps_out/fps_in)+1`` frames;
output frame k shows input time ``k·fps_in/fps_out``, so it starts on the first input frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import cv2
import numpy as np

from clipmill.pipeline.flow import FlowEstimator, ssim_map, warp
from clipmill.pipeline.retime import source_times

EPS_T = 1e-3  # output times this close to an input frame take that frame as it is


@dataclass(frozen=True)
class InterpConfig:
    flow_side: int = 640  # long side of the copy the flow is computed on
    preset: str = "medium"  # DIS preset
    occlusion_sigma: float = 1.0  # px: forward/backward disagreement at which trust falls to 1/e
    cut_residual: float = 30.0  # mean |frame0 - warped frame1| (0..255) above this is a cut
    cut_ssim: float = 0.3  # and a compensated SSIM below this


@dataclass
class PairFlow:
    s01: np.ndarray  # flows on the small copy
    s10: np.ndarray
    v0: np.ndarray  # trust of frame 0's pixels (seen in frame 1), 0..1, on the small copy
    v1: np.ndarray
    k: int  # full size / small size
    cut: bool


def _gray_small(frame: np.ndarray, k: int) -> np.ndarray:
    g = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
    if k > 1:
        h, w = g.shape
        g = cv2.resize(g, (w // k, h // k), interpolation=cv2.INTER_AREA)
    return g


def _upscale(flow: np.ndarray, h: int, w: int, k: int) -> np.ndarray:
    if k == 1:
        return flow
    up = cv2.resize(flow, (w, h), interpolation=cv2.INTER_LINEAR)
    return up * np.float32(k)


def _consistency(f_ab: np.ndarray, f_ba: np.ndarray, sigma: float) -> np.ndarray:
    """For each pixel of a: how well b's flow brings it back (1: fully, 0: occluded)."""
    back = warp(f_ba, f_ab)
    err2 = ((f_ab + back) ** 2).sum(axis=-1)
    return np.exp(-err2 / (2 * sigma * sigma)).astype(np.float32)


def pair_flow(a: np.ndarray, b: np.ndarray, flow: FlowEstimator, cfg: InterpConfig) -> PairFlow:
    h, w = a.shape[:2]
    k = max(1, int(np.ceil(max(h, w) / cfg.flow_side)))
    ga, gb = _gray_small(a, k), _gray_small(b, k)
    s01, s10 = flow(ga, gb), flow(gb, ga)
    # cut check on the small copy: can the flow explain frame b from frame a at all?
    wa = warp(gb.astype(np.float32), s01)
    fa = ga.astype(np.float32)
    residual = float(np.abs(fa - wa).mean())
    cut = residual > cfg.cut_residual and float(ssim_map(fa, wa).mean()) < cfg.cut_ssim
    sigma = cfg.occlusion_sigma
    return PairFlow(s01, s10, _consistency(s01, s10, sigma), _consistency(s10, s01, sigma), k, cut)


def in_between(a: np.ndarray, b: np.ndarray, t: float, pf: PairFlow) -> np.ndarray:
    """The frame at time ``t`` (0 < t < 1) between ``a`` and ``b``."""
    if pf.cut:
        return (a if t < 0.5 else b).copy()
    t = np.float32(t)
    # flows and trust are worked out on the small copy, then scaled up once per output frame
    s_t0 = -(1 - t) * t * pf.s01 + t * t * pf.s10
    s_t1 = (1 - t) * (1 - t) * pf.s01 - t * (1 - t) * pf.s10
    # a's sample is wrong where the content at this place is not visible in a: there b's pixel
    # (warped along f_t1) has no partner in a, and the other way round
    trust_a = warp(pf.v1, s_t1)
    trust_b = warp(pf.v0, s_t0)
    wb_small = (t * (0.05 + trust_b)) / ((1 - t) * (0.05 + trust_a) + t * (0.05 + trust_b))
    h, w = a.shape[:2]
    a_t = warp(a, _upscale(s_t0, h, w, pf.k))
    b_t = warp(b, _upscale(s_t1, h, w, pf.k))
    wb = cv2.resize(wb_small, (w, h), interpolation=cv2.INTER_LINEAR) if pf.k > 1 else wb_small
    a_f = a_t.astype(np.float32)
    out = a_f + (b_t.astype(np.float32) - a_f) * wb[..., None]
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def interpolate(
    frames: np.ndarray,
    fps_in: float,
    fps_out: float,
    cfg: InterpConfig = InterpConfig(),
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """(F, H, W, 3) uint8 frames at ``fps_in`` to the same clip at ``fps_out``."""
    n = len(frames)
    pos = source_times(n, fps_in, fps_out)
    out = np.empty((len(pos),) + frames.shape[1:], np.uint8)
    flow = FlowEstimator(cfg.preset)
    cache: tuple[int, PairFlow] | None = None
    for k, p in enumerate(pos):
        i = int(np.floor(p + EPS_T))
        t = p - i
        if t < EPS_T or i >= n - 1:
            out[k] = frames[min(i, n - 1)]
        else:
            if cache is None or cache[0] != i:
                cache = (i, pair_flow(frames[i], frames[i + 1], flow, cfg))
            out[k] = in_between(frames[i], frames[i + 1], t, cache[1])
        if progress is not None:
            progress(k + 1, len(pos))
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)
