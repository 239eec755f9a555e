"""The denoising loop for distilled few-step samplers.

``make_scheduler`` is a pure function of the model's scheduler config and the sampler name.
``sample`` is one short loop with a fixed signature and a progress callback; it knows nothing
about prompts, jobs or files. A fresh scheduler is made for every call, so no step state
survives from one group to the next.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from clipmill.pipeline.choices import ALL_SAMPLERS
from clipmill.pipeline.noise import per_clip


def make_scheduler(base_config, sampler: str):
    """A new scheduler for ``sampler`` built on the model's own scheduler config.

    ``lightning``: Euler with trailing timestep spacing and linear betas (AnimateDiff-Lightning).
    ``lcm``: LCMScheduler (AnimateLCM).
    ``flow``: flow-matching Euler with the model's own shift (Wan).
    ``ddim``: DDIM with the model's betas, the undistilled 50-step baseline of ``clipmill bench``.
    """
    from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, LCMScheduler

    if sampler == "lightning":
        return EulerDiscreteScheduler.from_config(
            base_config, timestep_spacing="trailing", beta_schedule="linear"
        )
    if sampler == "lcm":
        return LCMScheduler.from_config(base_config, beta_schedule="linear")
    if sampler == "flow":
        return FlowMatchEulerDiscreteScheduler.from_config(base_config)
    if sampler == "ddim":
        return DDIMScheduler.from_config(base_config, beta_schedule="linear", timestep_spacing="leading",
                                         steps_offset=1, clip_sample=False, set_alpha_to_one=False)
    raise ValueError(f"sampler={sampler!r} is not known; allowed: {', '.join(ALL_SAMPLERS)}")


# denoise(latent_model_input, t) -> model output, same shape as the latents
Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sample(
    denoise: Denoiser,
    latents: torch.Tensor,
    scheduler,
    steps: int,
    generators: Sequence[torch.Generator] | None = None,
    callback: Callable[[int, int], None] | None = None,
    noise_shared: float = 0.0,
) -> torch.Tensor:
    """Run ``steps`` denoising steps from ``latents`` (already scaled by ``init_noise_sigma``).

    ``callback(step, total)`` is called after each step. ``noise_shared`` is the share common to
    all frames (``pipeline.noise``) of the noise that a sampler which re-noises its clean estimate
    between steps (LCM) draws: the model's noise prior, or what its folder asks for instead
    (``ModelInfo.renoise``); 0 leaves the scheduler's own independent noise.
    """
    scheduler.set_timesteps(steps, device=latents.device)
    timesteps = scheduler.timesteps
    extra = {"generator": list(generators)} if generators is not None and _takes_generator(scheduler) else {}
    for i, t in enumerate(timesteps):
        # 1. scale the input as the scheduler expects (Euler divides by sqrt(sigma^2 + 1); flow: as is)
        model_input = scheduler.scale_model_input(latents, t) if hasattr(scheduler, "scale_model_input") else latents
        # 2. predict the noise (guidance, if any, is inside ``denoise``)
        noise_pred = denoise(model_input, t)
        # 3. step x_t -> x_{t-1}
        out = scheduler.step(noise_pred, t, latents, **extra)
        latents = out.prev_sample
        # 4. a consistency sampler re-noises its clean estimate for the next step: with the prior
        if noise_shared and getattr(out, "denoised", None) is not None and i + 1 < len(timesteps):
            a = scheduler.alphas_cumprod[int(timesteps[i + 1])].to(latents.device, latents.dtype)
            fresh = per_clip(tuple(latents.shape), noise_shared, generators, latents.dtype, latents.device)
            latents = a.sqrt() * out.denoised + (1 - a).sqrt() * fresh
        if callback is not None:
            callback(i + 1, len(timesteps))
    return latents


def _takes_generator(scheduler) -> bool:
    return "generator" in inspect.signature(scheduler.step).parameters
