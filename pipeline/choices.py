"""The render vocabulary as plain data, importable without torch: quality tiers (step
counts), samplers, guidance modes, decoders and compilers.

Each is defined here once; the sampler, the renderer, the job queue, the nightly scheduler,
the settings and the CLI all read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLERS = ("lightning", "lcm")  # distilled AnimateDiff samplers a batch may ask for
# every sampler pipeline.sampler.make_scheduler knows: + 'flow' (Wan's flow-matching Euler)
# and 'ddim' (the undistilled 50-step baseline)
ALL_SAMPLERS = (*SAMPLERS, "flow", "ddim")
GUIDANCE_MODES = ("cfg", "rcfg-self", "rcfg-onetime")  # what a user asks for when guidance > 1
DECODERS = ("vae", "tiny")  # tiny: the model folder's AutoencoderTiny (vae_tiny/)
COMPILERS = ("none", "torch", "tensorrt")


@dataclass(frozen=True)
class Tier:
    name: str
    steps: int


TIERS: dict[str, Tier] = {"fast": Tier("fast", 6), "quality": Tier("quality", 8)}


def check_noise_shared(shared, name: str = "noise_shared") -> float:
    """A model's noise prior (``pipeline.noise``), or the share it re-noises with, as a float, or
    ValueError naming the field ``name``, the value and what is allowed."""
    try:
        value = float(shared)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={shared!r}: must be a number from 0 to below 1") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value}: allowed 0 <= {name} < 1 (the share of the noise's variance "
                         "common to all frames; 1 would make every frame the same)")
    return value
