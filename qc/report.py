"""What reviewers see of QC: a contact sheet (sample frames over metric curves) and text curves."""

from __future__ import annotations

import cv2
import numpy as np

from clipmill.qc.check import QCResult
from clipmill.qc.metrics import Series

CURVES = (  # (name, attribute, colour BGR, fixed range or None)
    ("compensated SSIM", "ssim", (60, 180, 60), (0.0, 1.0)),
    ("residual", "residual", (40, 40, 220), None),
    ("mean luma", "luma", (200, 200, 200), (0.0, 255.0)),
    ("flow px/frame", "flow", (220, 160, 40), None),
)


def contact_sheet(frames: np.ndarray, series: Series, result: QCResult, samples: int = 6, width: int = 960) -> bytes:
    """A PNG: ``samples`` evenly spaced frames, then the metric curves with the verdict."""
    n, h, w = frames.shape[:3]
    tile_w = width // samples
    tile_h = max(1, int(round(h * tile_w / w)))
    idx = np.linspace(0, n - 1, samples).round().astype(int)
    row = np.zeros((tile_h + 18, width, 3), np.uint8)
    for k, i in enumerate(idx):
        tile = cv2.resize(frames[i], (tile_w, tile_h), interpolation=cv2.INTER_AREA)[:, :, ::-1]
        row[:tile_h, k * tile_w : (k + 1) * tile_w] = tile
        cv2.putText(row, f"frame {i}", (k * tile_w + 4, tile_h + 13), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (220, 220, 220), 1)
    plot_h = 200
    plot = np.full((plot_h, width, 3), 24, np.uint8)
    for j, (name, attr, colour, rng) in enumerate(CURVES):
        y = np.asarray(getattr(series, attr), dtype=np.float64)
        if len(y) < 2:
            continue
        lo, hi = rng if rng else (0.0, max(float(y.max()), 1e-6))
        ys = plot_h - 20 - (np.clip((y - lo) / (hi - lo + 1e-9), 0, 1) * (plot_h - 40))
        xs = np.linspace(8, width - 8, len(y))
        pts = np.stack([xs, ys], axis=1).round().astype(np.int32)
        cv2.polylines(plot, [pts], False, colour, 1, cv2.LINE_AA)
        label = f"{name} ({lo:g}-{hi:.3g})"
        cv2.putText(plot, label, (8 + j * (width // 4), 14), cv2.FONT_HERSHEY_SIMPLEX, 0.4, colour, 1)
    colour = (60, 200, 60) if result.verdict == "pass" else (60, 60, 230)
    text = result.verdict.upper() + (": " + result.reasons[0] if result.reasons else "")
    cv2.putText(plot, text[:150], (8, plot_h - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.4, colour, 1)
    ok, buf = cv2.imencode(".png", np.vstack([row, plot]))
    if not ok:
        raise ValueError("contact sheet: PNG encoding failed")
    return buf.tobytes()


def explain_lines(series: Series, fps: float) -> list[str]:
    """Metric curves over time as text, one line per frame pair."""
    lines = ["pair       time  flow  residual  comp.SSIM   luma  texture  sharpness"]
    for i in range(len(series.ssim)):
        lines.append(
            f"{i:>3}-{i + 1:<4} {i / fps:6.2f}s {series.flow[i]:5.2f} {series.residual[i]:9.2f} "
            f"{series.ssim[i]:10.3f} {series.luma[i + 1]:6.1f} {series.hp_ratio[i]:8.2f} {series.sharpness[i + 1]:10.2f}"
        )
    return lines
