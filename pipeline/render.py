"""Render a group of compatible clips in one batched call.

A group shares model, tier, size and frame count. Every clip has its own seed and its own
``torch.Generator``, so a clip is the same whatever else is in its group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from pipeline.models import ModelInfo, load_pipeline
from pipeline.sampler import TIERS, make_scheduler, sample

@dataclass(frozen=True)
class ClipRequest:
    """One clip to render. ``key`` is the caller's handle, returned unchanged."""

    key: object
    prompt: str
    seed: int
    frames: int
    width: int
    height: int
    negative_prompt: str = ""


@dataclass(frozen=True)
class GroupSettings:
    tier: str = "fast"
    sampler: str = "lightning"
    guidance: float = 1.0

    @property
    def steps(self) -> int:
        return TIERS[self.tier].steps


@dataclass
class ClipResult:
    key: object
    frames: np.ndarray  # (F, H, W, 3) uint8
    fps: int
    timings: dict[str, float] = field(default_factory=dict)


def compatible_key(req: ClipRequest) -> tuple:
    """Clips with equal keys can share one batched call (model and tier are per group)."""
    return (req.frames, req.width, req.height)


class Renderer:
    """A loaded model kept warm between groups."""

    def __init__(self, info: ModelInfo, device: str = "cpu", dtype=None):
        self.info = info
        self.device = device
        self.pipe = load_pipeline(info, device=device, dtype=dtype)

    @property
    def dtype(self):
        return self.pipe.unet.dtype

    @torch.no_grad()
    def render(
        self,
        requests: Sequence[ClipRequest],
        settings: GroupSettings,
        callback: Callable[[int, int], None] | None = None,
    ) -> list[ClipResult]:
        if not requests:
            return []
        if len({compatible_key(r) for r in requests}) != 1:
            raise ValueError("render(): all requests in a group need the same frames, width and height")
        pipe = self.pipe
        first = requests[0]
        n, frames = len(requests), first.frames
        do_cfg = settings.guidance > 1.0
        t0 = time.perf_counter()

        # 1. text embeddings, (n, tokens, dim); uncond first when guidance is on
        cond, uncond = pipe.encode_prompt(
            [r.prompt for r in requests],
            self.device,
            1,
            do_cfg,
            [r.negative_prompt for r in requests] if do_cfg else None,
        )
        embeds = torch.cat([uncond, cond]) if do_cfg else cond
        embeds = embeds.repeat_interleave(frames, dim=0)  # the UNet wants one per frame
        t1 = time.perf_counter()

        # 2. initial noise, each clip from its own generator
        scheduler = make_scheduler(pipe.scheduler.config, settings.sampler)
        generators = [torch.Generator("cpu").manual_seed(int(r.seed)) for r in requests]
        shape = (
            1,
            pipe.unet.config.in_channels,
            frames,
            first.height // pipe.vae_scale_factor,
            first.width // pipe.vae_scale_factor,
        )
        latents = torch.cat([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])
        latents = (latents * scheduler.init_noise_sigma).to(self.device, self.dtype)

        # 3. denoise
        def denoise(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            x_in = torch.cat([x, x]) if do_cfg else x
            out = pipe.unet(x_in, t, encoder_hidden_states=embeds).sample
            if do_cfg:
                out_uncond, out_cond = out.chunk(2)
                out = out_uncond + settings.guidance * (out_cond - out_uncond)
            return out

        latents = sample(denoise, latents, scheduler, settings.steps, generators, callback)
        t2 = time.perf_counter()

        # 4. decode each clip on its own (bounded memory), to uint8 frames
        videos = [self.decode(latents[i : i + 1])[0] for i in range(n)]
        t3 = time.perf_counter()

        share = {
            "text_s": (t1 - t0) / n,
            "denoise_s": (t2 - t1) / n,
            "decode_s": (t3 - t2) / n,
        }
        share["render_s"] = sum(share.values())
        return [
            ClipResult(key=r.key, frames=v, fps=self.info.native_fps, timings=dict(share, group_size=n))
            for r, v in zip(requests, videos)
        ]

    def decode(self, latents: torch.Tensor, chunk: int = 16) -> np.ndarray:
        """Latents (b, c, f, h, w) to uint8 frames (b, f, H, W, 3), ``chunk`` frames per VAE call."""
        vae = self.pipe.vae
        b, c, f, h, w = latents.shape
        flat = (latents / vae.config.scaling_factor).permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        parts = [vae.decode(flat[i : i + chunk]).sample for i in range(0, flat.shape[0], chunk)]
        video = torch.cat(parts).float()
        video = ((video / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        video = video.reshape(b, f, 3, video.shape[-2], video.shape[-1]).permute(0, 1, 3, 4, 2)
        return video.cpu().numpy()
