"""``clipmill bench``: the speed ladder, every row measured side by side in one run.

Rows (one model, size and frame count):

0. baseline: DDIM, 50 steps, CFG 7.5, no cache, batch 1
1. 8 steps (the model's distilled sampler, at the ladder's guidance)
2. 6 steps
3. + text K/V cache (and the prompt-embedding LRU)
4. + feature cache (DeepCache on a UNet, FirstBlockCache on a DiT)
5. + R-CFG (self-negative) where guidance is on
6. + batch 4
7. + compile (torch.compile, GPU only)

Each row: seconds per clip for rendering and end to end (render + 24->30 fps interpolation +
H.264 + decode + QC), speed-up over row 0, PSNR of decoded frames against its uncached twin
(the row before it, which differs only by the layer it adds), peak memory, the work done and
skipped (denoiser evaluations per clip, K/V projections, blocks), and on a GPU the model FLOP
utilisation. A guidance section compares CFG, R-CFG (both variants) and guidance off at the
same seed and guidance scale, and a decoder section the VAE against the tiny autoencoder.

Quality columns, on prompts of the shapes world (the default for a model whose clipmill.json
says ``"world": "shapes"``, or ``--prompts shapes``): every row renders the same
``quality_clips`` prompts and seeds, half of them from the held-out (colour, motion, camera)
combinations, half in Chinese; the world's analyzer reads each clip. Per row: adherence per
attribute; distribution distances to row 0 on the same prompts (per attribute, the total
variation distance between the words read; the Fréchet distance on the analyzer's
measurements), since a distilled student is not pixel-aligned with its teacher; and PSNR against
the twin row on those clips. When the model folder names its undistilled ``teacher``, row 0 is
that teacher at 50 DDIM steps and its own guidance.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from clipmill.jobs.core.cleaning import split_free_prompt
from clipmill.jobs.runner.stages import convert_and_check
from clipmill.pipeline import shapes
from clipmill.pipeline.deepcache import DeepCacheConfig
from clipmill.pipeline.guidance import RCFG_MAX_GUIDANCE
from clipmill.pipeline.models import ModelInfo, model_info
from clipmill.pipeline.render import ClipRequest, ClipResult, GroupSettings, Renderer, RenderOptions
from clipmill.qc import QCConfig
from clipmill.qc import adherence as adh

PROMPTS = (
    "a bowl of beef noodle soup on a wooden table, steam rising, slow dolly in",
    "iced coffee poured over a glass of ice in a bright cafe, close-up, static shot",
    "a burger with melting cheese on a tray in a diner, orbit shot",
    "fresh sushi rolls on a slate plate in a restaurant, pan left",
)
NEGATIVE = "blurry, low quality, watermark, text"
# dense fp16/bf16 tensor-core peaks; matched in this order against the device name
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
               ("L40", 181.0), ("L4", 121.0), ("A10", 125.0))


@dataclass
class Row:
    row: str
    name: str
    settings: GroupSettings
    options: RenderOptions
    batch: int = 1
    clips: int = 4
    twin: str | None = None  # the row this one adds one layer to
    note: str = ""
    teacher: bool = False  # rendered with the model's undistilled teacher
    results: list[ClipResult] = field(default_factory=list, repr=False)
    quality: list[ClipResult] = field(default_factory=list, repr=False)  # the quality prompts' clips
    out: dict = field(default_factory=dict)


class PeakMemory:
    """Peak resident memory above the start (CPU: sampled from /proc), or CUDA peak allocated."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = _rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.base) / 2**20  # above the weights and caches
            return
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.mib = (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def psnr(a: list[ClipResult], b: list[ClipResult]) -> float | None:
    """PSNR (dB) of decoded frames; None when identical (infinite)."""
    x = np.stack([r.frames for r in a]).astype(np.float64)
    y = np.stack([r.frames for r in b[: len(a)]]).astype(np.float64)
    mse = float(((x - y) ** 2).mean())
    return None if mse == 0 else round(10 * math.log10(255.0**2 / mse), 2)


def post_seconds(frames: np.ndarray, fps_in: int, fps_out: int = 30) -> float:
    """What the post stage spends on one clip: interpolation, H.264, decode, QC (the stage's own code)."""
    fd, tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-bench-")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        convert_and_check(frames, fps_in, fps_out, tmp, QCConfig())
        return time.perf_counter() - t0
    finally:
        os.unlink(tmp)


def ladder(info: ModelInfo, size: tuple[int, int], frames: int, guidance: float, compile_how: str) -> list[Row]:
    sampler = info.scheduler
    wan = info.family == "wan"
    plain = RenderOptions(text_kv=False, prompt_cache=0, feature_cache=False)
    kv = replace(plain, text_kv=True, prompt_cache=256)
    fc = replace(kv, feature_cache=True, deepcache=DeepCacheConfig())  # interval 2, finest branch
    base_guidance = 5.0 if wan else 7.5
    s8 = GroupSettings(tier="quality", sampler=sampler, guidance=guidance, guidance_mode="cfg")
    s6 = replace(s8, tier="fast")
    rcfg_on = 1.0 < guidance < RCFG_MAX_GUIDANCE and not wan
    s6r = replace(s6, guidance_mode="rcfg-self") if rcfg_on else s6
    if info.teacher is not None:
        row0 = Row("0", f"baseline: the undistilled teacher, DDIM 50 steps, CFG {info.teacher_guidance:g}, no cache, "
                        "batch 1", GroupSettings(tier="quality", sampler="ddim", guidance=info.teacher_guidance,
                                                 step_count=50), plain, clips=1, teacher=True)
    else:
        row0 = Row("0", f"baseline: {'flow Euler' if wan else 'DDIM'} 50 steps, CFG {base_guidance}, no cache, batch 1",
                   GroupSettings(tier="quality", sampler="flow" if wan else "ddim", guidance=base_guidance,
                                 step_count=50), plain, clips=1)
    rows = [
        row0,
        Row("1", f"8 steps ({sampler}, guidance {guidance:g})", s8, plain),
        Row("2", "6 steps", s6, plain),
        Row("3", "+ text K/V cache", s6, kv, twin="2"),
        Row("4", "+ feature cache", s6, fc, twin="3"),
        Row("5", "+ R-CFG (self-negative)", s6r, fc, twin="4",
            note="" if rcfg_on else ("guidance is off (1.0): no negative pass to replace; same work as row 4"
                                     if guidance <= 1.0 else "R-CFG is for epsilon models; Wan runs CFG" if wan
                                     else f"R-CFG diverges at guidance {RCFG_MAX_GUIDANCE:g} and above; CFG as row 4")),
        Row("6", "+ batch 4", s6r, fc, batch=4, twin="5"),
        Row("7", f"+ compile ({compile_how})", s6r, replace(fc, compile=compile_how), batch=4, twin="6"),
    ]
    return rows


def requests(info: ModelInfo, size, frames, n) -> list[ClipRequest]:
    return [ClipRequest(i, PROMPTS[i % len(PROMPTS)], 1000 + i, frames, size[0], size[1], NEGATIVE) for i in range(n)]


def world_specs(n: int, seed: int = 0) -> list[tuple[shapes.Spec, str]]:
    """``n`` (spec, language) pairs of the shapes world, drawn from ``seed``: even ones from the
    held-out (colour, motion, camera) combinations, odd ones from the training split; every
    other pair of them in Chinese."""
    rng = np.random.default_rng([seed, 0xBE7C])
    splits = {"heldout": shapes.split_specs("heldout"), "train": shapes.split_specs("train")}
    out = []
    for i in range(n):
        pool = splits["heldout" if i % 2 == 0 else "train"]
        out.append((pool[int(rng.integers(len(pool)))], "zh" if (i // 2) % 2 else "en"))
    return out


def world_requests(size, frames, n: int, seed: int = 0) -> list[ClipRequest]:
    """Shapes-world prompts, cleaned as ``clipmill run`` cleans a prompt column, seeds 1000 + i."""
    return [ClipRequest(i, split_free_prompt(shapes.caption(spec, lang)).canonical(), 1000 + i, frames, size[0],
                        size[1], "") for i, (spec, lang) in enumerate(world_specs(n, seed))]


def run_rows(renderers: dict[bool, Renderer], rows: list[Row], reqs: list[ClipRequest], device: str,
             repeat: int = 3, progress=None) -> None:
    """Render every row ``repeat`` times, the rows interleaved (so a noisy neighbour slows them
    alike), after one warm-up group each; fill ``row.out``. A row's time is its fastest run:
    interference from other processes only ever adds time (all runs are reported too)."""
    walls: dict[str, list[float]] = {r.row: [] for r in rows}
    mems: dict[str, float] = {r.row: 0.0 for r in rows}
    for rep in range(repeat):
        for row in rows:
            if progress:
                progress(f"round {rep + 1}/{repeat}, row {row.row}: {row.name}")
            renderer = renderers[row.teacher]
            renderer.configure(row.options)
            if row.options.compile != "none" and renderer.compiled is None:
                row.note = renderer.compile_message
            todo = reqs[: row.clips]
            if rep == 0 or row.options.compile != "none":
                # warm-up at the row's batch size: allocations, lazy imports, compiled graphs
                renderer.render(todo[: row.batch], row.settings)
            if row.options.prompt_cache:  # a fresh LRU: the row pays for its own text encoding
                renderer.prompts.clear()
            results: list[ClipResult] = []
            # the DiT block counters are on the model for this row's renders only: removed when
            # the row ends, also when it fails
            with renderer.counting(), PeakMemory(device) as mem:
                t0 = time.perf_counter()
                for i in range(0, len(todo), row.batch):
                    results += renderer.render(todo[i : i + row.batch], row.settings)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                walls[row.row].append((time.perf_counter() - t0) / len(results))
            mems[row.row] = max(mems[row.row], mem.mib)
            if rep == 0:
                row.results = results
    for row in rows:
        results = row.results
        post = [post_seconds(r.frames, r.fps) for r in results]
        n = len(results)
        stats = results[-1].stats
        group = results[-1].timings["group_size"]
        render_s = min(walls[row.row])
        row.out = {
            "row": row.row,
            "name": row.name,
            "steps": row.settings.steps,
            "guidance": row.settings.guidance,
            "guidance_mode": stats["guidance_mode"],
            "batch": row.batch,
            "clips": n,
            "render_s_per_clip": round(render_s, 4),
            "render_s_runs": [round(w, 4) for w in walls[row.row]],
            "end_to_end_s_per_clip": round(render_s + sum(post) / n, 4),
            "text_s": round(sum(r.timings["text_s"] for r in results) / n, 4),
            "denoise_s": round(sum(r.timings["denoise_s"] for r in results) / n, 4),
            "decode_s": round(sum(r.timings["decode_s"] for r in results) / n, 4),
            "post_s": round(sum(post) / n, 4),
            "peak_memory_mib": round(mems[row.row], 1),
            "denoiser_evaluations_per_clip": stats["denoiser_rows"],
            # K/V rows and blocks per clip; steps per call; the prompt LRU's counts are the row's
            "work": {k: (round(v / group, 2) if k.startswith(("kv_rows", "blocks")) else v)
                     for k, v in stats.items() if k not in ("denoiser_rows", "steps", "guidance_mode")},
            "note": row.note,
        }


def run_quality(renderers: dict[bool, Renderer], rows: list[Row], reqs: list[ClipRequest], progress=None) -> None:
    """Render ``reqs`` (shapes-world prompts) at every row's settings, options and batch size and
    add the quality columns to ``row.out`` (after :func:`run_rows` and :func:`finish`)."""
    specs = [shapes.parse(r.prompt) for r in reqs]
    if None in specs:
        raise ValueError("run_quality: every quality prompt must be in the shapes grammar")
    reads: dict[str, list[adh.Analysis]] = {}
    for row in rows:
        if progress:
            progress(f"quality: row {row.row}, {len(reqs)} clips")
        renderer = renderers[row.teacher]
        renderer.configure(replace(row.options, compile="none") if row.note and row.options.compile != "none"
                           else row.options)
        row.quality = [x for i in range(0, len(reqs), row.batch) for x in renderer.render(reqs[i:i + row.batch], row.settings)]
        reads[row.row] = [adh.analyze(x.frames) for x in row.quality]
    by = {r.row: r for r in rows}
    base = rows[0]
    base_feats = np.stack([adh.features(a) for a in reads[base.row]])
    for row in rows:
        a = reads[row.row]
        q = {"clips": len(a), "heldout_clips": (len(a) + 1) // 2,
             "adherence": {k: round(v, 4) for k, v in adh.adherence(a, specs).items()},
             "adherence_heldout": {k: round(v, 4) for k, v in adh.adherence(a[0::2], specs[0::2]).items()}}
        if row is base:
            q["read_distance_vs_row0"] = q["frechet_vs_row0"] = None
        else:
            q["read_distance_vs_row0"] = adh.read_distance(a, reads[base.row])
            q["frechet_vs_row0"] = round(adh.frechet_distance(np.stack([adh.features(x) for x in a]), base_feats), 4)
        q["psnr_vs_twin_db"] = None if row.twin is None else psnr(row.quality, by[row.twin].quality)
        q["identical_to_twin"] = row.twin is not None and q["psnr_vs_twin_db"] is None
        row.out["quality"] = q


def count_flops(renderers: dict[bool, Renderer], rows: list[Row], reqs: list[ClipRequest]) -> dict[str, float]:
    """FLOPs of one clip's render per row, counted by torch while it runs (caches included, so
    skipped work is not counted). GPU only: the count costs one more render per row."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for row in rows:
        renderer = renderers[row.teacher]
        renderer.configure(replace(row.options, compile="none"))
        todo = reqs[: row.batch]
        with FlopCounterMode(display=False) as counter:
            renderer.render(todo, row.settings)
        out[row.row] = counter.get_total_flops() / len(todo)
    return out


def finish(rows: list[Row], flops: dict[str, float] | None, device: str) -> None:
    """Speed-ups over row 0, PSNR against the twin, the end-to-end shares, MFU on a GPU."""
    by = {r.row: r for r in rows}
    base = rows[0].out
    for r in rows:
        o = r.out
        o["speedup_render"] = round(base["render_s_per_clip"] / o["render_s_per_clip"], 2)
        o["speedup_end_to_end"] = round(base["end_to_end_s_per_clip"] / o["end_to_end_s_per_clip"], 2)
        o["denoise_share_of_end_to_end"] = round(o["denoise_s"] / o["end_to_end_s_per_clip"], 3)
        o["evaluations_skipped_per_clip"] = round(base["denoiser_evaluations_per_clip"] - o["denoiser_evaluations_per_clip"], 2)
        if r.twin is None:
            o["twin"], o["psnr_vs_twin_db"], o["max_abs_diff_vs_twin"] = None, None, None
        else:
            twin = by[r.twin]
            o["twin"] = r.twin
            o["psnr_vs_twin_db"] = psnr(r.results, twin.results)  # None: identical
            o["max_abs_diff_vs_twin"] = int(max(np.abs(a.frames.astype(int) - b.frames.astype(int)).max()
                                                for a, b in zip(r.results, twin.results)))
        o["mfu"] = None
        if flops and device.startswith("cuda"):
            peak = _peak_flops()
            o["gflops_per_clip"] = round(flops[r.row] / 1e9, 1)
            if peak:  # the FLOPs the render really did, over its fastest time, against the device's peak
                o["mfu"] = round(flops[r.row] / o["render_s_per_clip"] / peak, 4)


def _peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    for k, v in PEAK_TFLOPS:
        if k in name:
            return v * 1e12
    return None


def guidance_section(renderer: Renderer, info: ModelInfo, reqs, scale: float) -> list[dict]:
    """CFG, R-CFG self, R-CFG onetime and guidance off at the same seed and ``scale``, 6 steps
    (R-CFG needs a scale below 2)."""
    if info.family == "wan":
        modes = [("cfg", scale), ("cfg", 1.0)]
    else:
        modes = [("cfg", scale), ("rcfg-self", scale), ("rcfg-onetime", scale), ("cfg", 1.0)]
    renderer.configure(RenderOptions())
    out, ref = [], None
    for mode, g in modes:
        s = GroupSettings(tier="fast", sampler=info.scheduler, guidance=g, guidance_mode=mode)
        renderer.render(reqs[:1], s)
        t0 = time.perf_counter()
        res = [x for r in reqs for x in renderer.render([r], s)]
        sec = (time.perf_counter() - t0) / len(reqs)
        ref = ref or res
        out.append({
            "mode": res[0].stats["guidance_mode"], "guidance": g, "render_s_per_clip": round(sec, 4),
            "denoiser_evaluations_per_clip": res[0].stats["denoiser_rows"],
            "psnr_vs_cfg_db": None if res is ref else psnr(res, ref),
        })
    return out


def decoder_section(renderer: Renderer, info: ModelInfo, reqs) -> list[dict]:
    """The VAE against the folder's tiny autoencoder: decode seconds and PSNR between them."""
    if not info.has_tiny_vae:
        return []
    out, ref = [], None
    s = GroupSettings(tier="fast", sampler=info.scheduler)
    for dec in ("vae", "tiny"):
        renderer.configure(RenderOptions(decoder=dec))
        renderer.render(reqs[:1], s)
        res = [x for r in reqs for x in renderer.render([r], s)]
        ref = ref or res
        out.append({"decoder": dec, "decode_s_per_clip": round(sum(r.timings["decode_s"] for r in res) / len(res), 4),
                    "psnr_vs_vae_db": None if res is ref else psnr(res, ref)})
    return out


def bench(info: ModelInfo, size: tuple[int, int], frames: int, guidance: float = 1.0, device: str = "cpu",
          compile_how: str = "torch", clips: int = 4, repeat: int = 3, progress=None, prompts: str = "auto",
          quality_clips: int = 32) -> dict:
    """Run the ladder and the side sections; returns everything as a JSON-ready dict.

    ``prompts``: ``shapes`` (the shapes world's grammar, with the quality columns over
    ``quality_clips`` clips per row), ``ads`` (the ad prompts, no quality columns) or ``auto``
    (``shapes`` for a model of the shapes world)."""
    if msg := info.check_frames(frames) or info.check_size(*size):
        raise ValueError(f"bench: {frames} frames at {size[0]}x{size[1]}: {msg}")
    if prompts not in ("auto", "shapes", "ads"):
        raise ValueError(f"bench: prompts={prompts!r}; allowed: auto, shapes, ads")
    world = prompts == "shapes" or (prompts == "auto" and info.world == "shapes")
    t_start = time.perf_counter()
    renderer = Renderer(info, device=device)
    renderers = {False: renderer, True: renderer}
    try:  # the speed layers' hooks come off the model however the bench ends
        if info.teacher is not None:
            renderers[True] = Renderer(model_info(str(info.teacher)), device=device)
        reqs = world_requests(size, frames, clips) if world else requests(info, size, frames, clips)
        rows = ladder(info, size, frames, guidance, compile_how)
        for r in rows:
            r.clips = min(r.clips, clips)
        run_rows(renderers, rows, reqs, device, repeat, progress)
        flops = count_flops(renderers, rows, reqs) if device.startswith("cuda") else None
        finish(rows, flops, device)
        if world and quality_clips:
            run_quality(renderers, rows, world_requests(size, frames, quality_clips, seed=1), progress)
        if progress:
            progress("guidance modes")
        g = guidance_section(renderer, info, reqs[:2], guidance if 1.0 < guidance < RCFG_MAX_GUIDANCE else 1.5)
        if progress:
            progress("decoders")
        d = decoder_section(renderer, info, reqs[:2])
    finally:
        for r in {id(x): x for x in renderers.values()}.values():
            r.close()
    best = max(rows, key=lambda r: r.out["speedup_render"])
    return {
        "model": info.name,
        "family": info.family,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "size": list(size),
        "frames": frames,
        "repeat": repeat,
        "dtype": str(renderer.dtype).replace("torch.", ""),
        "prompts": "shapes" if world else "ads",
        "teacher": str(info.teacher) if info.teacher is not None else None,
        "quality_clips": quality_clips if world else 0,
        "rows": [r.out for r in rows],
        "best_row": best.row,
        "best_speedup_render": best.out["speedup_render"],
        "best_speedup_end_to_end": max(r.out["speedup_end_to_end"] for r in rows),
        "guidance_modes": g,
        "decoders": d,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
