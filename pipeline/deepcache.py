"""DeepCache-style feature reuse for the UNet (AnimateDiff's UNetMotionModel).

Between neighbouring denoising steps the deep (low-resolution) features of a UNet change
little. On a *full* step the whole UNet runs and the outputs of the deep part are kept; on a
*cached* step only the shallow branch runs (``conv_in``, the first ``branch`` down blocks, the
last ``branch`` up blocks, ``conv_out``) and the deep part's outputs are taken from the last full
step. It is approximate: the benchmark reports its cost as PSNR against the uncached twin.

Written as named, removable diffusers hooks (one on the UNet to count steps, one on each deep
block) sharing one state object. ``reset()`` clears that state; call it before each generation
(``Renderer`` does, and again in a ``finally`` after it), so nothing outlives a job or crosses
from one group to the next. A cached step also needs features made from an input of the same
shape, so a batch that changes size between steps (R-CFG's one-time negative) runs full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry, ModelHook

HOOK_NAME = "clipmill_deepcache"


@dataclass(frozen=True)
class DeepCacheConfig:
    """``interval``: a full step every ``interval`` steps (1 turns caching off; steps 0, interval,
    2*interval, ... run full). ``branch``: how many outer UNet levels run on cached steps; 0 is
    DeepCache's finest branch: only ``conv_in``, the last layer of the last up block and
    ``conv_out`` run, on the cached input of that layer."""

    interval: int = 2
    branch: int = 0

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"DeepCacheConfig.interval={self.interval}; it must be at least 1")
        if self.branch < 0:
            raise ValueError(f"DeepCacheConfig.branch={self.branch}; it must be at least 0")


@dataclass
class _State:
    step: int = 0
    skipping: bool = False
    shape: tuple | None = None
    outputs: dict = field(default_factory=dict)
    full_steps: int = 0
    cached_steps: int = 0
    blocks_run: int = 0
    blocks_skipped: int = 0

    def reset(self) -> None:
        self.step, self.skipping, self.shape = 0, False, None
        self.outputs.clear()


class _StepHook(ModelHook):
    """On the UNet: decides, before each call, whether this step is full or cached."""

    _is_stateful = True

    def __init__(self, config: DeepCacheConfig, state: _State, n_blocks: int):
        super().__init__()
        self.config, self.state, self.n_blocks = config, state, n_blocks

    @torch.compiler.disable  # a decision on Python state: outside compiled graphs, no recompiles
    def pre_forward(self, module, *args, **kwargs):
        st = self.state
        sample = args[0] if args else kwargs["sample"]
        shape = tuple(sample.shape)
        st.skipping = (
            st.step % self.config.interval != 0 and st.shape == shape and len(st.outputs) == self.n_blocks
        )
        if st.skipping:
            st.cached_steps += 1
        else:
            st.full_steps += 1
            st.shape = shape
        st.step += 1
        return args, kwargs

    def reset_state(self, module):
        self.state.reset()
        return module


class _BlockHook(ModelHook):
    """On a deep block: runs it and keeps its output on full steps, returns the kept output on cached ones."""

    _is_stateful = True

    def __init__(self, state: _State, name: str):
        super().__init__()
        self.state, self.name = state, name

    def new_forward(self, module, *args, **kwargs):
        cached = self._cached()
        if cached is not None:
            return cached
        return self._keep(self.fn_ref.original_forward(*args, **kwargs))

    @torch.compiler.disable
    def _cached(self):
        st = self.state
        if not st.skipping:
            return None
        st.blocks_skipped += 1
        return st.outputs[self.name]

    @torch.compiler.disable
    def _keep(self, out):
        self.state.outputs[self.name] = out
        self.state.blocks_run += 1
        return out

    def reset_state(self, module):
        self.state.reset()
        return module


class DeepCache:
    """``DeepCache(unet, config)`` installs the hooks; ``reset()``, ``remove()``, ``stats()``."""

    def __init__(self, unet: torch.nn.Module, config: DeepCacheConfig = DeepCacheConfig()):
        n_down = len(unet.down_blocks)
        if not 0 <= config.branch < n_down:
            raise ValueError(
                f"DeepCacheConfig.branch={config.branch}: this UNet has {n_down} levels; "
                f"branch must be from 0 to {n_down - 1} so that some deep blocks can be cached"
            )
        self.unet, self.config = unet, config
        self.state = _State()
        keep = max(config.branch, 1)
        deep = [(f"down_blocks.{i}", unet.down_blocks[i]) for i in range(config.branch, n_down)]
        if unet.mid_block is not None:
            deep.append(("mid_block", unet.mid_block))
        deep += [(f"up_blocks.{i}", unet.up_blocks[i]) for i in range(len(unet.up_blocks) - keep)]
        if config.branch == 0:  # inside the last up block, every layer but the last
            last, n = unet.up_blocks[-1], len(unet.up_blocks) - 1
            for j in range(len(last.resnets) - 1):
                for kind in ("resnets", "attentions", "motion_modules"):
                    mods = getattr(last, kind, None)
                    if mods is not None and j < len(mods):
                        deep.append((f"up_blocks.{n}.{kind}.{j}", mods[j]))
        self._modules = [m for _, m in deep]
        for name, m in deep:
            HookRegistry.check_if_exists_or_initialize(m).register_hook(_BlockHook(self.state, name), HOOK_NAME)
        HookRegistry.check_if_exists_or_initialize(unet).register_hook(
            _StepHook(config, self.state, len(deep)), HOOK_NAME
        )

    def reset(self) -> None:
        """Forget the kept features and the step count (before and after each generation)."""
        self.state.reset()

    def reset_stats(self) -> None:
        st = self.state
        st.full_steps = st.cached_steps = st.blocks_run = st.blocks_skipped = 0

    def stats(self) -> dict:
        st = self.state
        return {"full_steps": st.full_steps, "cached_steps": st.cached_steps, "blocks_skipped": st.blocks_skipped}

    def remove(self) -> None:
        self.state.reset()
        for m in [self.unet, *self._modules]:
            m._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
