"""Guidance modes: how a denoiser turns conditional (and negative) predictions into one.

- ``none``: one conditional pass per step (guidance-distilled models, guidance 1.0).
- ``cfg``: classifier-free guidance; the batch is doubled (negative + conditional) every step.
- ``rcfg-self``: R-CFG from StreamDiffusion, self-negative. The negative prediction is not
  computed; it is approximated by the noise the current latent implies given the previous
  step's clean estimate (at the first step: the initial noise). No extra batch.
- ``rcfg-onetime``: R-CFG, onetime-negative. One real negative pass at the first step, then the
  same approximation as ``rcfg-self``.

R-CFG's approximation is written for epsilon-predicting models (AnimateDiff). With
``x_in = sqrt(abar) * x0 + sqrt(1 - abar) * eps``, which holds for the model input of the
Euler, LCM and DDIM schedulers alike, the implied noise is ``(x_in - sqrt(abar) * x0) / sqrt(1 - abar)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from clipmill.pipeline.choices import GUIDANCE_MODES
OVEREXPOSE_LIMIT = 6.0
# R-CFG's negative is the previous guided estimate, so each step extrapolates the clean estimate
# by the scale: x0_k = x0_{k-1} + g * (x0cond_k - x0_{k-1}). Errors grow by |1 - g| per step,
# which converges only for 1 < g < 2.
RCFG_MAX_GUIDANCE = 2.0

# predict(x_in, t, which) -> eps for which="cond", or (eps_negative, eps_cond) for which="both"
Predict = Callable[[torch.Tensor, torch.Tensor, str], object]


def effective_mode(mode: str, scale: float) -> str:
    """The mode that runs: ``none`` whenever the scale is 1.0 or less, else ``mode``."""
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"guidance mode {mode!r} is not known; allowed: {', '.join(GUIDANCE_MODES)}")
    if mode.startswith("rcfg") and scale >= RCFG_MAX_GUIDANCE:
        raise ValueError(
            f"guidance {scale:g} with {mode}: R-CFG diverges at guidance {RCFG_MAX_GUIDANCE:g} and above (each step "
            f"extrapolates by the scale); use a guidance below {RCFG_MAX_GUIDANCE:g}, or --guidance-mode cfg"
        )
    return "none" if scale <= 1.0 else mode


def alpha_bar_fn(scheduler) -> Callable[[torch.Tensor], float]:
    """``abar(t)`` of an epsilon scheduler (Euler, LCM, DDIM): its ``alphas_cumprod`` at step ``t``."""
    ac = getattr(scheduler, "alphas_cumprod", None)
    if ac is None:
        raise ValueError(
            f"R-CFG needs an epsilon-prediction scheduler with alphas_cumprod; {type(scheduler).__name__} has none "
            "(flow-matching models such as Wan run guidance-distilled at 1.0, or with --guidance-mode cfg)"
        )
    return lambda t: float(ac[int(round(float(t)))])


class GuidedDenoiser:
    """``denoise(x_in, t)`` for ``pipeline.sampler.sample``; counts evaluations in clip rows.

    Stateful across the steps of one generation; make a new one per generation.
    """

    def __init__(self, predict: Predict, mode: str, scale: float, clips: int,
                 alpha_bar: Callable[[torch.Tensor], float] | None = None, delta: float = 1.0):
        self.predict, self.mode, self.scale, self.clips = predict, mode, scale, clips
        self.alpha_bar, self.delta = alpha_bar, delta
        if mode.startswith("rcfg") and alpha_bar is None:
            raise ValueError("GuidedDenoiser: R-CFG needs alpha_bar")
        self.step = 0
        self.rows = 0  # clip rows through the denoiser (a CFG step costs 2 per clip)
        self._x0: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        first = self.step == 0
        self.step += 1
        g = self.scale
        if self.mode == "none":
            self.rows += self.clips
            return self.predict(x, t, "cond")
        if self.mode == "cfg" or (self.mode == "rcfg-onetime" and first):
            self.rows += 2 * self.clips
            neg, cond = self.predict(x, t, "both")
        else:  # R-CFG: the negative is the noise the latent implies
            self.rows += self.clips
            cond = self.predict(x, t, "cond")
            ab = self.alpha_bar(t)
            x0 = self._x0 if self._x0 is not None else torch.zeros_like(x)
            neg = self.delta * (x - ab**0.5 * x0) / (1 - ab) ** 0.5
        eps = neg + g * (cond - neg)
        if self.mode != "cfg":
            ab = self.alpha_bar(t)
            self._x0 = (x - (1 - ab) ** 0.5 * eps) / ab**0.5
        return eps
