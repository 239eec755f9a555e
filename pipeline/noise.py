"""Video noise with a share common to all frames: the mixed noise prior of PYoCo (Ge et al. 2023,
"Preserve Your Own Correlation: A Noise Prior for Video Diffusion Models").

Every element is still standard normal, but a fraction ``shared`` of its variance is one draw per
clip, repeated over the frames, and the rest is drawn per frame::

    noise[:, :, f] = sqrt(shared) * common + sqrt(1 - shared) * own[f]

A model trained on such noise starts every frame of a sample from the same layout, so it commits
to one trajectory for the whole clip instead of one per frame, and the fine texture each frame's
noise seeds is mostly the same in every frame. A model must be sampled with the prior it was
trained with (its folder's ``clipmill.json`` says ``"noise_shared"``); ``shared=0`` is plain
independent noise, what every other model takes.
"""

from __future__ import annotations

import math

import torch

from .choices import check_noise_shared as check_shared


def video_noise(shape: tuple[int, ...], shared: float = 0.0, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise of ``shape`` (B, C, T, h, w) with ``shared`` of its variance common to
    the T frames of each clip. ``generator`` (one for the whole tensor) or torch's global one.

    With ``shared=0`` this is exactly ``torch.randn(shape, generator=generator)``, so a model without
    the prior samples the same noise it did before the prior existed."""
    shared = check_shared(shared)
    own = torch.randn(shape, generator=generator, dtype=dtype, device=device)
    if shared == 0.0:
        return own
    common = torch.randn((*shape[:2], 1, *shape[3:]), generator=generator, dtype=dtype, device=device)
    return math.sqrt(shared) * common + math.sqrt(1.0 - shared) * own


def like(x: torch.Tensor, shared: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`video_noise` of ``x``'s shape, dtype and device."""
    return video_noise(tuple(x.shape), shared, generator, x.dtype, x.device)


def per_clip(shape: tuple[int, ...], shared: float, generators, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`video_noise` for a batch (B, C, T, h, w) with one generator per clip (``generators``,
    B of them), so that a clip's noise does not depend on the clips grouped with it; torch's global
    generator when ``generators`` is None."""
    if generators is None:
        return video_noise(shape, shared, None, dtype, device)
    one = (1, *shape[1:])
    return torch.cat([video_noise(one, shared, g, dtype, "cpu") for g in generators]).to(device)
