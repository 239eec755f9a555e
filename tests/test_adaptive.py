"""The streaming preview's frame-time scheduler (pipeline.adaptive) and the window and hold it
shares with the nightly tier scheduler (pipeline.pacing): clamping, the complexity factor,
the order it answers load in, hysteresis, and frame-time stability against fixed steps."""

from __future__ import annotations

import time

import pytest

from clipmill.pipeline.adaptive import AdaptiveConfig, FrameScheduler, PreviewTier, simulate
from clipmill.pipeline.pacing import CostWindow, Hold, Pacer

TIERS = (PreviewTier("high", 64, 2, 8), PreviewTier("medium", 48, 1, 6), PreviewTier("low", 32, 1, 4))


def feed(s: FrameScheduler, step_s: float, n: int, flow=None):
    """n frames at ``step_s`` seconds a step at the best tier; the plans made."""
    plans = []
    for _ in range(n):
        p = s.plan(flow)
        plans.append(p)
        s.record(p.steps * step_s * p.tier.cost(64), p.steps)
    return plans


def test_the_window_reacts_to_a_slowdown_at_once_and_not_to_one_fast_sample():
    w = CostWindow(5)
    assert w.predict() is None
    for x in (1.0, 1.0, 1.0, 1.0, 0.2):
        w.add(x)
    assert w.predict() == 1.0  # one fast sample: the median holds
    w.add(3.0)
    assert w.predict() == pytest.approx((1.0 + 0.2 + 3.0) / 3)  # a slowdown: the last three's mean, at once
    with pytest.raises(ValueError, match="cost=0: a measured cost must be positive"):
        w.add(0)
    h = Hold(3)
    assert h.ready
    h.changed()
    assert not h.ready and h.left == 3
    for _ in range(3):
        h.tick()
    assert h.ready


def test_steps_are_budget_over_step_cost_clamped_to_the_tier():
    s = FrameScheduler(TIERS, AdaptiveConfig(budget_s=1.0))
    assert s.plan().steps == 2  # nothing measured yet: the tier's fewest
    assert feed(s, 0.01, 12)[-1].steps == 8  # cheap: clamped to max_steps
    s = FrameScheduler(TIERS, AdaptiveConfig(budget_s=1.0, hold_frames=1000))
    assert feed(s, 0.2, 12)[-1].steps == 5  # 1.0 / 0.2
    s = FrameScheduler(TIERS[:1], AdaptiveConfig(budget_s=1.0))
    assert feed(s, 2.0, 12)[-1].steps == 2  # dear: clamped to min_steps (no lower tier to go to)


def test_a_still_scene_gets_fewer_steps_than_a_moving_one():
    still = FrameScheduler(TIERS, AdaptiveConfig(budget_s=1.0))
    moving = FrameScheduler(TIERS, AdaptiveConfig(budget_s=1.0))
    assert feed(still, 0.125, 12, flow=0.0)[-1].steps == 4  # 8 fit, x 0.6
    assert feed(moving, 0.125, 12, flow=3.0)[-1].steps == 8
    assert still.complexity(None) == 1.0 and still.complexity(0.75) == pytest.approx(0.8)


def test_under_load_fewer_steps_first_then_a_lower_tier_then_dropped_frames():
    s = FrameScheduler(TIERS, AdaptiveConfig(budget_s=1.0))
    feed(s, 0.125, 15)
    assert s.tier.name == "high" and s.plan().steps == 8
    mild = feed(s, 0.25, 15)  # twice as dear: half the steps, the same tier
    assert {p.tier.name for p in mild} == {"high"} and mild[-1].steps == 4 and not s.switches
    heavy = feed(s, 1.0, 20)  # eight times: at 2 steps (its fewest) high is over budget: down
    assert s.switches and s.switches[0][1:] == ("high", "medium") and not any(p.drop for p in heavy)
    crushed = feed(s, 8.0, 40)  # far beyond: down to low, then frames are dropped
    assert s.tier.name == "low" and crushed[-1].drop and crushed[-1].steps == 1
    assert "lowest tier's fewest steps" in crushed[-1].reason


def test_no_switch_inside_the_hold_and_no_oscillation_around_a_threshold():
    cfg = AdaptiveConfig(budget_s=1.0, hold_frames=5)
    s = FrameScheduler(TIERS, cfg)
    feed(s, 0.6, 12)  # 2 steps at 0.6 = 1.2 s > 1.15: down to medium
    assert s.switches[0][1:] == ("high", "medium")
    at = s.switches[0][0]
    feed(s, 2.0, 4)  # over budget again at once, but inside the hold
    assert len(s.switches) == 1
    # costs that hover around the down threshold (steps at min, mean about 1.15) switch at most once
    s = FrameScheduler(TIERS, cfg)
    for k in range(120):
        feed(s, 0.56 if k % 2 else 0.6, 1)
    assert len(s.switches) <= 1, s.switches
    # and around the up threshold (0.75 x budget) a tier does not flap either
    s = FrameScheduler(TIERS, cfg, level=1)
    for k in range(120):
        feed(s, 0.37 if k % 2 else 0.4, 1)
    assert len(s.switches) <= 1, s.switches
    assert at > 0


def test_adaptive_steps_hold_the_budget_under_a_load_change_where_fixed_steps_do_not():
    """A stream of 400 frames whose step cost doubles for 100 frames in the middle (a second
    process takes a core): fixed steps blow the budget; the scheduler's P95 stays within 15% of
    it, the interval's standard deviation at least 3x lower, and at most 2 tier switches."""
    budget = 0.5
    cost = lambda i: 0.2 if 150 <= i < 250 else 0.1  # noqa: E731
    fixed = simulate(400, cost, FrameScheduler(cfg=AdaptiveConfig(budget_s=budget)), fixed_steps=4)
    adaptive = simulate(400, cost, FrameScheduler(cfg=AdaptiveConfig(budget_s=budget)))
    assert fixed["p95"] > budget * 1.15
    assert adaptive["p95"] <= budget * 1.15, adaptive["p95"]
    assert adaptive["std"] * 3 <= fixed["std"], (adaptive["std"], fixed["std"])
    assert len(adaptive["switches"]) <= 2 and adaptive["dropped"] == 0
    # a load five times as heavy needs a lower tier: down once, back up once, no flapping
    heavy = simulate(400, lambda i: 0.5 if 150 <= i < 250 else 0.1, FrameScheduler(cfg=AdaptiveConfig(budget_s=budget)))
    assert [(a, b) for _, a, b in heavy["switches"]] == [("high", "medium"), ("medium", "high")]
    assert heavy["p95"] <= budget * 1.15 * 2  # the few frames before the window sees the load


def test_bad_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"budget_s=0: the frame-time budget must be positive"):
        AdaptiveConfig(budget_s=0)
    with pytest.raises(ValueError, match=r"steps=0: a rendered frame has at least one step"):
        FrameScheduler().record(0.1, 0)


def test_the_pacer_spaces_items_by_its_interval_and_does_not_catch_up_after_a_late_one():
    p = Pacer(0.05)
    start = p.t_next
    first = p.delay()
    assert 0.04 < first <= 0.05  # the first goes out one interval after the start
    time.sleep(first)
    second = p.delay()  # asked at once after it: one more interval after the first's slot, so a
    # sleep that overran (a loaded machine) shortens this wait by as much
    assert 0 < second <= 0.05 and abs(time.perf_counter() + second - (start + 0.10)) < 0.005
    time.sleep(0.2)  # late: the next one goes now, and the one after one interval later, not in a burst
    assert p.delay() == 0.0
    assert 0.04 < p.delay() <= 0.05
