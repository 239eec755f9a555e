"""`clipmill nightly` end to end on the tiny model (embedded), and deadline parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from clipmill.jobs.farm.nightly import parse_deadline


def test_parse_deadline():
    now = datetime(2026, 11, 29, 22, 0, tzinfo=timezone.utc)
    assert parse_deadline("07:00", "UTC", now) == datetime(2026, 11, 30, 7, 0, tzinfo=timezone.utc)
    assert parse_deadline("23:30", "UTC", now) == datetime(2026, 11, 29, 23, 30, tzinfo=timezone.utc)
    assert parse_deadline("+90", "UTC", now) == now + timedelta(seconds=90)
    with pytest.raises(ValueError, match="--deadline '25:00': not a time of day"):
        parse_deadline("25:00", "UTC", now)
    with pytest.raises(ValueError, match="--deadline 'soon': allowed HH:MM, \\+SECONDS or an ISO date-time"):
        parse_deadline("soon", "UTC", now)


def run(env, cwd, *args):
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_nightly_drains_the_queue_and_writes_the_morning_report(sqlite_url, tmp_path):
    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url)
    env.pop("CLIPMILL_BROKER_URL", None)
    (tmp_path / "n.csv").write_text("prompt,tier\n" + "".join(f'"dish {i}, orbit",quality\n' for i in range(6)))
    run(env, tmp_path, "submit", "n.csv", "--batch", "n", "--out", str(tmp_path / "out"), "--size", "64", "--frames", "8",
        "--max-attempts", "1")
    res = run(env, tmp_path, "nightly", "--deadline", "+3600", "--out", str(tmp_path / "out"))
    assert "not finished 0" in res.stdout
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    report = json.loads((tmp_path / "out" / "reports" / f"nightly-{day}.json").read_text())
    assert report["attempts"] == 6 and report["clips_produced"] == 6 and report["not_finished"] == 0
    assert report["passed"] + report["rejected"] + report["failed"] == 6
    assert report["tier_changes"] == []  # an hour is plenty: every job kept its quality tier
    assert len(report["failures"]) == report["rejected"] + report["failed"]
    md = (tmp_path / "out" / "reports" / f"nightly-{day}.md").read_text()
    assert md.startswith(f"# clipmill nightly report, {day}") and "## Tier changes" in md
    db = Database(sqlite_url)
    with db.session() as s:
        assert {a.tier for a in s.scalars(select(Attempt))} == {"quality"}
    db.dispose()


def test_supervisor_moves_queued_quality_jobs_to_fast_and_back(db, tmp_path):
    """Groups measured at 1 s per step per clip; 20 quality jobs queued: with 100 s left they
    do not fit at quality (160 s) but do at fast (120 s > 100: even fast is short: will_miss),
    with an hour left they all go back to quality."""
    from clipmill.jobs.core.batches import SubmitOptions, submit
    from clipmill.jobs.farm.nightly import Supervisor
    from clipmill.jobs.core.queue import claim_group

    f = tmp_path / "q.csv"
    f.write_text("prompt,tier\n" + "".join(f'"dish {i}, orbit",quality\n' for i in range(24)))
    submit(db, f, SubmitOptions(batch="q", out=str(tmp_path / "out")))
    sup = Supervisor(db, datetime.now(timezone.utc) + timedelta(seconds=100))
    claimed = claim_group(db, "gpu-host:1", "q", size=4)  # one group of 4, "rendered" in 32 s
    with db.session() as s, s.begin():
        for c in claimed:
            s.get(Attempt, c.attempt_id).timings = {"denoise_s": 8.0, "render_s": 8.5}
    d = sup.step(workers=1)
    assert d.tier == "fast" and d.changed and d.will_miss > 0
    with db.session() as s:
        queued = s.scalars(select(Job).where(Job.state == "queued")).all()
    assert len(queued) == 20 and {(j.tier, j.tier_requested) for j in queued} == {("fast", "quality")}
    assert sup.changes[0]["tier"] == "fast" and "will not finish" in sup.changes[0]["reason"]

    sup.deadline = datetime.now(timezone.utc) + timedelta(hours=1)
    sup.scheduler.hold.since = sup.cfg.hold_groups  # the hold has passed
    d = sup.step(workers=1)
    assert d.tier == "quality" and d.changed
    with db.session() as s:
        assert {j.tier for j in s.scalars(select(Job).where(Job.state == "queued"))} == {"quality"}
    report = sup.report()
    assert [c["tier"] for c in report["tier_changes"]] == ["fast", "quality"]
    assert report["attempts"] == 4 and report["not_finished"] == 24


def test_a_second_nightly_run_on_the_same_postgresql_table_stops_at_once(pg_url, tmp_path):
    """One nightly per job table: while one holds the lock, another (a second beat, or one by
    hand) exits with the reason instead of making tier decisions against the first."""
    from clipmill.jobs.farm.nightly import single_run

    env = dict(os.environ, CLIPMILL_DATABASE_URL=pg_url)
    env.pop("CLIPMILL_BROKER_URL", None)
    db = Database(pg_url)
    with single_run(db):  # the first run's lock
        proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "nightly", "--deadline", "+60", "--out",
                               str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3  # setup: the lock is held
        assert "another nightly run is in progress on this database" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "nightly", "--deadline", "+60", "--out",
                           str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # free again: an empty queue drains at once
    assert "not finished 0" in proc.stdout
    db.dispose()


def test_supervisor_counts_the_render_time_previews_took(db, tmp_path):
    """Groups measured at 1 s per step per clip, 20 quality jobs queued (160 s at quality, 120 s
    at fast) and 300 s left: quality fits. Previews then held the one worker for 15 of the last
    30 minutes (one ended, one still streaming): half the worker is gone, quality needs 320 s
    and the supervisor moves the queue to fast (240 s), saying why; the report counts the
    previews' seconds. A preview row whose worker died counts no longer than the time limit."""
    from clipmill.jobs.core.batches import SubmitOptions, submit
    from clipmill.jobs.core.models import PreviewSession
    from clipmill.jobs.core.queue import claim_group
    from clipmill.jobs.farm.nightly import Supervisor, preview_seconds

    f = tmp_path / "q.csv"
    f.write_text("prompt,tier\n" + "".join(f'"dish {i}, orbit",quality\n' for i in range(24)))
    submit(db, f, SubmitOptions(batch="q", out=str(tmp_path / "out")))
    sup = Supervisor(db, datetime.now(timezone.utc) + timedelta(seconds=300), preview_max_s=600)
    claimed = claim_group(db, "gpu-host:1", "q", size=4)
    with db.session() as s, s.begin():
        for c in claimed:
            s.get(Attempt, c.attempt_id).timings = {"denoise_s": 8.0, "render_s": 8.5}
    d = sup.step(workers=1)
    assert (d.tier, d.changed, d.preview_share) == ("quality", False, 0.0)

    now = datetime.now(timezone.utc)
    with db.session() as s, s.begin():
        s.add(PreviewSession(id="a", model="shapes", mode="farm", worker="gpu-host:1",
                             started_at=now - timedelta(minutes=40), ended_at=now - timedelta(minutes=20)))  # 10 min in
        s.add(PreviewSession(id="b", model="shapes", mode="farm", worker="gpu-host:1",
                             started_at=now - timedelta(minutes=5)))  # streaming now: 5 min
        s.add(PreviewSession(id="c", model="shapes", mode="farm"))  # asked for, never started: nothing
    assert preview_seconds(db, now - timedelta(minutes=30), now, 600) == pytest.approx(900, abs=2)
    d = sup.step(workers=1)
    assert d.tier == "fast" and d.changed and d.will_miss == 0
    assert d.preview_share == pytest.approx(0.5, abs=0.01)
    assert "previews take 50% of the render workers' time" in d.reason
    assert sup.changes[-1]["preview_share"] == pytest.approx(0.5, abs=0.01)
    # the same rows over two workers: a quarter of the farm, and quality fits again (after the hold)
    sup.scheduler.hold.since = sup.cfg.hold_groups
    sup.deadline = datetime.now(timezone.utc) + timedelta(seconds=400)
    assert sup.step(workers=2).tier == "quality"
    # a row left open by a worker that died an hour ago counts up to its time limit only
    with db.session() as s, s.begin():
        s.add(PreviewSession(id="d", model="shapes", mode="farm", worker="gone:2", started_at=now - timedelta(hours=2)))
    assert preview_seconds(db, now - timedelta(hours=3), now, 600) == pytest.approx(1200 + 300 + 600, abs=2)
    sup.started = now - timedelta(minutes=10)  # the report counts the previews' time since the run started: b's
    assert sup.report()["preview_seconds"] == pytest.approx(300, abs=5)


def test_a_preview_row_a_dead_worker_left_open_stops_counting_soon_after_it_was_last_seen(db):
    """With no preview time limit (CLIPMILL_PREVIEW_MAX=0), a row whose worker died counted up to
    "now" for ever: the nightly scheduler saw previews take a whole worker all night. A worker
    marks its row seen every 10 s as it streams (jobs.review.preview.Seen); a row not seen for a
    minute is counted up to then, with or without a time limit. A row from before the mark is
    counted as before."""
    from clipmill.jobs.core.models import PreviewSession
    from clipmill.jobs.farm.nightly import SEEN_LOST_S, preview_seconds
    from clipmill.jobs.review.preview import Seen, record_end, record_open

    now = datetime.now(timezone.utc)
    ago = lambda **kw: now - timedelta(**kw)  # noqa: E731
    with db.session() as s, s.begin():
        s.add(PreviewSession(id="live", model="m", mode="farm", worker="w:1", started_at=ago(minutes=20),
                             seen_at=ago(seconds=5)))
        s.add(PreviewSession(id="dead", model="m", mode="farm", worker="w:2", started_at=ago(hours=2),
                             seen_at=ago(minutes=100)))  # streamed 20 min, then its worker died
        s.add(PreviewSession(id="old", model="m", mode="farm", worker="w:3", started_at=ago(minutes=50)))
    assert SEEN_LOST_S == 60
    assert preview_seconds(db, ago(hours=3), now, 0) == pytest.approx(1200 + (1200 + 60) + 3000, abs=2)
    assert preview_seconds(db, ago(hours=3), now, 600) == pytest.approx(600 + 600 + 600, abs=2)

    record_open(db, "mine", "m", "embedded", worker="w:4")  # started and seen now
    with db.session() as s:
        first = s.get(PreviewSession, "mine").seen_at
    assert first is not None
    seen = Seen(db, "mine", every_s=3600)
    seen()  # the first call marks it
    seen()  # then not again within every_s
    with db.session() as s:
        marked = s.get(PreviewSession, "mine").seen_at
    assert marked > first
    record_end(db, "mine", 10, "the page closed")
    Seen(db, "mine")()  # an ended row is left as it is
    with db.session() as s:
        assert s.get(PreviewSession, "mine").seen_at == marked


@pytest.mark.slow
def test_an_embedded_nightly_run_checks_with_the_qc_config_the_environment_names(sqlite_url, tmp_path):
    """Before, `nightly` without a broker built its worker with the default thresholds: with
    CLIPMILL_QC_CONFIG set, every clip was checked against other limits than the farm's."""
    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url)
    env.pop("CLIPMILL_BROKER_URL", None)
    (tmp_path / "strict.toml").write_text("[qc]\nblack_luma = 255\nblack_spread = 255\n")  # every frame reads black
    (tmp_path / "n.csv").write_text("prompt\n" + "".join(f'"dish {i}, orbit"\n' for i in range(2)))
    run(env, tmp_path, "submit", "n.csv", "--batch", "n", "--out", str(tmp_path / "out"), "--size", "64", "--frames", "8",
        "--max-attempts", "1")
    bad = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "nightly", "--deadline", "+3600"], cwd=tmp_path,
                         env=dict(env, CLIPMILL_QC_CONFIG=str(tmp_path / "nope.toml")), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2, bad.stderr  # it was a traceback: the farm's app read the variable on import
    assert bad.stderr.strip() == (f"Error: CLIPMILL_QC_CONFIG={str(tmp_path / 'nope.toml')!r}: no such file; expected a "
                                  "TOML file of QC thresholds")
    run(dict(env, CLIPMILL_QC_CONFIG=str(tmp_path / "strict.toml")), tmp_path, "nightly", "--deadline", "+3600",
        "--out", str(tmp_path / "out"))
    db = Database(sqlite_url)
    with db.session() as s:
        reasons = [a.reasons for a in s.scalars(select(Attempt).order_by(Attempt.id))]
    db.dispose()
    assert len(reasons) == 2
    assert all(any(r.startswith("flat: frames 0-9 (black throughout: mean luma at most") and r.endswith("< 255)")
                   for r in rs) for rs in reasons), reasons
