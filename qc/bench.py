"""Measuring QC: the confusion table on the synthetic labelled set, and speed on a 720p clip."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter

import numpy as np

from clipmill.pipeline.synthetic import camera_move, photo
from clipmill.pipeline.video import decode, encode_h264
from clipmill.qc.boil_set import HELDOUT_SEEDS, TUNE_SEEDS, BoilClip, make_boil_set
from clipmill.qc.check import QCConfig, check_frames
from clipmill.qc.synth import DEFECTS, make_set


def confusion(cfg: QCConfig = QCConfig(), seeds=(0, 1), size=(320, 192), per_motion: int = 3) -> dict:
    """Verdicts on good and broken synthetic clips; per-defect catch rates; the misses."""
    table: Counter = Counter()
    per_defect: Counter = Counter()
    misses = []
    for seed in seeds:
        for clip in make_set(seed, per_motion=per_motion, size=size):
            res = check_frames(clip.frames, clip.fps, cfg)
            good = clip.label == "good"
            table[("good" if good else "broken", res.verdict)] += 1
            if not good:
                per_defect[(clip.label, res.verdict)] += 1
            if (res.verdict == "pass") != good:
                misses.append({"clip": f"seed{seed}/{clip.name}", "verdict": res.verdict, "reasons": res.reasons})
    broken = table[("broken", "reject")] + table[("broken", "pass")]
    goods = table[("good", "pass")] + table[("good", "reject")]
    return {
        "good_passed": table[("good", "pass")],
        "good_rejected": table[("good", "reject")],
        "broken_rejected": table[("broken", "reject")],
        "broken_passed": table[("broken", "pass")],
        "broken_caught": round(table[("broken", "reject")] / broken, 4) if broken else None,
        "good_false_reject": round(table[("good", "reject")] / goods, 4) if goods else None,
        "per_defect": {
            d: f"{per_defect[(d, 'reject')]}/{per_defect[(d, 'reject')] + per_defect[(d, 'pass')]}" for d in DEFECTS
        },
        "misses": misses,
        "seeds": list(seeds),
        "size": f"{size[0]}x{size[1]}",
    }


def boiling_confusion(cfg: QCConfig = QCConfig(), seeds=HELDOUT_SEEDS, clips: list[BoilClip] | None = None) -> dict:
    """QC on the independent boiling set (``qc/boil_set.py``): grainy good clips against boiling
    ones, with the catch rate per kind of boiling region and per frame rate. Clips whose boiling
    H.264 smoothed away ("faint") are counted apart, never as misses."""
    clips = make_boil_set(seeds) if clips is None else clips
    table: Counter = Counter()
    per: Counter = Counter()
    misses = []
    for clip in clips:
        res = check_frames(clip.frames, clip.fps, cfg)
        table[(clip.label, res.verdict)] += 1
        if clip.label == "boiling":
            for key in (f"region {clip.meta['region']}", f"{clip.meta['fps']:g} fps" + (" (interpolated)" if clip.meta["interp"] else "")):
                per[(key, res.verdict)] += 1
        if clip.label != "faint" and (res.verdict == "pass") != (clip.label == "good"):
            misses.append({"clip": f"seed{clip.meta['seed']}/{clip.name}", "verdict": res.verdict, "reasons": res.reasons,
                           "boiling": res.metrics.get("boiling")})
    goods = table[("good", "pass")] + table[("good", "reject")]
    boils = table[("boiling", "reject")] + table[("boiling", "pass")]
    keys = sorted({k for k, _ in per})
    return {
        "good_passed": table[("good", "pass")],
        "good_rejected": table[("good", "reject")],
        "boiling_caught": table[("boiling", "reject")],
        "boiling_passed": table[("boiling", "pass")],
        "faint": table[("faint", "pass")] + table[("faint", "reject")],
        "catch_rate": round(table[("boiling", "reject")] / boils, 4) if boils else None,
        "good_false_reject": round(table[("good", "reject")] / goods, 4) if goods else None,
        "per_kind": {k: f"{per[(k, 'reject')]}/{per[(k, 'reject')] + per[(k, 'pass')]}" for k in keys},
        "misses": misses,
        "seeds": f"{seeds.start}-{seeds.stop - 1}" if isinstance(seeds, range) else list(seeds),
        "held_out": not set(seeds) & set(TUNE_SEEDS),
    }


def speed_720p(cfg: QCConfig = QCConfig(), seconds: float = 5.0, fps: float = 24.0, repeats: int = 3) -> dict:
    """Seconds to decode and check a ``seconds``-long 1280x720 H.264 clip (median of ``repeats``)."""
    rng = np.random.default_rng(0)
    frames = camera_move(photo("astronaut"), "pan", int(seconds * fps), (1280, 720), rng)
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        encode_h264(frames, fps, path)
        dec, qc = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f, r = decode(path)
            t1 = time.perf_counter()
            check_frames(f, r, cfg)
            dec.append(t1 - t0)
            qc.append(time.perf_counter() - t1)
    finally:
        os.unlink(path)
    return {
        "clip": f"1280x720, {len(frames)} frames at {fps:g} fps",
        "decode_s": round(float(np.median(dec)), 3),
        "qc_s": round(float(np.median(qc)), 3),
        "total_s": round(float(np.median(np.add(dec, qc))), 3),
    }
