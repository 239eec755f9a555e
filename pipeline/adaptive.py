"""The streaming preview's frame-time scheduler: how many denoising steps the next frame gets,
at which quality tier, and whether a frame must be dropped, to hold a frame-time budget.

- A sliding window of the last frames' costs (``pacing.CostWindow``, seconds per step at the
  reference tier) predicts the next step's cost at any tier.
- ``steps = budget / predicted step cost``, scaled by a scene-complexity factor (a still scene
  needs fewer steps than a moving one: from the optical-flow magnitude), clamped to the tier's
  ``[min_steps, max_steps]``.
- Tiers (resolution, steps, guidance) switch with hysteresis (``pacing.Hold``): down when the
  window of frame times runs more than ``over`` (15%) over the budget while the steps are
  already at the tier's minimum, up when it runs ``under`` (25%) under it and the tier above is
  predicted to fit; never within ``hold_frames`` (5) frames of the last switch.
- Under load it answers in order: fewer steps first, then a lower tier, and only at the lowest
  tier's minimum does it drop frames.

Pure logic: the stream feeds measurements (``record``) and asks for a ``plan`` per frame.
:func:`simulate` runs it (or fixed steps) against a cost model, for tests and the README.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median, pstdev
from typing import Callable

from .pacing import CostWindow, Hold


@dataclass(frozen=True)
class PreviewTier:
    """One quality tier of the preview: its square size, its step range and guidance."""

    name: str
    size: int
    min_steps: int
    max_steps: int
    guidance: float = 1.0

    def cost(self, reference: int) -> float:
        """A step's cost relative to a step at ``reference`` pixels square (cost ~ pixels)."""
        return (self.size / reference) ** 2


# best first: the shapes model's own 64 x 64, then smaller renders upscaled for display
TIERS = (PreviewTier("high", 64, 2, 4, 1.0), PreviewTier("medium", 48, 1, 3, 1.0), PreviewTier("low", 32, 1, 2, 1.0))


@dataclass(frozen=True)
class AdaptiveConfig:
    budget_s: float = 0.5  # the frame-time budget
    window: int = 10  # frames in the sliding window (8-12)
    over: float = 0.15  # tier down when the window runs this much over the budget (at min steps)
    under: float = 0.25  # tier up when it runs this much under, and the tier above fits
    hold_frames: int = 5  # frames a tier holds after a switch
    flow_ref: float = 1.5  # px/frame of optical flow at which a scene counts as fully complex
    min_complexity: float = 0.6  # a still scene still gets this share of the steps that fit

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ValueError(f"budget_s={self.budget_s}: the frame-time budget must be positive")
        if not 0 < self.min_complexity <= 1:
            raise ValueError(f"min_complexity={self.min_complexity}: allowed (0, 1]")


@dataclass
class Plan:
    tier: PreviewTier
    steps: int
    drop: bool  # skip this frame to catch up (only at the lowest tier's minimum steps)
    switched: bool
    reason: str
    predicted_s: float | None  # the frame's predicted cost at this tier and steps


@dataclass
class FrameScheduler:
    tiers: tuple[PreviewTier, ...] = TIERS
    cfg: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    level: int = 0  # index into tiers: 0 is the best
    switches: list[tuple[int, str, str]] = field(default_factory=list)  # (frame, from, to)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("tiers: at least one preview tier")
        self.units = CostWindow(self.cfg.window)  # seconds per step at the reference (best) tier
        self.frames = CostWindow(self.cfg.window)  # seconds per frame, since the last switch
        self.hold = Hold(self.cfg.hold_frames)
        self.frame_no = 0

    @property
    def tier(self) -> PreviewTier:
        return self.tiers[self.level]

    def _cost(self, tier: PreviewTier) -> float:
        return tier.cost(self.tiers[0].size)

    def record(self, frame_s: float, steps: int) -> None:
        """The last frame took ``frame_s`` seconds for ``steps`` steps at the current tier."""
        if steps < 1:
            raise ValueError(f"steps={steps}: a rendered frame has at least one step")
        self.units.add(frame_s / (steps * self._cost(self.tier)))
        self.frames.add(frame_s)

    def complexity(self, flow: float | None) -> float:
        """The share of the steps that fit a scene needs: ``min_complexity`` when still, 1 when
        its optical flow reaches ``flow_ref`` (None: unknown, counted as complex)."""
        if flow is None:
            return 1.0
        k = self.cfg.min_complexity
        return k + (1 - k) * min(1.0, max(0.0, flow) / self.cfg.flow_ref)

    def steps_for(self, tier: PreviewTier, flow: float | None = None) -> tuple[int, float | None]:
        unit = self.units.predict()
        if unit is None:
            return tier.min_steps, None  # no measurement yet: the cheapest frame of the tier
        step_s = unit * self._cost(tier)
        fit = math.floor(self.cfg.budget_s / step_s * self.complexity(flow) + 1e-9)
        steps = min(tier.max_steps, max(tier.min_steps, fit))
        return steps, steps * step_s

    def plan(self, flow: float | None = None) -> Plan:
        """The next frame's tier and steps (and whether to drop it)."""
        self.frame_no += 1
        self.hold.tick()
        b, c = self.cfg.budget_s, self.cfg
        mean = self.frames.mean()
        steps, predicted = self.steps_for(self.tier, flow)
        switched, reason = False, "on budget"
        if mean is not None and self.hold.ready:
            if mean > b * (1 + c.over) and steps == self.tier.min_steps and self.level + 1 < len(self.tiers):
                switched, reason = self._switch(self.level + 1, f"{mean:.3f} s a frame > budget {b:g} s + {c.over:.0%} "
                                                f"at the tier's fewest steps")
            elif mean < b * (1 - c.under) and self.level > 0:
                up = self.tiers[self.level - 1]
                up_steps, up_pred = self.steps_for(up, flow)
                if up_pred is not None and up_pred <= b:
                    switched, reason = self._switch(self.level - 1, f"{mean:.3f} s a frame < budget {b:g} s - "
                                                    f"{c.under:.0%}, and {up.name} fits ({up_pred:.3f} s)")
            if switched:
                steps, predicted = self.steps_for(self.tier, flow)
        elif mean is not None and not self.hold.ready:
            reason = f"holding {self.tier.name} for {self.hold.left} more frame(s)"
        drop = (self.level == len(self.tiers) - 1 and steps == self.tier.min_steps and predicted is not None
                and predicted > b * (1 + c.over))
        if drop:
            reason = f"{predicted:.3f} s predicted at the lowest tier's fewest steps > budget {b:g} s + {c.over:.0%}"
        return Plan(self.tier, steps, drop, switched, reason, predicted)

    def _switch(self, level: int, why: str) -> tuple[bool, str]:
        self.switches.append((self.frame_no, self.tier.name, self.tiers[level].name))
        self.level = level
        self.hold.changed()
        self.frames.clear()  # frame times of the old tier say nothing about the new one
        return True, f"{self.switches[-1][1]} -> {self.switches[-1][2]}: {why}"


def simulate(frames: int, step_cost: Callable[[int], float], scheduler: FrameScheduler | None = None,
             fixed_steps: int | None = None, flow: Callable[[int], float | None] = lambda i: None,
             overhead_s: float = 0.0) -> dict:
    """Run ``frames`` frames against a cost model: ``step_cost(i)`` seconds a step at the best
    tier for frame i (a load change is a change in it), plus ``overhead_s`` per frame. With
    ``fixed_steps``, every frame gets that many steps at the best tier (the baseline);
    otherwise ``scheduler`` plans each. Returns the frame intervals and their statistics."""
    sched = scheduler or FrameScheduler()
    ref = sched.tiers[0].size
    intervals, tiers_used, dropped = [], [], 0
    for i in range(frames):
        if fixed_steps is not None:
            tier, steps, drop = sched.tiers[0], fixed_steps, False
        else:
            p = sched.plan(flow(i))
            tier, steps, drop = p.tier, p.steps, p.drop
        cost = steps * step_cost(i) * tier.cost(ref) + overhead_s
        if drop:
            dropped += 1
        if fixed_steps is None:
            sched.record(cost, steps)
        intervals.append(cost)
        tiers_used.append(tier.name)
    srt = sorted(intervals)
    return {"intervals": intervals, "tiers": tiers_used, "dropped": dropped,
            "p50": median(intervals), "p95": srt[min(len(srt) - 1, int(math.ceil(0.95 * len(srt))) - 1)],
            "std": pstdev(intervals), "switches": list(sched.switches) if fixed_steps is None else []}
