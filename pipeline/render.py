"""Render a group of compatible clips in one batched call.

A group shares model, tier, size and frame count. Every clip has its own seed and its own
``torch.Generator``, so a clip is the same whatever else is in its group.

The speed layers (see README, Performance) are options of the ``Renderer``:

- text: a bounded LRU of prompt embeddings across jobs, and the exact text K/V cache;
- features: DeepCache on the UNet, diffusers' ``enable_cache`` (FirstBlockCache) on the DiT;
- guidance: CFG, off, or R-CFG (``pipeline.guidance``);
- batching: groups of up to 4; out of memory splits a group in halves and retries;
- decoding: sliced per frame chunk, tiled for large frames, or the folder's tiny autoencoder;
- compilation: ``pipeline.compile`` (GPU only).

All per-generation cache state is reset before and after every group (in a ``finally``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from clipmill.pipeline.deepcache import DeepCache, DeepCacheConfig
from clipmill.pipeline.guidance import OVEREXPOSE_LIMIT, GuidedDenoiser, alpha_bar_fn, effective_mode
from clipmill.pipeline.models import ModelInfo, load_pipeline, load_tiny_vae
from clipmill.pipeline.prompt_cache import PromptEmbeddingCache
from clipmill.pipeline.choices import COMPILERS, DECODERS, TIERS
from clipmill.pipeline.compile import RESOLUTION_TIERS, compile_denoiser
from clipmill.pipeline.sampler import make_scheduler, sample
from clipmill.pipeline import frame_markers, long_shot
from clipmill.pipeline.noise import video_noise
from clipmill.pipeline.textkv import TextKVCache

log = logging.getLogger("clipmill.render")

# DiT feature cache per tier (diffusers FirstBlockCache): the residual change below which the
# remaining blocks are skipped. Quality gets the stricter threshold.
DIT_CACHE_THRESHOLD = {"fast": 0.08, "quality": 0.05}
TILING_ABOVE_PIXELS = 768 * 768  # frames larger than this decode tiled


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


MAX_STEPS = 1000  # a diffusion schedule's length: no sampler takes more steps than it has timesteps


@dataclass(frozen=True)
class GroupSettings:
    tier: str = "fast"
    sampler: str = "lightning"
    guidance: float = 1.0
    guidance_mode: str = "cfg"  # cfg | rcfg-self | rcfg-onetime (used when guidance > 1)
    step_count: int | None = None  # overrides the tier's steps (the benchmark's 50-step baseline)

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"GroupSettings.tier={self.tier!r}: allowed {', '.join(TIERS)}")
        if self.step_count is not None and not 1 <= self.step_count <= MAX_STEPS:
            raise ValueError(f"GroupSettings.step_count={self.step_count!r}: allowed 1 to {MAX_STEPS} denoising steps, "
                             "or None for the tier's")
        if not math.isfinite(self.guidance) or self.guidance < 0:
            raise ValueError(f"GroupSettings.guidance={self.guidance!r}: allowed a finite scale of 0 or more")

    @property
    def steps(self) -> int:
        return TIERS[self.tier].steps if self.step_count is None else self.step_count


@dataclass(frozen=True)
class RenderOptions:
    """The speed layers a Renderer uses. The defaults are what clipmill renders with."""

    text_kv: bool = True  # exact; see pipeline.textkv
    prompt_cache: int = 256  # prompt embeddings kept across jobs (0: off)
    feature_cache: bool = False  # approximate; off by default, see README (Performance)
    deepcache: DeepCacheConfig = DeepCacheConfig()
    decoder: str = "vae"  # vae | tiny (the folder's AutoencoderTiny)
    tiling: str = "auto"  # auto | on | off: tiled VAE decode (auto: frames above TILING_ABOVE_PIXELS)
    compile: str = "none"  # none | torch | tensorrt (GPU only; see pipeline.compile)

    def __post_init__(self):
        for name, value, allowed in (("decoder", self.decoder, DECODERS),
                                     ("tiling", self.tiling, ("auto", "on", "off")),
                                     ("compile", self.compile, COMPILERS)):
            if value not in allowed:
                raise ValueError(f"RenderOptions.{name}={value!r}; allowed: {', '.join(allowed)}")


@dataclass
class ClipResult:
    key: object
    frames: np.ndarray  # (F, H, W, 3) uint8
    fps: int
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # work done and skipped, for the benchmark
    decode_peak: float | None = None  # the largest |value| of the VAE's output before clipping (Renderer.render)
    decode_input_rms: float | None = None  # the RMS of the latents its decoder was given (Renderer.decoder_input_rms)


def compatible_key(req: ClipRequest) -> tuple:
    """Clips with equal keys can share one batched call (model and tier are per group)."""
    return (req.frames, req.width, req.height)


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator failing to allocate."""
    if isinstance(e, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e))


class Renderer:
    """A loaded model kept warm between groups."""

    def __init__(self, info: ModelInfo, device: str = "cpu", dtype=None, options: RenderOptions = RenderOptions()):
        self.info = info
        self.device = device
        self.pipe = load_pipeline(info, device=device, dtype=dtype)
        self.denoiser = self.pipe.transformer if info.family == "wan" else self.pipe.unet
        self.prompts = None
        self.text_kv = None
        self.deepcache = None
        self.dit_cache_tier: str | None = None
        self.tiny_vae = None
        self.compiled = None
        self._block_calls: _BlockCounter | None = None  # set only inside counting()
        self._prompt_base = (0, 0)  # the prompt cache's hits and misses when the group began
        self.configure(options)

    def configure(self, options: RenderOptions) -> None:
        """Install the speed layers of ``options`` (removing those of the previous ones); the
        loaded model stays as it is. If one cannot be installed (a model folder without the tiny
        decoder asked for, say), the previous options are installed again and the error raised."""
        before = getattr(self, "options", None)
        self.close()
        try:
            self._install(options)
        except BaseException:
            self.close()
            if before is not None and before != options:
                self._install(before)  # what was installed before installs again
            raise

    def _install(self, options: RenderOptions) -> None:
        self.options = options
        if options.prompt_cache:
            self.prompts = PromptEmbeddingCache(options.prompt_cache)
        if options.text_kv:
            self.text_kv = TextKVCache(self.denoiser)
        if options.feature_cache and self.info.family == "animatediff":
            self.deepcache = DeepCache(self.pipe.unet, options.deepcache)
        if options.decoder == "tiny":
            self.tiny_vae = load_tiny_vae(self.info, self.device, self.dtype)
        if options.compile != "none":
            self.compiled, message = compile_denoiser(self.denoiser, options.compile, self.device)
            self.compile_message = message
            log.warning("%s", message)

    @contextlib.contextmanager
    def using(self, options: RenderOptions):
        """Render with ``options`` inside the ``with`` block and with the previous ones again
        after it, whatever happens (a farm worker streams a preview between its groups this
        way: the tiny decoder, no feature cache)."""
        before = self.options
        self.configure(options)  # on failure it has put ``before`` back itself
        try:
            yield self
        finally:
            self.configure(before)

    @contextlib.contextmanager
    def counting(self):
        """Count the DiT blocks that really run (``blocks_run`` / ``blocks_skipped`` in each
        result's stats) for the renders inside the ``with`` block: what the bench measures. The
        counting hooks are installed on entry and removed on exit, whatever happens, so renders
        outside it (every worker's) run a model with no counting hooks; the hooks stay the same
        for the whole block, so a compiled model is not recompiled between its renders. AnimateDiff
        counts its skipped blocks in DeepCache itself: nothing to install."""
        if self.info.family != "wan" or self._block_calls is not None:
            yield self
            return
        with _BlockCounter(self.denoiser) as counter:
            self._block_calls = counter
            try:
                yield self
            finally:
                self._block_calls = None

    @property
    def dtype(self):
        return self.denoiser.dtype

    def close(self) -> None:
        """Remove every hook and processor the speed layers installed."""
        for c in (self.text_kv, self.deepcache):
            if c is not None:
                c.remove()
        self.text_kv = self.deepcache = self.prompts = self.tiny_vae = self.compiled = None
        if self.dit_cache_tier is not None:
            self.denoiser.disable_cache()
            self.dit_cache_tier = None

    # -- the group, with out-of-memory halving ---------------------------------------------------
    def render(
        self,
        requests: Sequence[ClipRequest],
        settings: GroupSettings,
        callback: Callable[[int, int], None] | None = None,
    ) -> list[ClipResult]:
        """Render ``requests`` as one group. Out of memory splits it in halves and retries each
        half (recursively, down to one clip); every result records how it was finally rendered
        (``oom_splits``, ``group_size``). A single clip that does not fit raises."""
        if not requests:
            return []
        if len({compatible_key(r) for r in requests}) != 1:
            shapes = ", ".join(f"{r.frames} frames at {r.width}x{r.height}" for r in requests)
            raise ValueError(f"render(): all requests in a group need the same frames, width and height; got {shapes}")
        for r in requests:
            if not 0 <= int(r.seed) < 2**63:
                raise ValueError(f"render(): seed={r.seed}: allowed an integer from 0 to 2**63-1")
        if len(requests) > 1 and self.info.family == "wan" and self.options.feature_cache:
            # diffusers' FirstBlockCache decides to skip blocks once for the whole batch, from its
            # mean residual change: in a group, the other clips would decide this clip's skips.
            # Each clip is rendered alone, so that it is the same whatever else is in its group.
            return [res for r in requests for res in self.render([r], settings, callback)]
        try:
            return self._render(list(requests), settings, callback)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
            if not is_out_of_memory(e) or len(requests) == 1:
                raise
            log.warning("out of memory rendering a group of %s: splitting it in halves (%s)", len(requests), e)
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        half = (len(requests) + 1) // 2
        results = []
        for part in (requests[:half], requests[half:]):
            for r in self.render(part, settings, callback):
                r.timings["oom_splits"] = r.timings.get("oom_splits", 0) + 1
                results.append(r)
        return results

    @torch.no_grad()
    def _render(self, requests: list[ClipRequest], settings: GroupSettings, callback) -> list[ClipResult]:
        first = requests[0]
        n = len(requests)
        self._prompt_base = (self.prompts.hits, self.prompts.misses) if self.prompts is not None else (0, 0)
        free = self.long_shot_windows(first.frames)
        frames_msg = None if free else self.info.check_frames(first.frames)
        if frames_msg and self.info.family == "animatediff" and first.frames > self.info.max_frames:
            frames_msg = (f"the {self.info.family} model takes {self.info.frames_allowed} frames in one call, "
                          f"or up to {long_shot.MAX_FRAMES} as a long shot")
        if msg := frames_msg or self.info.check_size(first.width, first.height):
            raise ValueError(f"render(): {first.frames} frames at {first.width}x{first.height}: {msg}")
        mode = effective_mode(settings.guidance_mode, settings.guidance)
        if self.info.guidance_distilled and settings.guidance > OVEREXPOSE_LIMIT and settings.step_count is None:
            log.warning("guidance %g on a distilled few-step model: above %g its clips over-expose (blown-out, "
                        "saturated frames); it is made for 1.0-2.0", settings.guidance, OVEREXPOSE_LIMIT)
        t0 = time.perf_counter()

        # 1. text embeddings (n, tokens, dim), or one row per frame (n * frames, tokens, dim) for
        #    a model with frame markers, from the LRU where the prompt was seen before
        cond = self.encode([r.prompt for r in requests], first.frames)
        neg = self.encode([r.negative_prompt for r in requests], first.frames) if mode != "none" else None
        t1 = time.perf_counter()

        # 2. initial noise, each clip from its own generator
        scheduler = make_scheduler(self.pipe.scheduler.config, settings.sampler)
        generators = [torch.Generator("cpu").manual_seed(int(r.seed)) for r in requests]
        shape = self.latent_shape(first)
        # with the model's noise prior: a share common to all frames (0 for most models: plain randn);
        # a long shot's later frames start from its first windows' noise, shuffled (FreeNoise)
        noises = [video_noise(shape, self.info.noise_shared, g) for g in generators]
        if free is not None:
            noises = [long_shot.shuffle_context(x, free, g) for x, g in zip(noises, generators)]
        latents = torch.cat(noises)
        latents = (latents * getattr(scheduler, "init_noise_sigma", 1.0)).to(self.device, self.dtype)

        # 3. denoise, with every cache reset before and after; LCM re-noises between steps with the
        #    model's re-noising share (its prior unless its clipmill.json says "renoise_shared")
        self.reset_stats()
        self._reset_caches(settings.tier)
        windows = None
        try:
            windows = long_shot.apply(self.pipe.unet, free) if free is not None else None
            predict = self._predictor(cond, neg, first, n)
            alpha_bar = alpha_bar_fn(scheduler) if mode.startswith("rcfg") else None
            guided = GuidedDenoiser(predict, mode, settings.guidance, n, alpha_bar)
            latents = sample(guided, latents, scheduler, settings.steps, generators, callback,
                             noise_shared=self.info.renoise)
            stats = self._cache_stats()
        finally:
            if windows is not None:
                windows.remove()
            self._reset_caches(None)
        t2 = time.perf_counter()

        # 4. decode each clip on its own (bounded memory), to uint8 frames; keep how far the
        #    VAE's output went before clipping to [-1, 1] and the RMS of what its decoder was given
        #    (NaN for a clip that went NaN; none for the tiny decoder, whose range is its own)
        videos, peaks, rms = [], [], []
        for i in range(n):
            video = self.decode_float(latents[i : i + 1])
            peaks.append(None if self.tiny_vae is not None else _peak(video))
            rms.append(self.decoder_input_rms(latents[i : i + 1]))
            videos.append(_to_uint8(video)[0])
        t3 = time.perf_counter()

        share = {"text_s": (t1 - t0) / n, "denoise_s": (t2 - t1) / n, "decode_s": (t3 - t2) / n}
        share["render_s"] = sum(share.values())
        stats.update(denoiser_rows=guided.rows / n, steps=settings.steps, guidance_mode=mode)
        if free is not None:
            stats.update(long_shot={"context_length": free.context_length, "context_stride": free.context_stride})
        return [
            ClipResult(key=r.key, frames=v, fps=self.info.native_fps, timings=dict(share, group_size=n), stats=stats,
                       decode_peak=p, decode_input_rms=q)
            for r, v, p, q in zip(requests, videos, peaks, rms)
        ]

    def long_shot_windows(self, frames: int) -> long_shot.FreeNoiseConfig | None:
        """FreeNoise windows for a long shot (``frames`` over what an AnimateDiff model takes at
        once, up to ``long_shot.MAX_FRAMES``): windows of the model's own clip length. None for a
        clip that fits one call (and for Wan, which renders its frames in one call)."""
        if self.info.family != "animatediff" or frames <= self.info.max_frames or frames > long_shot.MAX_FRAMES:
            return None
        return long_shot.FreeNoiseConfig.for_model(self.info.default_frames)

    # -- per family ----------------------------------------------------------------------------
    def encode(self, prompts: list[str], frames: int | None = None) -> torch.Tensor:
        """Prompt embeddings (len(prompts), tokens, dim). For a model with frame markers and a
        frame count, one row per frame instead (len(prompts) * frames, tokens, dim; clip-major),
        each frame's prompt marked with its place in the clip (``pipeline.frame_markers``);
        without ``frames`` (a stream, whose frames have no fixed place) the plain prompt."""
        markers = self.info.frame_markers if frames else ()

        def run(texts: list[str]) -> torch.Tensor:
            if self.info.family == "wan":
                return self.pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=self.device,
                                               max_sequence_length=self.info.max_prompt_tokens)[0]
            if markers:
                return self._encode_marked(texts, frames, markers)
            return self.pipe.encode_prompt(texts, self.device, 1, False)[0]

        variant = f"frames={frames}" if markers else ""
        with torch.no_grad():  # a stream calls this outside a render: no autograd graph kept in the LRU
            out = self.prompts.get(prompts, run, variant) if self.prompts is not None else run(prompts)
        return out.flatten(0, 1) if markers else out

    def _encode_marked(self, texts: list[str], frames: int, markers: tuple[int, ...]) -> torch.Tensor:
        """(len(texts), frames, tokens, dim): each prompt's states with its frames' markers."""
        tok = self.pipe.tokenizer
        ids = tok(texts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        states = self.pipe.text_encoder(frame_markers.mark(ids, frames, markers).to(self.device))[0]
        return states.to(self.pipe.text_encoder.dtype).view(len(texts), frames, *states.shape[1:])

    def latent_shape(self, req: ClipRequest) -> tuple[int, ...]:
        """Latent shape of one clip."""
        if self.info.family == "wan":
            vae = self.pipe.vae
            t = self.pipe.vae_scale_factor_temporal
            s = self.pipe.vae_scale_factor_spatial
            return (1, vae.config.z_dim, (req.frames - 1) // t + 1, req.height // s, req.width // s)
        s = self.pipe.vae_scale_factor
        return (1, self.pipe.unet.config.in_channels, req.frames, req.height // s, req.width // s)

    def _predictor(self, cond: torch.Tensor, neg: torch.Tensor | None, req: ClipRequest, n: int):
        """``predict(x, t, which)`` over the denoiser for ``n`` clips like ``req``, with contexts
        bound to the text K/V cache."""
        frames = req.frames
        # compiled graphs are built per resolution tier; other sizes run the plain model
        model = self.compiled if self.compiled is not None and (req.width, req.height) in RESOLUTION_TIERS else self.denoiser
        kv = self.text_kv
        if self.info.family == "wan":
            # the K/V cache keys Wan's contexts by the projected text tensor: cond and uncond apart
            contexts = {"cond": cond, "uncond": neg}

            def call(x, t, label):
                with self.denoiser.cache_context(label):
                    return model(hidden_states=x, timestep=t.expand(x.shape[0]),
                                 encoder_hidden_states=contexts[label], return_dict=False)[0]

            def predict(x, t, which):
                if which == "cond":
                    return call(x, t, "cond")
                return call(x, t, "uncond"), call(x, t, "cond")  # Wan runs the two passes apart

            return predict

        # AnimateDiff: one embedding row per frame (a model with frame markers has them already)
        cond_rows = frame_markers.per_frame(cond, n, frames)
        repeats = 1 if cond_rows is cond else frames
        both_rows = torch.cat([frame_markers.per_frame(neg, n, frames), cond_rows]) if neg is not None else None
        if kv is not None:
            kv.bind(cond_rows, [("cond", cond, repeats)])
            if both_rows is not None:
                kv.bind(both_rows, [("uncond", neg, repeats), ("cond", cond, repeats)])

        def predict(x, t, which):
            if which == "cond":
                return model(x, t, encoder_hidden_states=cond_rows).sample
            return model(torch.cat([x, x]), t, encoder_hidden_states=both_rows).sample.chunk(2)

        return predict

    def _reset_caches(self, tier: str | None) -> None:
        """Clear every per-generation cache; with a tier, (re)configure the DiT cache for it."""
        if self.text_kv is not None:
            self.text_kv.reset()
        if self.deepcache is not None:
            self.deepcache.reset()
        if self.info.family == "wan" and self.options.feature_cache:
            if tier is not None and tier != self.dit_cache_tier:
                from diffusers import FirstBlockCacheConfig

                if self.dit_cache_tier is not None:
                    self.denoiser.disable_cache()
                self.denoiser.enable_cache(FirstBlockCacheConfig(threshold=DIT_CACHE_THRESHOLD.get(tier, 0.05)))
                self.dit_cache_tier = tier
            self.denoiser._reset_stateful_cache()

    def reset_stats(self) -> None:
        if self._block_calls is not None:
            self._block_calls.reset()
        if self.text_kv is not None:
            self.text_kv.stats.projected = self.text_kv.stats.avoided = 0
        if self.deepcache is not None:
            self.deepcache.reset_stats()

    def _cache_stats(self) -> dict:
        out: dict = {}
        if self._block_calls is not None:
            out.update(self._block_calls.stats())
        if self.text_kv is not None:
            out.update(self.text_kv.stats.as_dict())
        if self.deepcache is not None:
            out.update(self.deepcache.stats())
        if self.prompts is not None:  # this group's, as every other counter here
            out.update(prompt_cache_hits=self.prompts.hits - self._prompt_base[0],
                       prompt_cache_misses=self.prompts.misses - self._prompt_base[1])
        return out

    # -- decoding --------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, chunk: int = 16) -> np.ndarray:
        """Latents of one or more clips to uint8 frames (b, f, H, W, 3)."""
        return _to_uint8(self.decode_float(latents, chunk))

    def decoder_input_rms(self, latents: torch.Tensor) -> float | None:
        """The RMS of what ``decode`` gives the VAE's decoder for ``latents`` (the denoiser's
        latents over the VAE's scaling factor); None for the tiny decoder and for Wan (whose
        latents are de-normalised per channel)."""
        if self.info.family == "wan" or self.tiny_vae is not None:
            return None
        return float(latents.float().pow(2).mean().sqrt()) / float(self.pipe.vae.config.scaling_factor)

    def decode_float(self, latents: torch.Tensor, chunk: int = 16) -> torch.Tensor:
        """Latents of one or more clips to the VAE's output (b, f, 3, H, W), before it is clipped
        to [-1, 1]: how far a decode goes beyond that range is the render check's measure."""
        if self.info.family == "wan":
            return self._decode_wan(latents)
        vae = self.tiny_vae or self.pipe.vae
        b, c, f, h, w = latents.shape
        s = self.pipe.vae_scale_factor
        if self.tiny_vae is None:
            self._set_tiling(vae, h * w * s * s)
        flat = (latents / vae.config.scaling_factor).permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        # sliced: ``chunk`` frames per VAE call bounds memory for long clips
        parts = [vae.decode(flat[i : i + chunk]).sample for i in range(0, flat.shape[0], chunk)]
        return torch.cat(parts).reshape(b, f, 3, h * s, w * s)

    def _decode_wan(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        s = self.pipe.vae_scale_factor_spatial
        self._set_tiling(vae, latents.shape[-1] * latents.shape[-2] * s * s)
        video = vae.decode(latents * std + mean).sample  # (b, 3, f, H, W)
        return video.permute(0, 2, 1, 3, 4)

    def _set_tiling(self, vae, frame_pixels: int) -> None:
        """Tiled decode when the options say so: ``on``, or ``auto`` above TILING_ABOVE_PIXELS."""
        o = self.options.tiling
        if o == "on" or (o == "auto" and frame_pixels > TILING_ABOVE_PIXELS):
            vae.enable_tiling()
        else:
            vae.disable_tiling()


class _BlockCounter:
    """Counts DiT forwards and the transformer blocks that really ran (a block skipped by a
    feature cache never reaches its self-attention).

    A measurement only (see Renderer.counting): its forward pre-hooks are on the model while
    ``with counter:`` runs and are removed when it ends, whatever happens."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls = self.blocks_run = 0
        self.n_blocks = len(model.blocks)
        self._handles: list = []

    def __enter__(self) -> _BlockCounter:
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._call))
            for b in self.model.blocks:
                self._handles.append(b.attn1.register_forward_pre_hook(self._block))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Take every hook this counter installed off the model."""
        while self._handles:
            self._handles.pop().remove()

    def _call(self, *_):
        self.calls += 1

    def _block(self, *_):
        self.blocks_run += 1

    def reset(self) -> None:
        self.calls = self.blocks_run = 0

    def stats(self) -> dict:
        return {"blocks_run": self.blocks_run, "blocks_skipped": self.calls * self.n_blocks - self.blocks_run}


def _peak(video: torch.Tensor) -> float:
    """The largest |value| of ``video`` (NaN if any is): from its min and max, without the copy
    ``abs()`` makes (12x faster on a 720p clip)."""
    low, high = torch.aminmax(video)
    return float(torch.maximum(-low, high).float())


def _to_uint8(video: torch.Tensor) -> np.ndarray:
    """(b, f, 3, H, W) in [-1, 1] to (b, f, H, W, 3) uint8."""
    video = ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return video.permute(0, 1, 3, 4, 2).cpu().numpy()
