"""The streaming preview measured, behind ``clipmill bench --preview``.

- Time to first frame (the model warm: the stream's warm-up calls and the first frame out) and
  sustained frames per second at each preview tier's most steps, unpaced.
- Frame-time stability under a load change: a stream paced to a frame-time budget (set from the
  quiet machine: 15% over the best tier's frame cost at its most steps), ``seconds`` long,
  with a second process spinning on the CPU for ``load_s`` in the middle. Fixed steps against
  the adaptive scheduler: P50 and P95 of the delivered frame interval, its standard deviation,
  tier switches and dropped frames, and what the analyzer reads per tier.
- Seams: consecutive frames of the stream against a whole-clip render of the same prompt
  (compensated SSIM of each pair, QC's metrics), and QC's cut detector over the recorded stream.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np

from clipmill.jobs.review.preview import PREVIEW_TIERS, Session
from clipmill.pipeline import shapes
from clipmill.pipeline.adaptive import AdaptiveConfig, FrameScheduler
from clipmill.pipeline.pacing import Pacer
from clipmill.pipeline.models import model_info
from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
from clipmill.pipeline.stream import StreamBatch
from clipmill.qc.adherence import analyze
from clipmill.qc.check import QCConfig, spike_mask
from clipmill.qc.metrics import measure

PROMPT = "a red circle moves right on a beige background, pan right"
SPIN = "import time\nt = time.time() + {s}\nwhile time.time() < t:\n    pass\n"


def _stats(intervals: list[float]) -> dict:
    srt = sorted(intervals)
    return {"frames": len(intervals) + 1, "p50_ms": round(statistics.median(intervals) * 1000, 1),
            "p95_ms": round(srt[min(len(srt) - 1, int(np.ceil(0.95 * len(srt))) - 1)] * 1000, 1),
            "std_ms": round(statistics.pstdev(intervals) * 1000, 1)}


def paced_run(r: Renderer, seconds: float, budget_s: float, load_at: float, load_s: float, adaptive: bool,
              seed: int = 1) -> dict:
    """One stream as the preview server delivers it (``preview.Session``: rendered ahead in its
    own thread, ``adaptive`` planning the steps, else every call at the best tier's most),
    frames taken no sooner than one budget apart."""
    sched = FrameScheduler(PREVIEW_TIERS, AdaptiveConfig(budget_s=budget_s)) if adaptive else None
    session = Session("bench", StreamBatch(r, PROMPT, seed=seed, steps=PREVIEW_TIERS[0].max_steps), sched, seed)
    spinner = None
    delivered: list[float] = []
    by_tier: dict[str, list[np.ndarray]] = {}
    dropped = 0
    try:
        t0 = time.perf_counter()
        session.start()
        pacer = Pacer(budget_s)
        while time.perf_counter() - t0 < seconds:
            if spinner is None and time.perf_counter() - t0 >= load_at:  # the load: a second process takes a core
                spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=load_s)])
            f, info = session.next_frame()
            if f is None:
                continue
            pacer.wait()
            delivered.append(time.perf_counter())
            by_tier.setdefault(info["tier"], []).append(f.image)
            dropped += info["drop"]
    finally:
        session.close()
        if spinner is not None:
            spinner.wait()
    out = _stats(list(np.diff(delivered)))
    out.update(switches=[(a, b) for _, a, b in sched.switches] if sched else [], dropped=dropped,
               frames_by_tier={k: len(v) for k, v in by_tier.items()})
    spec = shapes.parse(PROMPT)
    reads = {}
    for tier, imgs in by_tier.items():  # what the analyzer reads, window by window of 8 frames
        wins = [analyze(np.stack(imgs[i:i + 8])) for i in range(0, len(imgs) - 7, 8)]
        if wins:
            reads[tier] = {a: round(sum(getattr(w, a) == getattr(spec, a) for w in wins) / len(wins), 3)
                           for a in ("colour", "shape", "background")}
    out["adherence_by_tier"] = reads
    return out


def preview_bench(seconds: float = 40.0, load_s: float = 10.0, threads: int = 2) -> dict:
    import torch

    torch.set_num_threads(threads)
    info = model_info("shapes")
    r = Renderer(info)
    res: dict = {"threads": threads, "window": info.default_frames}
    # 1. time to first frame (warm model: the stream's warm-up calls included), fps per tier
    t = time.perf_counter()
    sb = StreamBatch(r, PROMPT, seed=0, steps=PREVIEW_TIERS[0].max_steps)
    while not sb.next():
        pass
    res["first_frame_ms"] = round((time.perf_counter() - t) * 1000, 1)
    sb.close()
    fps = {}
    for tier in PREVIEW_TIERS:
        for steps in sorted({tier.min_steps, tier.max_steps}):
            sb = StreamBatch(r, PROMPT, seed=0, steps=steps)
            n, t = 0, time.perf_counter()
            while time.perf_counter() - t < 3.0:
                n += len(sb.next())
            fps[f"{tier.name} ({steps} steps)"] = round(n / (time.perf_counter() - t), 1)
            sb.close()
    res["fps"] = fps
    # 2. the budget from the quiet machine: 15% over the best tier's frame at its most steps
    best = fps[f"{PREVIEW_TIERS[0].name} ({PREVIEW_TIERS[0].max_steps} steps)"]
    budget = round(1.15 / best, 4)
    res["budget_ms"] = round(budget * 1000, 1)
    load_at = (seconds - load_s) / 2
    res["fixed"] = paced_run(r, seconds, budget, load_at, load_s, adaptive=False)
    res["adaptive"] = paced_run(r, seconds, budget, load_at, load_s, adaptive=True)
    res["std_ratio"] = round(res["fixed"]["std_ms"] / max(res["adaptive"]["std_ms"], 1e-6), 2)
    res["p95_over_budget"] = round(res["adaptive"]["p95_ms"] / res["budget_ms"] - 1, 3)
    # 3. seams: the stream's consecutive frames against one whole clip of the same prompt
    sb = StreamBatch(r, PROMPT, seed=2, steps=PREVIEW_TIERS[0].max_steps)
    recorded = []
    while len(recorded) < 64:
        recorded += [f.image for f in sb.next()]
    sb.close()
    stream = np.stack(recorded)
    (clip,) = r.render([ClipRequest(key="c", prompt=PROMPT, seed=2, frames=info.max_frames, width=64, height=64)],
                       GroupSettings(tier="quality", sampler=info.scheduler))
    s_stream = measure(stream, fps=float(info.native_fps))
    s_clip = measure(clip.frames, fps=float(info.native_fps))
    res["seams"] = {"stream_frames": len(stream), "stream_pair_ssim_median": round(float(np.median(s_stream.ssim)), 4),
                    "stream_pair_ssim_min": round(float(np.min(s_stream.ssim)), 4),
                    "clip_pair_ssim_median": round(float(np.median(s_clip.ssim)), 4),
                    "clip_pair_ssim_min": round(float(np.min(s_clip.ssim)), 4),
                    "cuts_in_stream": int(spike_mask(s_stream, QCConfig()).sum())}
    return res
