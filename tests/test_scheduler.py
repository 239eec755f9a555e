"""The nightly tier scheduler against simulated step costs."""

from __future__ import annotations

import pytest

from clipmill.jobs.farm.scheduler import SchedulerConfig, TierScheduler, simulate


def test_enough_time_stays_at_quality():
    res = simulate(TierScheduler(), jobs_quality=40, jobs_fast=0, deadline_s=3600, workers=2, step_cost=lambda t: 1.0)
    assert res["done"] == {"quality": 40, "fast": 0} and res["left"] == 0
    assert res["decisions"] == [] and res["end_s"] <= 3600


def test_too_little_time_for_quality_switches_to_fast_and_makes_the_deadline():
    # 40 jobs x 8 steps x 1 s / 2 workers = 160 s at quality, 120 s at fast; deadline 140 s
    s = TierScheduler()
    res = simulate(s, jobs_quality=40, jobs_fast=0, deadline_s=140, workers=2, step_cost=lambda t: 1.0)
    assert res["left"] == 0 and res["end_s"] <= 140
    assert res["done"]["fast"] > 0 and res["done"]["quality"] > 0  # measured on quality groups first
    first = res["decisions"][0]
    assert first.tier == "fast" and first.changed and first.reason.startswith("quality needs ")


def test_slowdown_then_recovery_goes_fast_then_back_to_quality_after_the_hold():
    cfg = SchedulerConfig(window=8, hold_groups=3)
    s = TierScheduler(cfg)
    cost = lambda t: 3.0 if 100 <= t < 300 else 1.0  # noqa: E731 - a slow stretch (thermal throttling, a busy host)
    res = simulate(s, jobs_quality=120, jobs_fast=0, deadline_s=600, workers=2, step_cost=cost)
    tiers = [d.tier for d in res["decisions"]]
    assert tiers[:2] == ["fast", "quality"], [(d.tier, d.reason) for d in res["decisions"]]
    assert res["decisions"][0].time_left_s > 600 - 300  # it went fast during the slow stretch
    assert res["decisions"][1].time_left_s < 600 - 300  # and back to quality after it
    assert res["left"] == 0 and res["end_s"] <= 600


def test_hysteresis_limits_flapping_near_the_boundary():
    s = TierScheduler(SchedulerConfig(window=8, hold_groups=4))
    cost = lambda t: 1.0 if int(t / 20) % 2 == 0 else 1.3  # noqa: E731 - noisy costs around the boundary
    res = simulate(s, jobs_quality=200, jobs_fast=0, deadline_s=200 * 7.2 / 2, workers=2, step_cost=cost)
    assert len(res["decisions"]) <= 4
    for d in res["decisions"]:
        assert d.tier in ("quality", "fast")  # never below fast


def test_even_fast_too_slow_says_early_how_many_will_not_finish():
    s = TierScheduler()
    s.record("w0", seconds=32, steps=8, clips=4)  # 1 s per step per clip
    d = s.decide(time_left_s=600, quality_jobs=150, fast_jobs=50)
    assert d.tier == "fast" and d.will_miss > 0
    assert d.will_miss == 200 - int(600 / 1.1 / 6)
    assert "will not finish" in d.reason


def test_bad_measurement_is_refused():
    with pytest.raises(ValueError, match="seconds=0, steps=6, clips=4 must be positive"):
        TierScheduler().record("w", 0, 6, 4)
