"""QC verdicts: pass or reject, with a reason per defect naming frames and metric values."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from qc.metrics import FrameSeries, frame_series, runs


@dataclass(frozen=True)
class QCConfig:
    """Thresholds. Luma and differences are on a 0..255 scale."""

    max_side: int = 320  # long side of the downscaled copy the metrics use
    black_luma: float = 16.0  # a frame whose mean luma is below this is black
    uniform_std: float = 2.0  # a frame whose luma std is below this is uniform (flat)
    min_ssim: float = 0.30  # any consecutive pair below this is a jump or a garbage frame
    min_mean_ssim: float = 0.50  # the clip's mean consecutive SSIM below this: unstable throughout
    frozen_diff: float = 0.25  # consecutive frames closer than this are identical
    frozen_seconds: float = 0.5  # a frozen stretch this long, inside a moving clip, is a defect
    moving_diff: float = 1.0  # the clip moves if its median consecutive difference is above this
    flicker_luma: float = 8.0  # mean-luma swings above this that change sign every frame
    flicker_frames: int = 3  # at least this many alternating swings in a row

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class QCResult:
    verdict: str  # "pass" | "reject"
    reasons: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _ranges(items: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in items)


def check_series(s: FrameSeries, fps: float, cfg: QCConfig = QCConfig()) -> QCResult:
    reasons: list[str] = []
    n = len(s.luma_mean)

    black = runs(s.luma_mean < cfg.black_luma)
    if black:
        reasons.append(
            f"black: frames {_ranges(black)} (mean luma {s.luma_mean.min():.1f} < {cfg.black_luma:g})"
        )
    uniform = runs((s.luma_std < cfg.uniform_std) & (s.luma_mean >= cfg.black_luma))
    if uniform:
        reasons.append(
            f"uniform: frames {_ranges(uniform)} (luma std {s.luma_std.min():.2f} < {cfg.uniform_std:g})"
        )

    if n > 1:
        low = np.flatnonzero(s.ssim < cfg.min_ssim)
        if len(low):
            pairs = ", ".join(f"{i}-{i + 1}" for i in low[:5]) + (" ..." if len(low) > 5 else "")
            reasons.append(f"jump: frame pairs {pairs} (SSIM {s.ssim.min():.3f} < {cfg.min_ssim:g})")
        if s.ssim.mean() < cfg.min_mean_ssim:
            reasons.append(
                f"unstable: frames 0-{n - 1} (mean SSIM {s.ssim.mean():.3f} < {cfg.min_mean_ssim:g})"
            )

        moving = float(np.median(s.diff)) > cfg.moving_diff
        min_len = max(2, int(round(cfg.frozen_seconds * fps)))
        frozen = [(a, b + 1) for a, b in runs(s.diff < cfg.frozen_diff) if b - a + 1 >= min_len - 1]
        if moving and frozen:
            longest = max(b - a + 1 for a, b in frozen)
            reasons.append(
                f"frozen: frames {_ranges(frozen)} ({longest} identical frames, "
                f"{longest / fps:.2f} s >= {cfg.frozen_seconds:g} s in a moving clip)"
            )

        d = np.diff(s.luma_mean)
        big = np.abs(d) > cfg.flicker_luma
        alternating = big[1:] & big[:-1] & (np.sign(d[1:]) != np.sign(d[:-1]))
        flick = [(a, b + 2) for a, b in runs(alternating) if b - a + 1 >= cfg.flicker_frames - 1]
        if flick:
            reasons.append(
                f"flicker: frames {_ranges(flick)} (mean luma swings up to {np.abs(d).max():.1f} "
                f"> {cfg.flicker_luma:g}, alternating)"
            )

    metrics = {
        "frames": n,
        "fps": round(float(fps), 3),
        "luma_mean": round(float(s.luma_mean.mean()), 3),
        "luma_min": round(float(s.luma_mean.min()), 3),
        "luma_std_min": round(float(s.luma_std.min()), 3),
        "ssim_mean": round(float(s.ssim.mean()), 4) if n > 1 else None,
        "ssim_min": round(float(s.ssim.min()), 4) if n > 1 else None,
        "diff_mean": round(float(s.diff.mean()), 3) if n > 1 else None,
        "diff_max": round(float(s.diff.max()), 3) if n > 1 else None,
        "black_frames": int(sum(b - a + 1 for a, b in black)),
        "uniform_frames": int(sum(b - a + 1 for a, b in uniform)),
    }
    return QCResult("reject" if reasons else "pass", reasons, metrics)


def check_frames(frames: np.ndarray, fps: float, cfg: QCConfig = QCConfig()) -> QCResult:
    """QC over (F, H, W, 3) uint8 RGB frames."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames: expected (F, H, W, 3) uint8 with F >= 1, got {frames.shape} {frames.dtype}")
    t0 = time.perf_counter()
    result = check_series(frame_series(frames, cfg.max_side), fps, cfg)
    result.metrics["width"], result.metrics["height"] = int(frames.shape[2]), int(frames.shape[1])
    result.metrics["qc_s"] = round(time.perf_counter() - t0, 4)
    return result

