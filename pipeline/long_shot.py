"""Long shots: one continuous render of more frames than an AnimateDiff model takes at once,
with FreeNoise (Qiu et al. 2023; diffusers' ``FreeNoiseTransformerBlock``).

The UNet's spatial layers work per frame, so any number of frames goes through them. Only its
temporal (motion) transformers see a frame window, and FreeNoise runs each of them over
overlapping windows of ``context_length`` frames, ``context_stride`` apart, and blends the windows'
outputs with weights that fall towards a window's edges. The initial noise of frames past the
first window is the first windows' noise, shuffled within each stride ("shuffle_context"), so
the long render keeps the first window's look. Nothing is glued: every frame is denoised in the
same call, and every window overlaps its neighbours at every step.

:func:`apply` swaps the temporal transformer blocks for FreeNoise blocks holding the same weights
and returns a handle whose ``remove()`` puts the original blocks back, so no state outlives the
render it was made for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTINGS = ("pyramid", "flat", "delayed_reverse_sawtooth")
MAX_FRAMES = 480  # the longest shot rendered in one call (20 s at 24 fps)


@dataclass(frozen=True)
class FreeNoiseConfig:
    """``context_length``: frames per temporal window (the frames the model was trained on);
    ``context_stride``: frames between window starts; ``weighting``: diffusers' blend of the
    windows' outputs."""

    context_length: int = 16
    context_stride: int = 4
    weighting: str = "pyramid"

    def __post_init__(self):
        if self.context_length < 2:
            raise ValueError(f"FreeNoiseConfig.context_length={self.context_length}: at least 2 frames")
        if not 1 <= self.context_stride < self.context_length:
            raise ValueError(f"FreeNoiseConfig.context_stride={self.context_stride}: allowed 1 to "
                             f"{self.context_length - 1} (windows must overlap)")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"FreeNoiseConfig.weighting={self.weighting!r}; allowed: {', '.join(WEIGHTINGS)}")

    @classmethod
    def for_model(cls, frames: int) -> FreeNoiseConfig:
        """Windows of the model's own clip length, half of one apart."""
        return cls(context_length=frames, context_stride=max(1, frames // 2))


class FreeNoiseHook:
    """The swapped blocks of one UNet; ``remove()`` restores the originals (idempotent)."""

    name = "free_noise"

    def __init__(self, swapped: list[tuple[torch.nn.ModuleList, int, torch.nn.Module]]):
        self._swapped = swapped

    @property
    def blocks(self) -> int:
        return len(self._swapped)

    def remove(self) -> None:
        for holder, i, original in self._swapped:
            holder[i] = original
        self._swapped = []


def _motion_modules(unet):
    for block in (*unet.down_blocks, *unet.up_blocks, unet.mid_block):
        yield from getattr(block, "motion_modules", None) or ()


def apply(unet, cfg: FreeNoiseConfig) -> FreeNoiseHook:
    """Run every temporal transformer block of ``unet`` (a UNetMotionModel) over FreeNoise windows."""
    from diffusers.models.attention import BasicTransformerBlock, FreeNoiseTransformerBlock

    swapped = []
    param = next(unet.parameters())
    try:
        _swap(unet, cfg, param, swapped, BasicTransformerBlock, FreeNoiseTransformerBlock)
    except BaseException:  # out of memory building a block, say: the UNet is left as it was
        FreeNoiseHook(swapped).remove()
        raise
    return FreeNoiseHook(swapped)


def _swap(unet, cfg: FreeNoiseConfig, param, swapped: list, BasicTransformerBlock, FreeNoiseTransformerBlock) -> None:
    for mm in _motion_modules(unet):
        for i, b in enumerate(mm.transformer_blocks):
            if not isinstance(b, BasicTransformerBlock):
                continue
            fn = FreeNoiseTransformerBlock(
                dim=b.dim, num_attention_heads=b.num_attention_heads, attention_head_dim=b.attention_head_dim,
                dropout=b.dropout, cross_attention_dim=b.cross_attention_dim, activation_fn=b.activation_fn,
                attention_bias=b.attention_bias, only_cross_attention=b.only_cross_attention,
                double_self_attention=b.double_self_attention, positional_embeddings=b.positional_embeddings,
                num_positional_embeddings=b.num_positional_embeddings, context_length=cfg.context_length,
                context_stride=cfg.context_stride, weighting_scheme=cfg.weighting,
            ).to(device=param.device, dtype=param.dtype)
            fn.load_state_dict(b.state_dict(), strict=True)
            fn.set_chunk_feed_forward(b._chunk_size, b._chunk_dim)
            # the attention processors (text K/V caches, counters) stay the block's own
            fn.attn1.set_processor(b.attn1.processor)
            if fn.attn2 is not None and b.attn2 is not None:
                fn.attn2.set_processor(b.attn2.processor)
            swapped.append((mm.transformer_blocks, i, b))
            mm.transformer_blocks[i] = fn


def shuffle_context(noise: torch.Tensor, cfg: FreeNoiseConfig, generator: torch.Generator | None) -> torch.Tensor:
    """FreeNoise's initial noise for one clip (1, C, T, h, w): frames from ``context_length`` on are
    the frames a window before them, shuffled within each stride (a copy; ``noise`` is kept)."""
    out = noise.clone()
    n = out.shape[2]
    for i in range(cfg.context_length, n, cfg.context_stride):
        start = max(0, i - cfg.context_length)
        end = min(n, start + cfg.context_stride)
        length = min(end - start, n - i)
        if length <= 0:
            break
        perm = torch.randperm(end - start, generator=generator)[:length] + start
        out[:, :, i:i + length] = out[:, :, perm]
    return out
