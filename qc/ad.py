"""QC of a finished ad: its length, where its cuts fall, whether its texts are legible and inside
the safe area, and whether its audio is there, audible, unclipped and as long as the video.

Each check takes measurements (frames, boxes, colours, PCM), not templates or jobs, and returns
its reasons in words, with the value and its limit. :func:`check` runs them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .check import QCConfig, spike_mask
from .metrics import measure

WCAG_MIN = 4.5  # WCAG 2's contrast ratio for normal text (AA)
SILENT_DBFS = -50.0  # music quieter than this (RMS) is silence
CLIPPED_SHARE = 0.001  # more samples than this at full scale is clipping


def luminance(rgb) -> np.ndarray:
    """WCAG relative luminance of sRGB colours (..., 3), 0..255."""
    c = np.asarray(rgb, np.float64) / 255.0
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    return lin @ np.array([0.2126, 0.7152, 0.0722])


def contrast(l1, l2) -> np.ndarray:
    """WCAG contrast ratio of two relative luminances (1 to 21)."""
    hi, lo = np.maximum(l1, l2), np.minimum(l1, l2)
    return (hi + 0.05) / (lo + 0.05)


@dataclass
class TextCheck:
    """A text layer as drawn: its box (x, y, w, h) in output pixels, its fill colour, its outline
    or shadow colour when it has one, and the footage pixels under its box at sampled times
    (N, 3), read before the layers were drawn."""

    name: str
    box: tuple[int, int, int, int]
    colour: tuple[int, int, int]
    edge_colour: tuple[int, int, int] | None
    under: np.ndarray


def legibility(t: TextCheck) -> tuple[float, str | None]:
    """The text's contrast against the footage under it, and a reason when it is under
    :data:`WCAG_MIN` and no outline or shadow makes up for it. The footage is read at its 10th or
    90th luminance percentile, whichever is nearer the text's own luminance (the worst part of a
    textured background, not its mean)."""
    lt = float(luminance(t.colour))
    lum = luminance(t.under) if len(t.under) else np.array([lt])
    worst = float(np.percentile(lum, 90)) if lt >= float(np.median(lum)) else float(np.percentile(lum, 10))
    ratio = float(contrast(lt, worst))
    if ratio >= WCAG_MIN:
        return ratio, None
    if t.edge_colour is not None:
        edge = float(contrast(lt, float(luminance(t.edge_colour))))
        if edge >= WCAG_MIN:
            return ratio, None
        return ratio, (f"text {t.name!r}: contrast {ratio:.2f}:1 against the footage under it and {edge:.2f}:1 "
                       f"against its own outline/shadow, both < {WCAG_MIN}:1 (WCAG)")
    return ratio, (f"text {t.name!r}: contrast {ratio:.2f}:1 against the footage under it < {WCAG_MIN}:1 (WCAG), "
                   "and it has no outline or shadow")


def inside(name: str, box: tuple[int, int, int, int], safe: tuple[int, int, int, int]) -> str | None:
    """A reason when ``box`` (x, y, w, h) is not inside the ``safe`` rectangle (x, y, w, h)."""
    x, y, w, h = box
    sx, sy, sw, sh = safe
    if x >= sx and y >= sy and x + w <= sx + sw and y + h <= sy + sh:
        return None
    return (f"{name}: box x {x}-{x + w}, y {y}-{y + h} is outside the safe area x {sx}-{sx + sw}, "
            f"y {sy}-{sy + sh}")


def cuts(frames: np.ndarray, fps: float, cfg: QCConfig = QCConfig()) -> list[int]:
    """The frames at which a cut happens (the first frame after it), by QC's motion-compensated
    spike test over small frames (a lone spiking pair)."""
    s = measure(frames, max_side=cfg.max_side, fps=fps)
    spike = spike_mask(s, cfg)
    out = []
    for i in np.flatnonzero(spike):
        if not (i > 0 and spike[i - 1]) and not (i + 1 < len(spike) and spike[i + 1]):
            out.append(int(i) + 1)
    return out


def cut_reasons(found: list[int], boundaries: list[int], fps: float, tolerance: int = 1) -> list[str]:
    """Reasons for cuts that are not at a shot boundary (``boundaries``: first frames of the new
    shots where the template cuts), within ``tolerance`` frames."""
    stray = [f for f in found if not any(abs(f - b) <= tolerance for b in boundaries)]
    if not stray:
        return []
    where = ", ".join(f"frame {f} ({f / fps:.2f} s)" for f in stray[:6])
    return [f"cut: at {where}, not at a shot boundary (the template cuts at frames "
            f"{', '.join(map(str, boundaries)) or 'none'})"]


def duration_reason(frames: int, fps: float, seconds: float) -> str | None:
    got = frames / fps
    if abs(got - seconds) <= 1.0 / fps + 1e-9:
        return None
    return f"duration: {got:.3f} s ({frames} frames at {fps:g} fps), the template's is {seconds:.3f} s (one frame: {1 / fps:.3f} s)"


def audio_reasons(pcm: np.ndarray | None, rate: int, video_seconds: float, fps: float) -> list[str]:
    """Reasons for audio that is missing, silent, clipping, or not as long as the video (within
    one video frame, after the AAC encoder's padding of up to 2,048 samples)."""
    if pcm is None or pcm.size == 0:
        return ["audio: no audio stream"]
    out = []
    lv = levels(pcm)
    if lv["rms_dbfs"] < SILENT_DBFS:
        out.append(f"audio: silent (RMS {lv['rms_dbfs']:.1f} dBFS < {SILENT_DBFS:g} dBFS)")
    if lv["clipped"] > CLIPPED_SHARE:
        out.append(f"audio: clipping ({lv['clipped']:.2%} of samples at full scale > {CLIPPED_SHARE:.1%})")
    seconds = pcm.shape[-1] / rate
    if abs(seconds - video_seconds) > 1.0 / fps + 2048 / rate:
        out.append(f"audio: {seconds:.3f} s long, the video {video_seconds:.3f} s")
    return out


def levels(pcm: np.ndarray) -> dict:
    """Loudness figures of float PCM in [-1, 1]: RMS and peak in dBFS, and the share of samples at
    full scale (clipping)."""
    x = np.asarray(pcm, np.float64)
    rms = float(np.sqrt(np.mean(x**2))) if x.size else 0.0
    peak = float(np.abs(x).max()) if x.size else 0.0
    return {"rms_dbfs": 20 * np.log10(max(rms, 1e-10)), "peak_dbfs": 20 * np.log10(max(peak, 1e-10)),
            "clipped": float((np.abs(x) >= 0.999).mean()) if x.size else 0.0}


@dataclass
class AdQC:
    verdict: str
    reasons: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def check(small_frames: np.ndarray, fps: float, seconds: float, boundaries: list[int], texts: list[TextCheck],
          boxes: dict[str, tuple[int, int, int, int]], safe: tuple[int, int, int, int], pcm: np.ndarray | None,
          rate: int, cfg: QCConfig = QCConfig()) -> AdQC:
    """Every ad check. ``small_frames``: the decoded ad, scaled down (QC reads at most
    ``cfg.max_side`` pixels); ``boundaries``: the frames where the template cuts; ``boxes``:
    every layer's box (texts and logo), checked against the ``safe`` rectangle."""
    reasons: list[str] = []
    if r := duration_reason(len(small_frames), fps, seconds):
        reasons.append(r)
    found = cuts(small_frames, fps, cfg)
    reasons += cut_reasons(found, boundaries, fps)
    for name, b in boxes.items():
        if r := inside(name, b, safe):
            reasons.append(r)
    ratios = {}
    for t in texts:
        ratios[t.name], r = legibility(t)
        if r:
            reasons.append(r)
    reasons += audio_reasons(pcm, rate, len(small_frames) / fps, fps)
    metrics = {"cuts": found, "boundaries": boundaries, "contrast": {k: round(v, 2) for k, v in ratios.items()},
               "seconds": round(len(small_frames) / fps, 4)}
    return AdQC("reject" if reasons else "pass", reasons, metrics)
