"""The adaptive tier scheduler for nightly runs, modelled on a frame-time controller.

It keeps a sliding window of measured seconds per denoising step (per clip) for each worker,
predicts whether the remaining work fits before the deadline, and moves jobs from `quality`
(8 steps) to `fast` (6 steps) when it does not, and back when there is time again. A tier holds
for at least ``hold_groups`` groups before it goes back up to `quality` (hysteresis; going
down to `fast` is never delayed, the deadline comes first), it never goes below
`fast`, and when even `fast` cannot make the deadline it says early how many jobs will not
finish. Pure logic: the caller feeds measurements and applies decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from clipmill.pipeline.choices import TIERS
from clipmill.pipeline.pacing import CostWindow, Hold

STEPS = {name: tier.steps for name, tier in TIERS.items()}
MAX_PREVIEW_SHARE = 0.9  # previews never count as taking more of the workers than this


@dataclass(frozen=True)
class SchedulerConfig:
    window: int = 10  # groups per worker in the sliding window (8-12 is the useful range)
    hold_groups: int = 3  # groups a tier holds before it may switch back
    margin: float = 1.10  # predicted time x margin must fit in the time left
    back_margin: float = 1.35  # ... and x this to go back to quality (a band, so it does not flap)


@dataclass
class Decision:
    tier: str  # the tier quality-tier jobs are rendered at now: "quality" or "fast"
    changed: bool
    reason: str
    predicted_s: float | None  # seconds the remaining work needs at the chosen tier
    time_left_s: float
    will_miss: int = 0  # jobs that cannot finish even at `fast`
    preview_share: float = 0.0  # the share of the workers' time counted as going to previews


@dataclass
class TierScheduler:
    cfg: SchedulerConfig = field(default_factory=SchedulerConfig)
    tier: str = "quality"
    samples: dict[str, CostWindow] = field(default_factory=dict)
    log: list[Decision] = field(default_factory=list)
    hold: Hold = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.hold is None:
            self.hold = Hold(self.cfg.hold_groups, since=0)

    @property
    def groups_since_switch(self) -> int:
        return self.hold.since

    def record(self, worker: str, seconds: float, steps: int, clips: int) -> None:
        """A finished group: ``seconds`` of rendering for ``clips`` clips of ``steps`` steps."""
        if seconds <= 0 or steps <= 0 or clips <= 0:
            raise ValueError(f"record(): seconds={seconds}, steps={steps}, clips={clips} must be positive")
        self.samples.setdefault(worker, CostWindow(self.cfg.window)).add(seconds / (steps * clips))
        self.hold.tick()

    def step_cost(self, workers: int, preview_share: float = 0.0) -> float | None:
        """Seconds per step per clip for the farm as a whole, shared by ``workers`` working in
        parallel, of which ``preview_share`` of the time goes to streaming previews (they are
        served first; at most ``MAX_PREVIEW_SHARE`` counts). Per worker, the larger of its
        window's median and the mean of its last three groups (``CostWindow.predict``): a
        slowdown counts at once, a single fast group does not."""
        if not 0.0 <= preview_share <= 1.0:
            raise ValueError(f"preview_share={preview_share}: a share of the workers' time, 0 to 1")
        per_worker = [w.predict() for w in self.samples.values() if len(w)]
        capacity = max(1, workers) * (1.0 - min(preview_share, MAX_PREVIEW_SHARE))
        return median(per_worker) / capacity if per_worker else None

    def decide(self, time_left_s: float, quality_jobs: int, fast_jobs: int, workers: int = 1,
               preview_share: float = 0.0) -> Decision:
        """Choose the tier for queued quality-tier jobs; ``quality_jobs`` are those that asked
        for `quality` (whatever they are set to now), ``fast_jobs`` those that asked for `fast`.
        ``preview_share``: the share of the render workers' time that previews took lately,
        expected to go on (see ``step_cost``)."""
        cost = self.step_cost(workers, preview_share)
        if cost is None:
            return self._keep(time_left_s, None, "no measurements yet")
        d = self._decide(cost, time_left_s, quality_jobs, fast_jobs)
        if preview_share > 0:
            d.reason += f"; previews take {100 * preview_share:.0f}% of the render workers' time"
        d.preview_share = preview_share
        return d

    def _decide(self, cost: float, time_left_s: float, quality_jobs: int, fast_jobs: int) -> Decision:
        need_q = cost * (quality_jobs * STEPS["quality"] + fast_jobs * STEPS["fast"])
        need_f = cost * (quality_jobs + fast_jobs) * STEPS["fast"]
        held = self.hold.ready
        if need_f * self.cfg.margin > time_left_s:
            fits = int(time_left_s / self.cfg.margin / (cost * STEPS["fast"]))
            miss = max(0, quality_jobs + fast_jobs - fits)
            d = self._switch("fast", time_left_s, need_f,
                             f"even fast needs {need_f:.0f} s for {quality_jobs + fast_jobs} jobs, {time_left_s:.0f} s left: "
                             f"about {miss} job(s) will not finish", force=True)
            d.will_miss = miss
            return d
        if self.tier == "quality" and need_q * self.cfg.margin > time_left_s:  # down at once: the deadline first
            return self._switch("fast", time_left_s, need_f,
                                f"quality needs {need_q:.0f} s, {time_left_s:.0f} s left (step {cost:.3f} s)", force=True)
        if self.tier == "fast" and need_q * self.cfg.back_margin <= time_left_s:
            return self._switch("quality", time_left_s, need_q,
                                f"quality needs {need_q:.0f} s, {time_left_s:.0f} s left: time again", force=held)
        return self._keep(time_left_s, need_q if self.tier == "quality" else need_f, "on track")

    def _keep(self, left: float, need: float | None, why: str) -> Decision:
        return Decision(self.tier, False, why, need, left)

    def _switch(self, tier: str, left: float, need: float, why: str, force: bool) -> Decision:
        if tier == self.tier:
            return Decision(tier, False, why, need, left)
        if not force:
            return Decision(self.tier, False, f"{why}; holding {self.tier} for "
                            f"{self.hold.left} more group(s)", need, left)
        self.tier = tier
        self.hold.changed()
        d = Decision(tier, True, why, need, left)
        self.log.append(d)
        return d


def simulate(scheduler: TierScheduler, jobs_quality: int, jobs_fast: int, deadline_s: float, workers: int,
             step_cost, group: int = 4) -> dict:
    """Drain a queue with simulated step costs (``step_cost(t)`` seconds per step per clip at
    time t); returns what finished, at which tiers, and the scheduler's decisions."""
    t, done = 0.0, {"quality": 0, "fast": 0}
    q, f = jobs_quality, jobs_fast
    free = [0.0] * workers
    while q + f > 0:
        w = min(range(workers), key=lambda i: free[i])
        t = free[w]
        if t >= deadline_s:
            break
        d = scheduler.decide(deadline_s - t, q, f, workers)
        take_q = min(q, group)
        take = take_q if take_q else min(f, group)
        tier = d.tier if take_q else "fast"
        steps = STEPS[tier]
        secs = step_cost(t) * steps * take
        free[w] = t + secs
        if take_q:
            q -= take
        else:
            f -= take
        done[tier] += take
        scheduler.record(f"w{w}", secs, steps, take)
    return {"done": done, "left": q + f, "end_s": max(free), "decisions": scheduler.log}
