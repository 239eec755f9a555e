"""Two measurements of finished ads, behind ``clipmill bench --assembly`` and ``--delivery``.

- :func:`assembly_speed`: the seconds (CPU, all threads, and wall) to assemble one format of
  one ad from footage already rendered and interpolated: ``examples/ad/speed-15s.toml`` at
  720 x 1280 (15 s, three shots, three texts, a logo, an end card, music), footage from the
  shapes world's own generator. Median of ``repeat`` runs after one warm-up; the ad-level QC
  is timed apart.
- :func:`delivery_quality`: what each delivery setting keeps of the frames before encoding
  (PSNR and SSIM on luma) and the file it makes (bytes, kbit/s), on 5 s of 720 x 1280 footage
  of virtual camera moves over photographs (``pipeline.synthetic``) with sensor grain, seeds
  apart from anything QC or interpolation was tuned on.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from clipmill.jobs.ads import build, rows, template
from clipmill.pipeline import assemble, shapes
from clipmill.pipeline.flow import ssim_map
from clipmill.pipeline.models import model_info
from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
from clipmill.pipeline.synthetic import camera_move, photo
from clipmill.pipeline.video import decode
from clipmill.qc.check import QCConfig, spike_mask
from clipmill.qc.metrics import measure

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ad"
SPEED_TEMPLATE = EXAMPLES / "speed-15s.toml"
SPEED_ROW = {"merchant": "老王面馆 Lao Wang", "price": "¥ 29.9", "cta": "立即下单 Order now", "colour": "red"}
DELIVERY_SETTINGS = [
    ("CRF 18", assemble.Delivery(crf=18)),
    ("CRF 21", assemble.Delivery(crf=21)),
    ("CRF 23", assemble.Delivery(crf=23)),
    ("CRF 26", assemble.Delivery(crf=26)),
    ("CRF 28", assemble.Delivery(crf=28)),
    ("CRF 21, cap 4 Mbit/s", assemble.Delivery(crf=21, max_kbps=4000)),
    ("CRF 21, cap 2 Mbit/s", assemble.Delivery(crf=21, max_kbps=2000)),
    ("CRF 21, cap 1 Mbit/s", assemble.Delivery(crf=21, max_kbps=1000)),
    ("baseline 3.1, CRF 23", assemble.Delivery(profile="baseline", level="3.1", crf=23)),
]


def generator_footage(ad: rows.AdRow, fmt: template.Format, fps: int) -> dict[int, np.ndarray]:
    """Each shot's frames from the shapes world's own generator at the format's render size,
    each frame held to the ad's fps: footage as rendered and interpolated, without a model."""
    out = {}
    for s in ad.shots:
        clip = shapes.render(shapes.parse(s.row.prompt), s.row.seed)
        w, h = s.sizes[fmt.name]
        fr = np.stack([cv2.resize(f, (w, h), interpolation=cv2.INTER_CUBIC) for f in clip.frames])
        idx = np.minimum((np.arange(round(s.seconds * fps)) * shapes.FPS / fps).astype(int), len(fr) - 1)
        out[s.index] = fr[idx]
    return out


def assembly_speed(repeat: int = 3, path: Path = SPEED_TEMPLATE) -> dict:
    """Assemble the speed template's first format ``repeat + 1`` times; the medians of the last
    ``repeat``."""
    tpl = template.load(path)
    info = model_info("shapes")
    with tempfile.TemporaryDirectory(prefix="clipmill-bench-ad-") as tmp:
        csv = Path(tmp) / "row.csv"
        csv.write_text(",".join(SPEED_ROW) + "\n" + ",".join(SPEED_ROW.values()) + "\n", encoding="utf-8")
        batch = rows.read_ads(csv, tpl, info, lambda t: len(t.encode()) + 2)
        if batch.errors:
            raise ValueError("; ".join(map(str, batch.errors)))
        ad, fmt = batch.ads[0], tpl.formats[0]
        footage = generator_footage(ad, fmt, tpl.fps)
        runs = []
        for _ in range(repeat + 1):
            cpu, wall = time.process_time(), time.perf_counter()
            built = build.make_format(tpl, ad, fmt, footage, Path(tmp) / "ad.mp4")
            runs.append({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, **built.timings,
                         "bytes": built.bytes, "verdict": built.qc.verdict})
    keep = runs[1:]
    med = {k: round(statistics.median(r[k] for r in keep), 3)
           for k in ("cpu_s", "wall_s", "layers_s", "encode_s", "qc_s", "assembly_cpu_s", "qc_cpu_s")}
    return {"template": str(path), "format": f"{fmt.width}x{fmt.height}", "seconds": tpl.seconds,
            "frames": round(tpl.seconds * tpl.fps), "runs": runs, "median": med}


def _psnr_ssim(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    ya = cv2.cvtColor(a, cv2.COLOR_RGB2YUV)[..., 0].astype(np.float32)
    yb = cv2.cvtColor(b, cv2.COLOR_RGB2YUV)[..., 0].astype(np.float32)
    mse = float(np.mean((ya - yb) ** 2))
    return 10 * np.log10(255.0**2 / max(mse, 1e-10)), float(ssim_map(ya, yb).mean())


def delivery_quality(seconds: float = 5.0, fps: int = 30, size: tuple[int, int] = (720, 1280), seed: int = 9091) -> dict:
    """Each of :data:`DELIVERY_SETTINGS` on the same footage: luma PSNR and SSIM of the decoded
    file against the frames before encoding (every 5th frame), bytes and kbit/s."""
    rng = np.random.default_rng(seed)
    n = round(seconds * fps)
    parts = [camera_move(photo(name), motion, n // 3 + 1, size, rng) for name, motion in
             (("astronaut", "pan"), ("coffee", "zoom"), ("chelsea", "tilt"))]
    frames = np.concatenate(parts)[:n]
    # sensor grain (sigma 3 luma levels, new every frame), as camera footage has: without it the
    # smooth, upscaled photographs cost a few hundred kbit/s and no cap would ever bind
    grain = np.random.default_rng(seed + 1)
    frames = np.clip(frames.astype(np.int16) + grain.normal(0, 3, frames.shape).astype(np.int16), 0, 255).astype(np.uint8)
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="clipmill-bench-delivery-") as tmp:
        for name, d in DELIVERY_SETTINGS:
            path = Path(tmp) / "d.mp4"
            t0 = time.perf_counter()
            made = assemble.encode(lambda: iter(frames), n, fps, size, path, d)
            encode_s = time.perf_counter() - t0
            got, _ = decode(path)
            scores = [_psnr_ssim(frames[i], got[i]) for i in range(0, n, 5)]
            rows_out.append({"setting": name, "profile": d.profile, "level": d.level, "crf": d.crf, "max_kbps": d.max_kbps,
                             "psnr_db": round(float(np.mean([p for p, _ in scores])), 2),
                             "ssim": round(float(np.mean([s for _, s in scores])), 4), "bytes": made["bytes"],
                             "kbps": round(made["bytes"] * 8 / seconds / 1000), "encode_s": round(encode_s, 2)})
    return {"footage": f"{n} frames at {size[0]}x{size[1]}, {fps} fps: camera moves over photographs with grain (seed {seed})",
            "rows": rows_out}


def seams(clips: int = 12, frames: int = 40, seed: int = 7000) -> dict:
    """Long shots against glued windows, on ``clips`` shapes-world prompts (the held-out split,
    seeds from ``seed``): each prompt rendered once as one ``frames``-frame long shot (FreeNoise
    windows) and once as independent clips of the model's own length, concatenated. For each:
    how many of QC's cut detections fall at window joins, and the compensated SSIM of the pair at
    each join over the clip's median pair SSIM (the issue's bound: within 10%, a ratio of 0.9
    or more)."""
    info = model_info("shapes")
    r = Renderer(info)
    window = info.default_frames
    settings = GroupSettings(tier="fast", sampler=info.scheduler)
    specs = shapes.split_specs("heldout")
    rng = np.random.default_rng(seed)
    out = {"long": [], "glued": []}
    for k in range(clips):
        spec = specs[int(rng.integers(len(specs)))]
        prompt = shapes.caption(spec)
        s0 = seed + k
        (long_res,) = r.render([ClipRequest(key="l", prompt=prompt, seed=s0, frames=frames, width=64, height=64)], settings)
        free = r.long_shot_windows(frames)
        long_joins = list(range(free.context_stride, frames - 1, free.context_stride))
        glued = np.concatenate([r.render([ClipRequest(key=str(i), prompt=prompt, seed=s0 + 1000 * i, frames=window,
                                                      width=64, height=64)], settings)[0].frames
                                for i in range(-(-frames // window))])[:frames]
        glued_joins = list(range(window, frames, window))
        for name, clip, joins in (("long", long_res.frames, long_joins), ("glued", glued, glued_joins)):
            s = measure(clip, fps=float(info.native_fps))
            spikes = spike_mask(s, QCConfig())
            med = float(np.median(s.ssim))
            ratios = [float(s.ssim[j - 1]) / med for j in joins]
            out[name].append({"prompt": prompt, "cuts": int(spikes.sum()),
                              "cuts_at_joins": int(sum(spikes[j - 1] for j in joins)),
                              "min_join_ratio": round(min(ratios), 3), "mean_join_ratio": round(float(np.mean(ratios)), 3)})
    summary = {}
    for name, rows_ in out.items():
        summary[name] = {"clips": len(rows_), "with_a_cut": sum(x["cuts"] > 0 for x in rows_),
                         "joins_read_as_cuts": sum(x["cuts_at_joins"] for x in rows_),
                         "min_join_ratio": min(x["min_join_ratio"] for x in rows_),
                         "mean_join_ratio": round(float(np.mean([x["mean_join_ratio"] for x in rows_])), 3),
                         "within_10pct": sum(x["min_join_ratio"] >= 0.9 for x in rows_)}
    return {"frames": frames, "window": window, "summary": summary, "clips": out}
