"""Stream Batch for video: an endless shot from an AnimateDiff-family model, one frame at a time.

The model's window of ``F`` frames is a queue (FIFO-Diffusion's diagonal denoising): the frames
sit at staggered noise levels, the head nearly clean and the tail fresh noise, and one batched
denoiser call advances every frame of the window by one level of the sampler's schedule (LCM's
own timesteps for the current step count). The frame that reaches the clean end leaves the
head and is decoded; fresh noise (with the model's noise prior) joins at the tail. The window
never grows, so memory is constant however long the stream runs.

- Each frame carries its own timestep: :class:`PerFrameTime` is a removable hook that hands
  every ResNet block of the UNet a time embedding per frame instead of one per clip.
- Changing the steps re-times the queue: every frame keeps the noise level it has and steps to
  the next lower level of the new schedule, so nothing jumps.
- Changing the prompt applies from the next call on: the frames in flight finish under it, so
  the picture follows within one window of frames.
- Guidance above 1 runs R-CFG (self-negative, StreamDiffusion): the negative is the noise each
  frame's latent implies given its own last clean estimate; no second pass.
- Frames are decoded with the model folder's tiny autoencoder when the renderer has one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .guidance import RCFG_MAX_GUIDANCE
from .sampler import make_scheduler


class PerFrameTime:
    """Hook: each ResnetBlock2D of ``unet`` takes ``temb`` per frame (set with :meth:`set`)."""

    def __init__(self, unet):
        from diffusers.models.resnet import ResnetBlock2D

        self.temb: torch.Tensor | None = None
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                         for m in unet.modules() if isinstance(m, ResnetBlock2D)]
        if not self._handles:
            raise ValueError(f"{type(unet).__name__} has no ResnetBlock2D: per-frame timesteps need an AnimateDiff UNet")

    def set(self, temb: torch.Tensor | None) -> None:
        self.temb = temb

    def _hook(self, module, args, kwargs):
        if self.temb is None:
            return None
        if "temb" in kwargs and kwargs["temb"] is not None:
            return args, dict(kwargs, temb=self.temb)
        if len(args) >= 2 and args[1] is not None:
            return (args[0], self.temb, *args[2:]), kwargs
        return None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.temb = None


@dataclass
class StreamFrame:
    image: np.ndarray  # uint8 (H, W, 3)
    index: int  # frames emitted before it
    prompt: str  # the prompt it was made under when it entered the queue
    seconds: float  # the call that finished it


class StreamBatch:
    """An endless shot of ``prompt`` from ``renderer``'s AnimateDiff model (see the module)."""

    def __init__(self, renderer, prompt: str, seed: int = 0, steps: int = 4, size: int | None = None,
                 guidance: float = 1.0):
        if renderer.info.family != "animatediff":
            raise ValueError(f"model {renderer.info.name}: Stream Batch needs an AnimateDiff-family model")
        if guidance > 1.0 and guidance >= RCFG_MAX_GUIDANCE:
            raise ValueError(f"guidance={guidance:g}: the stream's R-CFG diverges at {RCFG_MAX_GUIDANCE:g} and above")
        self.r = renderer
        self.unet = renderer.pipe.unet
        self.window = renderer.info.default_frames
        self.size = size or renderer.info.default_size[0]
        self.guidance = guidance
        self.gen = torch.Generator("cpu").manual_seed(int(seed))
        self.scheduler = make_scheduler(renderer.pipe.scheduler.config, "lcm")
        self.alphas = self.scheduler.alphas_cumprod
        self.v_prediction = self.scheduler.config.prediction_type == "v_prediction"
        if self.scheduler.config.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type={self.scheduler.config.prediction_type!r}: the stream takes epsilon or "
                             "v_prediction models")
        s = renderer.pipe.vae_scale_factor
        self.latent_hw = (self.size // s, self.size // s)
        self.channels = self.unet.config.in_channels
        self.noise_shared = float(renderer.info.noise_shared or 0.0)
        self.emitted = 0
        self.set_steps(steps)
        self.set_prompt(prompt)
        self.hook = PerFrameTime(self.unet)  # last: whatever is refused above leaves the model as it was
        # the queue, head first: latents (F, C, h, w), each frame's timestep and last clean
        # estimate. It starts as pure noise at the top level and is denoised, every frame alike
        # at first, until the frames sit at staggered levels, the head at the lowest
        self.x = self._noise(self.window)
        self.x0 = torch.zeros_like(self.x)
        self.t = np.full(self.window, self.levels[-1], dtype=np.int64)
        self.prompts = [prompt] * self.window
        target = self.levels[np.linspace(0, len(self.levels) - 1, self.window).round().astype(int)]
        try:
            while (self.t > target).any():
                self._advance(self.t > target)
        except BaseException:
            self.close()
            raise

    # -- controls ------------------------------------------------------------------------------
    def set_prompt(self, prompt: str) -> None:
        """Steer the stream: frames entering from now on, and every denoising call, use it."""
        self.prompt = prompt
        self.cond = self.r.encode([prompt])
        self.rows = self.cond.repeat_interleave(self.window, dim=0)  # one row per frame, kept for the K/V cache
        if self.r.text_kv is not None:
            self.r.text_kv.reset()
            self.r.text_kv.bind(self.rows, [("cond", self.cond, self.window)])

    def set_steps(self, steps: int) -> None:
        """Re-time the queue: the levels are the LCM schedule of ``steps`` steps; each frame keeps
        its noise level and steps down to the next lower one."""
        if not 1 <= steps <= 50:
            raise ValueError(f"steps={steps}: allowed 1 to 50")
        self.scheduler.set_timesteps(steps)
        self.steps = steps
        self.levels = np.array(sorted(int(t) for t in self.scheduler.timesteps), dtype=np.int64)  # ascending

    def close(self) -> None:
        """Remove the hook: the model is as it was."""
        self.hook.remove()

    # -- one call ------------------------------------------------------------------------------
    def _noise(self, n: int) -> torch.Tensor:
        shape = (n, self.channels, *self.latent_hw)
        z = torch.randn(shape, generator=self.gen)
        if self.noise_shared:  # the model's prior: a share of the variance common to the frames
            common = torch.randn((1, *shape[1:]), generator=self.gen)
            z = (self.noise_shared ** 0.5) * common + ((1 - self.noise_shared) ** 0.5) * z
        return z

    def _boundary(self, t: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.scheduler.get_scalings_for_boundary_condition_discrete(int(x)) for x in t]
        c_skip = torch.tensor([float(p[0]) for p in pairs]).view(-1, 1, 1, 1)
        c_out = torch.tensor([float(p[1]) for p in pairs]).view(-1, 1, 1, 1)
        return c_skip, c_out

    def _ab(self, t: np.ndarray) -> torch.Tensor:
        return self.alphas[torch.as_tensor(t)].to(torch.float32).view(-1, 1, 1, 1)

    @torch.no_grad()
    def _advance(self, move: np.ndarray) -> np.ndarray:
        """One batched denoiser call over the window; the frames in ``move`` step to the next
        lower level (those below the lowest are clean: their latent is the clean estimate).
        Returns which frames are done."""
        unet, dtype = self.unet, self.r.dtype
        # 1. every frame's own time embedding, then one call over the window (one clip of F frames)
        tt = torch.as_tensor(self.t, dtype=torch.long)
        self.hook.set(unet.time_embedding(unet.time_proj(tt).to(device=self.r.device, dtype=dtype)))
        try:
            x_in = self.x.permute(1, 0, 2, 3).unsqueeze(0).to(self.r.device, dtype)  # (1, C, F, h, w)
            eps = unet(x_in, tt[:1].to(self.r.device), encoder_hidden_states=self.rows).sample
        finally:
            self.hook.set(None)
        out = eps[0].permute(1, 0, 2, 3).float().cpu()
        ab = self._ab(self.t)
        a, b = ab.sqrt(), (1 - ab).sqrt()
        eps = b * self.x + a * out if self.v_prediction else out  # the noise the model sees
        # 2. R-CFG above guidance 1: the negative is the noise the latent implies (self-negative)
        if self.guidance > 1.0:
            neg = (self.x - a * self.x0) / b
            eps = neg + self.guidance * (eps - neg)
        pred_x0 = (self.x - b * eps) / a
        # 3. LCM's consistency output: c_skip x_t + c_out x0 (its boundary condition at t = 0)
        c_skip, c_out = self._boundary(self.t)
        x0 = c_skip * self.x + c_out * pred_x0
        # 4. the moving frames to the next lower level, re-noised with the prior; below the lowest: done
        lower = np.array([self.levels[self.levels < t].max() if (self.levels < t).any() else -1 for t in self.t])
        nxt = np.where(move, lower, self.t)
        done = nxt < 0
        ab_next = self._ab(np.maximum(nxt, 0))
        renoised = ab_next.sqrt() * x0 + (1 - ab_next).sqrt() * self._noise(self.window)
        m = torch.as_tensor(move).view(-1, 1, 1, 1)
        d = torch.as_tensor(done).view(-1, 1, 1, 1)
        self.x = torch.where(m, torch.where(d, x0, renoised), self.x)
        self.x0 = torch.where(m, x0, self.x0)
        self.t = nxt
        return done

    def next(self) -> list[StreamFrame]:
        """Advance the window by one level (one batched denoiser call) and return the frames
        that reached the clean end: one per call when every frame has a level of its own
        (steps = the window's frames), window / steps when they share levels."""
        t0 = time.perf_counter()
        done = self._advance(np.ones(self.window, dtype=bool))
        k = len(done) if done.all() else int(np.argmin(done))  # the finished frames lead the queue
        if not k:
            return []
        images = self.r.decode(self.x[:k].permute(1, 0, 2, 3).unsqueeze(0).to(self.r.device, self.r.dtype))[0]
        secs = time.perf_counter() - t0
        out = [StreamFrame(images[i], self.emitted + i, self.prompts[i], secs) for i in range(k)]
        self.emitted += k
        # 5. the finished frames leave the head; fresh noise joins the tail at the top level
        self.x = torch.cat([self.x[k:], self._noise(k)])
        self.x0 = torch.cat([self.x0[k:], torch.zeros((k, *self.x0.shape[1:]))])
        self.t = np.concatenate([self.t[k:], np.full(k, self.levels[-1], dtype=np.int64)])
        self.prompts = self.prompts[k:] + [self.prompt] * k
        return out
