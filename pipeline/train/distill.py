"""Step distillation of the shapes teacher: latent consistency distillation (LCM), as AnimateLCM.

One student serves both render tiers. It learns the teacher's probability-flow ODE as a
consistency function on the 50-step DDIM grid of the 1000-step schedule (``solver_steps``,
LCMScheduler's ``original_inference_steps``): from any grid timestep it predicts the clip the
ODE ends at. LCMScheduler's 6-step (tier ``fast``: 999, 839, 679, 499, 339, 179) and 8-step
(tier ``quality``: 999, 879, ..., 139) schedules are both subsets of that grid, so the renderer
samples the one folder at either step count; the stage evaluates both.

One training step (Luo et al. 2023, "Latent Consistency Models"; AnimateLCM uses the same loss):

1. a training clip's latents ``z0`` are noised to a grid timestep ``t`` (``x_t``);
2. the frozen teacher takes one DDIM step from ``x_t`` to ``s = t - 1000 / solver_steps`` with
   classifier-free guidance ``guidance`` baked in (so the student runs at guidance 1.0, as the
   renderer runs distilled models);
3. the student's consistency output at ``(x_t, t)`` is pulled towards the target network's at
   ``(x_s, s)``; the target network is an EMA of the student (``target_decay``).

The consistency output is ``c_skip(t) x_t + c_out(t) x0(t)``, with ``x0`` from the UNet's
v-prediction and LCMScheduler's boundary scalings (sigma_data 0.5, ``timestep_scaling`` 10), so
that ``LCMScheduler.step`` computes exactly what the student was trained to output.

The student starts from the teacher's EMA weights; the exported folder holds the target network
with an LCMScheduler config (the renderer then picks sampler ``lcm``).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...qc import adherence
from .. import noise as video_noise
from .. import frame_markers, shapes
from ..choices import TIERS
from ..sampler import make_scheduler, sample
from . import nets
from .data import Clean, PoolData, ShapesData
from .stages import (DenoiserConfig, Device, Log, Probe, StageConfig, StageResult, TextCache, _done, _mark_done, _Meter,
                     decode_latents, export_pipeline, latent_pool, read_done, resume, save_checkpoint, shape_weight,
                     uncond_rows)

STAGE = "student"
TIER_STEPS = tuple(tier.steps for tier in TIERS.values())  # fast, quality


@dataclass(frozen=True)
class LCMConfig:
    """The consistency distillation's own hyper-parameters (the schedule is a ``StageConfig``).

    - ``solver_steps``: the DDIM grid the consistency is learnt on (skip ``1000 // solver_steps``).
    - ``guidance``: the teacher's classifier-free guidance baked into the student, ``u + g (c - u)``.
    - ``target_decay``: EMA decay of the target network (LCM: 0.95).
    - ``huber_c``: pseudo-Huber constant per latent element; 0 gives the plain L2 loss.
    - ``timestep_scaling``: LCMScheduler's, in the boundary scalings ``c_skip`` and ``c_out``.
    - ``temporal``: the weight of a term that holds the student's frame-to-frame changes of the
      background to the clean clip's (:func:`temporal_match`); 0 turns it off.
    - ``grid_tilt``: how much more often the high-noise grid points are trained
      (:func:`grid_indices`: index i drawn with probability proportional to ``(i + 1) ** grid_tilt``);
      0 draws them uniformly, as LCM does. The clip's layout and its motion are drawn at the
      highest grid points, whose consistency targets are reached last.
    - ``renoise_shared``: not a training setting but how the exported student is sampled: the
      share common to all frames of the noise LCM draws between steps (the folder's
      clipmill.json ``"renoise_shared"``, ``ModelInfo.renoise``); None: the training prior
      (``DenoiserConfig.noise_shared``).
    """

    solver_steps: int = 50
    guidance: float = 3.0
    target_decay: float = 0.95
    huber_c: float = 0.001
    timestep_scaling: float = 10.0
    temporal: float = 0.0
    grid_tilt: float = 0.0
    renoise_shared: float | None = None

    def __post_init__(self):
        if not 8 <= self.solver_steps <= 1000 or 1000 % self.solver_steps:
            raise ValueError(f"LCMConfig.solver_steps={self.solver_steps}: must divide 1000 and lie in 8..1000 "
                             f"(the 8-step tier's schedule is a subset of it)")
        if not 1.0 <= self.guidance <= 12.0:
            raise ValueError(f"LCMConfig.guidance={self.guidance}: allowed 1.0 to 12.0")
        if not 0.0 <= self.target_decay < 1.0:
            raise ValueError(f"LCMConfig.target_decay={self.target_decay}: allowed 0 <= decay < 1")
        if self.huber_c < 0:
            raise ValueError(f"LCMConfig.huber_c={self.huber_c}: must be >= 0")
        if self.temporal < 0:
            raise ValueError(f"LCMConfig.temporal={self.temporal}: must be >= 0")
        if self.renoise_shared is not None:
            video_noise.check_shared(self.renoise_shared, "LCMConfig.renoise_shared")
        if not 0.0 <= self.grid_tilt <= 4.0:
            raise ValueError(f"LCMConfig.grid_tilt={self.grid_tilt}: allowed 0 to 4 (the exponent of the grid "
                             "index's sampling weight; at 50 grid points 4 trains the top one 50^4, about 6 million, "
                             "times as often as the lowest)")


def lcm_scheduler(teacher_config, lcm: LCMConfig):
    """The student's LCMScheduler: the teacher's betas and prediction type, LCM's grid."""
    from diffusers import LCMScheduler

    return LCMScheduler.from_config(teacher_config, original_inference_steps=lcm.solver_steps,
                                    timestep_scaling=lcm.timestep_scaling, beta_schedule="linear",
                                    clip_sample=False, set_alpha_to_one=True)


def boundary_scalings(t: torch.Tensor, timestep_scaling: float, sigma_data: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """LCMScheduler's ``c_skip`` and ``c_out`` for integer timesteps ``t`` (1 and 0 at t = 0)."""
    scaled = t.double() * timestep_scaling
    c_skip = sigma_data**2 / (scaled**2 + sigma_data**2)
    c_out = scaled / (scaled**2 + sigma_data**2).sqrt()
    return c_skip.float(), c_out.float()


def _bcast(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1, 1)


def _x0_eps(v: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean latents and noise from a v-prediction at ``x`` with alpha-bar ``a`` (broadcast)."""
    sa, sb = a.sqrt(), (1 - a).sqrt()
    return sa * x - sb * v, sa * v + sb * x


def grid_indices(b: int, lcm: LCMConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """``b`` grid indices (0 .. solver_steps-1) to train on: uniform, or tilted towards the high
    noise by ``lcm.grid_tilt`` (index i with probability proportional to ``(i + 1) ** grid_tilt``);
    torch's global generator unless ``generator`` is given."""
    if not lcm.grid_tilt:
        return torch.randint(0, lcm.solver_steps, (b,), generator=generator)
    w = torch.arange(1, lcm.solver_steps + 1, dtype=torch.float64) ** lcm.grid_tilt
    return torch.multinomial(w, b, replacement=True, generator=generator)


def grid_timesteps(idx: torch.Tensor, lcm: LCMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid index (0 .. solver_steps-1) to the timestep ``t`` on the grid (k-1, 2k-1, ..., 999) and
    the solver's next one ``s = t - k`` (0 below the first)."""
    k = 1000 // lcm.solver_steps
    t = (idx + 1) * k - 1
    return t, (t - k).clamp(min=0)


def consistency_loss(student, teacher, target, z0: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor,
                     acp: torch.Tensor, lcm: LCMConfig, idx: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None, cells: torch.Tensor | None = None,
                     noise_shared: float = 0.0, background: torch.Tensor | None = None) -> torch.Tensor:
    """One LCM distillation loss on clean latents ``z0`` (B, C, T, h, w).

    ``cond`` (B, tokens, dim) and ``uncond`` (1, tokens, dim) are text states (not yet repeated
    per frame), or per frame for a model with frame markers (``TextCache.frames``; ``uncond`` as
    ``stages.uncond_rows`` takes it). ``idx`` (grid indices, :func:`grid_indices`) and ``noise``
    are drawn from torch's global generator unless given (the probe gives fixed ones). ``cells``
    (B, 1, T, h, w) weights the loss per latent cell (``stages.shape_weight``), as in the
    teacher's loss. ``noise_shared`` is the teacher's noise prior (``pipeline.noise``), which the
    student inherits. With ``lcm.temporal``, ``background`` (B, 1, T, h, w; 1 where the shape is
    not) is where :func:`temporal_match` holds the frame-to-frame changes to the clip's.
    """
    b, frames = len(z0), z0.shape[2]
    if idx is None:
        idx = grid_indices(b, lcm)
    idx = idx.to(z0.device)  # the UNets take their timesteps on the latents' device
    if noise is None:
        noise = video_noise.like(z0, noise_shared)
    t, s = grid_timesteps(idx, lcm)
    a_t, a_s = _bcast(acp[t]), _bcast(acp[s])
    x_t = a_t.sqrt() * z0 + (1 - a_t).sqrt() * noise
    ehs_c = frame_markers.per_frame(cond, b, frames)
    cs_s, co_s = boundary_scalings(s, lcm.timestep_scaling)

    pred = consistency_output(student, x_t, t, ehs_c, acp, lcm)
    with torch.no_grad():
        x_s = guided_ddim_step(teacher, x_t, t, s, cond, uncond, acp, lcm.guidance)
        x0_target, _ = _x0_eps(target(x_s, s, encoder_hidden_states=ehs_c).sample, x_s, a_s)
        tgt = _bcast(cs_s) * x_s + _bcast(co_s) * x0_target
    err = (pred - tgt) ** 2 if lcm.huber_c == 0 else ((pred - tgt) ** 2 + lcm.huber_c**2).sqrt().sub(lcm.huber_c)
    loss = (err if cells is None else err * cells).mean()
    if lcm.temporal and background is not None:
        loss = loss + lcm.temporal * temporal_match(pred, z0, a_t, background)
    return loss


def temporal_match(pred: torch.Tensor, z0: torch.Tensor, a_t: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """The MSE between the frame-to-frame changes of the consistency output ``pred`` and those
    of the clean clip ``z0`` (B, C, T, h, w), over the cells that are ``background`` in both
    frames, weighted by each clip's ``alpha_bar(t)`` (``a_t``): near the data the ODE's end is
    the clip itself, so a texture that re-rolls from frame to frame (boiling) is an error
    there; at high noise the end is another clip and the term fades out."""
    dp = pred[:, :, 1:] - pred[:, :, :-1]
    dz = z0[:, :, 1:] - z0[:, :, :-1]
    both = background[:, :, 1:] * background[:, :, :-1]
    return (a_t * both * (dp - dz) ** 2).sum() / (both.sum() * pred.shape[1]).clamp(min=1.0)


def consistency_output(unet, x_t: torch.Tensor, t: torch.Tensor, ehs: torch.Tensor, acp: torch.Tensor,
                       lcm: LCMConfig) -> torch.Tensor:
    """``c_skip(t) x_t + c_out(t) x0``: what LCMScheduler.step takes as the clean clip."""
    a_t = _bcast(acp[t])
    x0, _ = _x0_eps(unet(x_t, t, encoder_hidden_states=ehs).sample, x_t, a_t)
    c_skip, c_out = boundary_scalings(t, lcm.timestep_scaling)
    return _bcast(c_skip) * x_t + _bcast(c_out) * x0


def guided_ddim_step(teacher, x_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor, cond: torch.Tensor,
                     uncond: torch.Tensor, acp: torch.Tensor, guidance: float) -> torch.Tensor:
    """One DDIM (eta 0) step of the teacher with classifier-free guidance, from ``t`` to ``s``."""
    b, frames = len(x_t), x_t.shape[2]
    a_t, a_s = _bcast(acp[t]), _bcast(acp[s])
    ehs = torch.cat([frame_markers.per_frame(cond, b, frames), uncond_rows(uncond, b, frames)])
    v_c, v_u = teacher(torch.cat([x_t, x_t]), torch.cat([t, t]), encoder_hidden_states=ehs).sample.chunk(2)
    x0_c, eps_c = _x0_eps(v_c, x_t, a_t)
    x0_u, eps_u = _x0_eps(v_u, x_t, a_t)
    x0 = x0_u + guidance * (x0_c - x0_u)
    eps = eps_u + guidance * (eps_c - eps_u)
    return a_s.sqrt() * x0 + (1 - a_s).sqrt() * eps


def teacher_endpoints(teacher, probe: Probe, uncond: torch.Tensor, acp: torch.Tensor, lcm: LCMConfig
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's noisy latents ``x_t`` (grid indices ``probe.t``) and where the guided teacher's
    DDIM solver on the grid takes each of them at timestep 0: what the student should output."""
    t, _ = grid_timesteps(probe.t, lcm)
    a_t = _bcast(acp[t])
    x_t = a_t.sqrt() * probe.z0 + (1 - a_t).sqrt() * probe.noise
    x = x_t.clone()
    with torch.no_grad():  # all clips in one batch; each joins the solver at its own grid index
        for i in range(int(probe.t.max()), -1, -1):
            on = probe.t >= i
            ti, si = grid_timesteps(torch.full((int(on.sum()),), i, device=x.device), lcm)
            x[on] = guided_ddim_step(teacher, x[on], ti, si, probe.cond[on], uncond, acp, lcm.guidance)
    return x_t, x


def sample_student(unet, scheduler_config, cond: torch.Tensor, steps: int, seeds: list[int],
                   frames: int = shapes.FRAMES, noise_shared: float = 0.0) -> torch.Tensor:
    """Scaled latents (B, C, T, h, w) sampled as the renderer samples an LCM model: the project's
    sampler loop with sampler ``lcm``, guidance 1.0, one generator per clip, the model's noise
    prior ``noise_shared``."""
    scheduler = make_scheduler(scheduler_config, "lcm")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    shape = (1, nets.LATENT_CHANNELS, frames, nets.LATENT_SIDE, nets.LATENT_SIDE)
    x = torch.cat([video_noise.video_noise(shape, noise_shared, g) for g in gens]).to(cond.device) * scheduler.init_noise_sigma
    ehs = frame_markers.per_frame(cond, len(seeds), frames)
    with torch.no_grad():
        return sample(lambda xi, t: unet(xi, t, encoder_hidden_states=ehs).sample, x, scheduler, steps, gens,
                      noise_shared=noise_shared)


def eval_student(unet, vae, text: TextCache, scheduler_config, clean: Clean, n: int = 16, seed: int = 4242,
                 noise_shared: float = 0.0) -> dict:
    """Adherence at both tiers' step counts on ``n`` train-split and ``n`` held-out prompts."""
    out: dict = {}
    for split in ("train", "heldout"):
        b = ShapesData(clean, seed, split).batch(n, render=False)  # type: ignore[arg-type]
        for steps in TIER_STEPS:
            z = sample_student(unet, scheduler_config, text.frames(b.captions, shapes.FRAMES), steps, [seed + i for i in range(n)],
                               noise_shared=noise_shared)
            adh = adherence.adherence([adherence.analyze(c) for c in decode_latents(vae, z)], b.specs)
            out[f"{split}@{steps}"] = {k: round(v, 3) for k, v in adh.items()}
    return out


def train_student(root: Path, cfg: StageConfig, clean: Clean, log: Log, lcm: LCMConfig = LCMConfig(),
                  net: DenoiserConfig = DenoiserConfig(), device: Device = "cpu") -> StageResult:
    """Distil ``root/teacher/pipeline`` into ``root/student/pipeline`` (an LCM AnimateDiff folder).

    Resumable like the other stages (``root/student/state.pt``). The probe loss is the
    distillation error: the MSE between the student's one-step clean clip and the guided
    teacher's full DDIM solution, from fixed noisy clips at grid points spread over the schedule
    (the teacher's solutions are computed once per run).
    """
    from diffusers import AnimateDiffPipeline

    if _done(root, STAGE):
        log(f"[{STAGE}] done already: {root / STAGE / 'pipeline'}")
        return StageResult()
    if not _done(root, "teacher"):
        raise FileNotFoundError(f"[{STAGE}] {root / 'teacher' / 'done'} is missing: the student distils the finished "
                                "teacher, so run the teacher stage first")
    torch.manual_seed(cfg.seed)
    teacher_pipe = AnimateDiffPipeline.from_pretrained(root / "teacher" / "pipeline", dtype=torch.float32).to(device)
    vae = teacher_pipe.vae.eval().requires_grad_(False)
    te, tok = teacher_pipe.text_encoder.eval().requires_grad_(False), teacher_pipe.tokenizer
    teacher = teacher_pipe.unet.eval().requires_grad_(False)
    if teacher_pipe.scheduler.config.prediction_type != "v_prediction":
        raise ValueError(f"[{STAGE}] teacher prediction_type={teacher_pipe.scheduler.config.prediction_type!r}; "
                         "the distillation reads v-predictions ('v_prediction')")
    scheduler = lcm_scheduler(teacher_pipe.scheduler.config, lcm)
    acp = scheduler.alphas_cumprod.float().to(device)
    # the teacher's frame markers (their embeddings are in its text encoder), which the student keeps
    markers = tuple((read_done(root, "teacher") or {}).get("frame_markers") or ())
    text = TextCache(te, tok, markers)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    target = copy.deepcopy(teacher)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = PoolData(clean, cfg.seed, latent_pool(root, vae, net.pool_clips, cfg.seed, log, net.tilt))  # the teacher's pool
    parts = {"model": student, "target": target, "opt": opt}
    step = resume(root / STAGE / "state.pt", parts, data, log, STAGE)
    log(f"[{STAGE}] LCM distillation of the teacher ({nets.count(student) / 1e6:.2f} M params), batch {cfg.batch} "
        f"clips, {asdict(lcm)}")
    uncond = text([""])
    probe = Probe.make(vae, text, clean, seed=cfg.seed + 77, t_max=lcm.solver_steps,  # t: grid indices
                       noise_shared=net.noise_shared)
    probe_x, probe_end = teacher_endpoints(teacher, probe, uncond, acp, lcm)
    probe_ehs = probe.cond.repeat_interleave(probe.z0.shape[2], dim=0)
    result = StageResult()

    def run_probe() -> None:
        with torch.no_grad():
            out = consistency_output(student, probe_x, grid_timesteps(probe.t, lcm)[0], probe_ehs, acp, lcm)
            result.probe[step] = ((out - probe_end) ** 2).mean().item()
        log(f"[{STAGE}] step {step} probe: distillation error (MSE to the teacher's DDIM {lcm.solver_steps}) "
            f"{result.probe[step]:.5f}")

    run_probe()
    meter = _Meter(log, STAGE, cfg.steps, cfg.log_every)
    losses = result.losses
    while step < cfg.steps:
        step += 1
        z0, mask, captions, _ = data.latents(cfg.batch, net.reverse)
        z0, mask = z0.to(device), mask.to(device)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, step / 100)
        if markers:  # per-frame prompts, markers_drop of the clips plain, as the teacher learnt them
            on = [bool(data.rng.random() >= net.markers_drop) for _ in captions]
            cond, unc = text.frames(captions, z0.shape[2], on), text.frames([""] * len(captions), z0.shape[2], on)
        else:
            cond, unc = text(captions), uncond
        loss = consistency_loss(student, teacher, target, z0, cond, unc, acp, lcm,
                                cells=shape_weight(mask, net.shape_gain), noise_shared=net.noise_shared,
                                background=(mask[:, None] <= 0).to(z0.dtype))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pt, p in zip(target.parameters(), student.parameters()):
                pt.lerp_(p, 1 - lcm.target_decay)
        losses.append(loss.item())
        meter.add(step, loss=loss.item())
        if step % cfg.log_every == 0 or step == cfg.steps:
            run_probe()
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(root / STAGE / "state.pt", parts, data, step)
        if cfg.eval_due(step):
            t0 = time.time()
            res = eval_student(target, vae, text, scheduler.config, clean, noise_shared=net.noise_shared)
            log(f"[{STAGE}] eval step {step} (target net, LCM {'/'.join(map(str, TIER_STEPS))} steps, guidance 1; "
                f"{time.time() - t0:.0f}s): {json.dumps(res)}")
    export_pipeline(root / STAGE / "pipeline", target, vae, te, tok, scheduler)
    _mark_done(root, STAGE, {"step": step, "lcm": asdict(lcm), **({"frame_markers": list(markers)} if markers else {})})
    log(f"[{STAGE}] saved {root / STAGE / 'pipeline'}")
    return result
