"""Measuring interpolation: smooth high-frame-rate sequences, frames dropped, interpolated back,
and the new frames compared with the dropped ones by PSNR, against linear blending and frame
repetition."""

from __future__ import annotations

import time

import numpy as np

from clipmill.pipeline.interpolate import InterpConfig, interpolate, psnr
from clipmill.pipeline.retime import retime_linear, source_times
from clipmill.pipeline.synthetic import camera_move, photo

HIGH_FPS = 120
CASES = (  # (name, photo, motion, speed in px per 1/120 s, zoom over the clip)
    ("pan slow", "astronaut", "pan", 0.8, None),
    ("pan fast", "coffee", "pan", 2.4, None),
    ("tilt", "rocket", "tilt", 2.0, None),
    ("pan + object", "chelsea", "pan+object", 1.6, None),
    ("zoom", "immunohistochemistry", "zoom", None, 0.5),
)


def repeat_nearest(frames: np.ndarray, fps_in: float, fps_out: float) -> np.ndarray:
    pos = source_times(len(frames), fps_in, fps_out)
    return frames[np.minimum(np.rint(pos).astype(int), len(frames) - 1)]


def evaluate(size=(640, 360), fps_in=(24, 30), fps_out: int = 60, seconds: float = 1.0,
             cfg: InterpConfig = InterpConfig()) -> dict:
    rows = []
    for name, img, motion, speed, zoom in CASES:
        n_high = int(seconds * HIGH_FPS) + 1
        high = camera_move(photo(img), motion, n_high, size, np.random.default_rng(0), speed=speed, zoom=zoom)
        for fin in fps_in:
            step = HIGH_FPS // fin
            low = high[::step]
            t0 = time.perf_counter()
            flow = interpolate(low, fin, fps_out, cfg)
            secs = time.perf_counter() - t0
            lin = retime_linear(low, fin, fps_out)
            rep = repeat_nearest(low, fin, fps_out)
            pos = source_times(len(low), fin, fps_out)
            idx = [k for k, p in enumerate(pos) if abs(p - round(p)) > 1e-6]  # new frames only
            truth = [high[int(round(pos[k] * step))] for k in idx]
            score = {m: float(np.mean([psnr(out[k], t) for k, t in zip(idx, truth)]))
                     for m, out in (("flow", flow), ("linear", lin), ("repeat", rep))}
            rows.append({
                "case": name, "fps_in": fin, "fps_out": fps_out, "new_frames": len(idx),
                "psnr_flow": round(score["flow"], 2), "psnr_linear": round(score["linear"], 2),
                "psnr_repeat": round(score["repeat"], 2),
                "gain_vs_linear": round(score["flow"] - score["linear"], 2),
                "gain_vs_repeat": round(score["flow"] - score["repeat"], 2),
                "out_fps": round(len(flow) / secs, 1),
            })
    mean = lambda k: round(float(np.mean([r[k] for r in rows])), 2)  # noqa: E731
    return {"size": f"{size[0]}x{size[1]}", "rows": rows,
            "mean_gain_vs_linear": mean("gain_vs_linear"), "mean_gain_vs_repeat": mean("gain_vs_repeat")}


def speed_720p(fps_in: int = 24, fps_out: int = 60, seconds: float = 2.0, cfg: InterpConfig = InterpConfig()) -> dict:
    frames = camera_move(photo("astronaut"), "pan", int(seconds * fps_in), (1280, 720), np.random.default_rng(0), speed=8.0)
    t0 = time.perf_counter()
    out = interpolate(frames, fps_in, fps_out, cfg)
    secs = time.perf_counter() - t0
    return {"clip": f"1280x720, {len(frames)} frames {fps_in} -> {fps_out} fps", "output_frames": len(out),
            "seconds": round(secs, 2), "output_fps": round(len(out) / secs, 1)}
