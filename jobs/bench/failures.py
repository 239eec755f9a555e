"""``clipmill bench --failures``: QC's catch rate on a real model's real failures.

The same shapes-world prompts and seeds are rendered well (the ``fast`` tier as a batch renders
it) and broken in the ways a real video diffusion model breaks:

- ``steps-1`` / ``steps-2``: too few sampling steps;
- ``guidance-12`` / ``guidance-16``: classifier-free guidance far above what a distilled model
  takes (blow-out);
- ``feature-cache-6``: DeepCache with a full step only every 6 steps (one full step in 6);
- ``nan-mid-denoise``: the denoiser's output turns NaN from the middle step on, as an fp16
  overflow does, for the whole group (each group from its own middle step);
- ``wrong-vae-scaling``: latents decoded with Stable Diffusion's scaling factor 0.18215 instead
  of the model's own (or, where the two are close, not unscaled at all): the VAE's config says
  so for the kind's renders, as a config or VAE swapped in from another model would.

Each clip then goes through the post stage's own code (interpolation, H.264, decode, QC at the
given thresholds, and the render check of the decode where the model states its limits). A
kind's ``caught`` is the share the post stage rejects; for the good renders, ``passed`` is the
share it lets through. Beside them, what shows whether a kind is visibly broken at all:
the analyzer's adherence and the PSNR against the good render of the same prompt and seed.

Every fault is a removable torch hook, a config value put back, or a render setting: nothing
stays on the model after a kind is done.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from clipmill.jobs.bench.ladder import psnr, world_requests
from clipmill.jobs.runner.checks import clip_decode_check, with_render_check
from clipmill.jobs.runner.stages import convert_and_check
from clipmill.pipeline import shapes
from clipmill.pipeline.deepcache import DeepCacheConfig
from clipmill.pipeline.models import ModelInfo
from clipmill.pipeline.render import ClipResult, GroupSettings, Renderer, RenderOptions
from clipmill.qc import QCConfig
from clipmill.qc import adherence as adh

SD_SCALING = 0.18215


@dataclass(frozen=True)
class Kind:
    """One way of rendering: ``settings`` and ``options`` for the renderer, and ``fault`` the
    name of a hook installed for its renders (``nan`` or ``vae-scaling``), if any."""

    name: str
    what: str
    settings: GroupSettings
    options: RenderOptions = field(default_factory=RenderOptions)
    fault: str | None = None


def kinds(info: ModelInfo) -> list[Kind]:
    fast = GroupSettings(tier="fast", sampler=info.scheduler)
    cfg = dict(guidance_mode="cfg")
    return [
        Kind("good", "the fast tier, as a batch renders it", fast),
        Kind("steps-1", "1 sampling step", GroupSettings(tier="fast", sampler=info.scheduler, step_count=1)),
        Kind("steps-2", "2 sampling steps", GroupSettings(tier="fast", sampler=info.scheduler, step_count=2)),
        Kind("guidance-12", "CFG 12 on the distilled model", GroupSettings(tier="fast", sampler=info.scheduler,
                                                                           guidance=12.0, **cfg)),
        Kind("guidance-16", "CFG 16 on the distilled model", GroupSettings(tier="fast", sampler=info.scheduler,
                                                                           guidance=16.0, **cfg)),
        Kind("feature-cache-6", "feature cache with a full step every 6 steps", fast,
             RenderOptions(feature_cache=True, deepcache=DeepCacheConfig(interval=6))),
        Kind("nan-mid-denoise", "the denoiser's output NaN from the middle step on", fast, fault="nan"),
        Kind("wrong-vae-scaling", "latents decoded with the wrong scaling factor", fast, fault="vae-scaling"),
    ]


@contextlib.contextmanager
def fault(renderer: Renderer, name: str | None, steps: int):
    """Install the fault ``name`` on ``renderer``'s model for the block; removed on exit."""
    if name is None:
        yield {}
        return
    handles, restore, info = [], [], {}
    if name == "nan":
        calls = {"n": 0}
        start = steps // 2  # the step from which the output is NaN (0-based)

        def to_nan(module, args, output):  # conv_out runs once per denoiser call: once per step
            calls["n"] += 1
            return output * float("nan") if calls["n"] > start else output

        handles.append(renderer.pipe.unet.conv_out.register_forward_hook(to_nan))
        info["nan_from_step"] = start + 1
    elif name == "vae-scaling":  # the VAE's config states another factor, as a swapped-in config or VAE would
        vae = renderer.pipe.vae
        own = float(vae.config.scaling_factor)
        wrong = SD_SCALING if abs(math.log(own / SD_SCALING)) > math.log(2) else 1.0
        info.update(model_scaling_factor=own, decoded_with=wrong, decoded_at=own / wrong)
        vae.register_to_config(scaling_factor=wrong)
        restore.append(lambda: vae.register_to_config(scaling_factor=own))
    else:
        raise ValueError(f"fault {name!r} is not known; allowed: nan, vae-scaling")
    try:
        yield info
    finally:
        for h in handles:
            h.remove()
        for undo in restore:
            undo()
        if name == "nan":
            info["denoiser_calls"] = calls["n"]


def reason_kind(reason: str) -> str:
    """The first word of a QC reason ("boiling", "flat", "flicker", ...): what the tables count."""
    return reason.split(":")[0].split(" ")[0]


def clips_by_kind(verdicts) -> dict[str, int]:
    """How many of the verdicts have a reason of each kind (a clip counts once per kind, however
    many reasons of it it has), most first."""
    counts: dict[str, int] = {}
    for v in verdicts:
        for kind in dict.fromkeys(reason_kind(r) for r in v.reasons):
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def post(result: ClipResult, fps_out: int, qc: QCConfig, info: ModelInfo | None = None):
    """The post stage's verdict on a rendered clip: QC of its H.264, and the render check of its
    decode (``jobs.runner.checks``) against ``info``'s limits when the model states them."""
    fd, tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-failures-")
    os.close(fd)
    try:
        decoded, verdict, _, _ = convert_and_check(result.frames, result.fps, fps_out, tmp, qc)
    finally:
        os.unlink(tmp)
    return decoded, verdict if info is None else with_render_check(verdict, clip_decode_check(result, info))


def failures(info: ModelInfo, clips: int = 40, size: tuple[int, int] | None = None, frames: int | None = None,
             fps_out: int = 30, device: str = "cpu", qc: QCConfig = QCConfig(), group: int = 4, seed: int = 2,
             progress=None) -> dict:
    """Render ``clips`` shapes-world prompts in every :func:`kinds` way and QC each clip."""
    if info.family != "animatediff":
        raise ValueError(f"bench --failures: the faults hook an AnimateDiff UNet and VAE; {info.name!r} is {info.family}")
    size = size or info.default_size
    frames = frames or info.default_frames
    reqs = world_requests(size, frames, clips, seed=seed)
    specs = [shapes.parse(r.prompt) for r in reqs]
    renderer = Renderer(info, device=device)
    t0 = time.perf_counter()
    rows, good = [], None
    try:
        for kind in kinds(info):
            if progress:
                progress(f"{kind.name}: {kind.what}, {clips} clips")
            renderer.configure(kind.options)
            results, detail = [], {}
            for i in range(0, len(reqs), group):  # each group gets the fault afresh (NaN from its own middle step)
                with fault(renderer, kind.fault, kind.settings.steps) as detail:
                    results += renderer.render(reqs[i:i + group], kind.settings)
            checked = [post(r, fps_out, qc, info) for r in results]
            rejected = [v.verdict != "pass" for _, v in checked]
            reasons = clips_by_kind(v for _, v in checked)
            a = [adh.analyze(d) for d, _ in checked]
            row = {
                "kind": kind.name, "what": kind.what, "steps": kind.settings.steps, "guidance": kind.settings.guidance,
                "clips": len(results), "rejected": sum(rejected), "reject_rate": round(sum(rejected) / len(results), 4),
                "reasons": reasons,
                "adherence": {k: round(v, 4) for k, v in adh.adherence(a, specs).items()},
                "psnr_vs_good_db": None if good is None else psnr(results, good),
                "detail": detail,
            }
            if kind.name == "good":
                good = results
            rows.append(row)
    finally:
        renderer.close()
    return {"model": info.name, "clips": clips, "size": list(size), "frames": frames, "fps_out": fps_out,
            "qc": asdict(qc), "kinds": rows,
            "seconds": round(time.perf_counter() - t0, 1)}
