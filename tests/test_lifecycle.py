"""Job lifecycle gaps (issue 10, section 3), each against real parts: real SQLite and PostgreSQL,
real storage folders, real tiny-model renders, real worker threads and processes.

- a storage error while writing raw frames moves the job on at once;
- a job cancelled during post-processing keeps no files;
- the embedded runner heartbeats its leases, and a heartbeat survives a database error;
- the nightly lock holds no transaction open, and SQLite refuses a second nightly run;
- one time-zone rule for `nightly --deadline` and beat;
- counting hooks come off the model after a bench row;
- an attempt lost with its worker does not cost the job its QC retry; lost attempts have a limit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy import event, select

from clipmill.jobs.core.batches import SubmitOptions, batch_status, submit
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from clipmill.jobs.core.queue import Heartbeat, claim_group, reclaim, worker_name
from clipmill.jobs.core.states import JobState, move_job
from clipmill.jobs.runner.embedded import run_batch
from clipmill.jobs.runner.stages import WorkerContext, post_attempt, render_group
from clipmill.qc import QCConfig
from services import hooks_on

REJECT_ALL = QCConfig(min_median_ssim=1.01)  # no clip's median SSIM reaches it: every render is rejected


def make_batch(db, tmp_path, rows=1, name="b", max_attempts=2, out=None):
    f = tmp_path / f"{name}.csv"
    f.write_text("prompt,size,frames,tier\n" + "".join(f'"dish {i}, orbit",64,8,fast\n' for i in range(rows)))
    return submit(db, f, SubmitOptions(batch=name, out=str(out or tmp_path / "out"), max_attempts=max_attempts))


def jobs_and_attempts(db):
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        attempts = s.scalars(select(Attempt).order_by(Attempt.job_id, Attempt.number)).all()
    return jobs, {j.id: [a for a in attempts if a.job_id == j.id] for j in jobs}


def dead_owner() -> str:
    """A worker name whose process has exited: its leases are stale at once."""
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return f"{socket.gethostname()}:{int(pid.stdout)}"


def wait_until(what, check, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    pytest.fail(f"{what}: not within {timeout} s")


# -- a storage error while writing raw frames ------------------------------------------------------

@pytest.mark.slow
def test_a_storage_error_writing_raw_frames_moves_the_job_on_at_once(db, tmp_path):
    """The storage root is real but cannot take the batch's files (its batch folder is a regular
    file, so every write under it fails with NotADirectoryError; the tests run as root, where a
    read-only folder would still be writable). The job does not sit in `rendering` until its lease
    expires: a failed write sends it back to queued while it has attempts left, then fails it
    with the reason."""
    out = (tmp_path / "out").resolve()
    out.mkdir()
    (out / "b").write_text("not a folder")
    res = make_batch(db, tmp_path, rows=2, max_attempts=2, out=out)
    ctx = WorkerContext(db)

    claimed = claim_group(db, "w:1", "b", size=2)
    assert render_group(ctx, [c.attempt_id for c in claimed]) == []
    jobs, by_job = jobs_and_attempts(db)
    assert [(j.state, j.lease_owner) for j in jobs] == [("queued", None)] * 2  # at once, not at lease expiry
    for j in jobs:
        (a,) = by_job[j.id]
        assert a.state == "failed" and a.raw_key is None
        assert f"storing the raw frames at b/{j.id}/a1.frames.npy in {out} failed: NotADirectoryError" in a.error

    stats = run_batch(ctx, "b", group_size=2)  # the second attempt: out of attempts, failed with the reason
    assert stats.rendered == 0
    jobs, by_job = jobs_and_attempts(db)
    assert [j.id for j in jobs] == res.job_ids
    for j in jobs:
        assert j.state == "failed" and j.attempts_made == 2
        assert j.error.startswith(f"storing the raw frames at b/{j.id}/a2.frames.npy in {out} failed: NotADirectoryError")
        assert [a.state for a in by_job[j.id]] == ["failed", "failed"]


# -- cancel during post-processing -----------------------------------------------------------------

def rendered_job(db, tmp_path, ctx):
    """One job rendered by a real group, its raw frames stored, waiting for post-processing."""
    res = make_batch(db, tmp_path, rows=1, max_attempts=1)
    (c,) = claim_group(db, "w:1", "b", size=1)
    assert render_group(ctx, [c.attempt_id]) == [c.attempt_id]
    folder = tmp_path / "out" / "b" / str(res.job_ids[0])
    assert sorted(p.name for p in folder.iterdir()) == ["a1.frames.npy"]
    return res.job_ids[0], c.attempt_id, folder


def test_a_job_cancelled_during_post_processing_keeps_no_files(pg_url, tmp_path):
    """The post stage has written clip, poster, contact sheet and sidecar when the job is
    cancelled; its final move then finds the job cancelled. It deletes every file of the attempt
    (raw frames included) and closes the attempt, instead of leaving them behind.

    Deterministic: the post stage's lease is taken first (as "post-1"), then the canceller holds
    the job row (SELECT FOR UPDATE) from before post-processing starts, so the post stage cannot
    record its verdict before the cancel commits. PostgreSQL only: SQLite takes its one write
    lock for every transaction, reads included, so a canceller holding it would stop the post
    stage before it starts, not at its end; the stage's code is the same on both."""
    from clipmill.jobs.core.queue import claim_post

    db = Database(pg_url)
    ctx = WorkerContext(db)
    jid, attempt_id, folder = rendered_job(db, tmp_path, ctx)
    verdict: list = []
    assert claim_post(db, jid, "post-1") == "claimed"
    with db.session() as s, s.begin():
        s.execute(select(Job.id).where(Job.id == jid).with_for_update())
        post = threading.Thread(target=lambda: verdict.append(post_attempt(ctx, attempt_id, owner="post-1")))
        post.start()
        wait_until("the sidecar written", lambda: (folder / "a1.json").exists(), timeout=120)
        assert post.is_alive()  # waiting for the row
        move_job(s, jid, JobState.POST, JobState.CANCELLED, lease_owner=None, lease_expires_at=None)  # cancel's move
    post.join(60)
    assert verdict == [None]
    assert list(folder.iterdir()) == []  # no clip, poster, sheet, sidecar or raw frames
    jobs, by_job = jobs_and_attempts(db)
    assert jobs[0].state == "cancelled"
    (a,) = by_job[jid]
    assert (a.state, a.error, a.clip_key, a.raw_key) == (
        "failed", "dropped: the job was cancelled during post-processing", None, None)
    db.dispose()


def test_cancel_cleans_the_files_of_rendered_and_rendering_attempts(db, tmp_path):
    """`clipmill cancel` after a render and before its post-processing (a farm whose post
    message is still queued, or an embedded run that died) deletes the raw frames and closes
    the attempt; a post stage that runs later does nothing and writes nothing. A job cancelled
    while rendering stores nothing either."""
    from clipmill.jobs.core.operations import cancel

    ctx = WorkerContext(db)
    jid, attempt_id, folder = rendered_job(db, tmp_path, ctx)
    assert cancel(db, str(jid)) == [jid]
    assert list(folder.iterdir()) == []
    assert post_attempt(ctx, attempt_id) is None
    assert list(folder.iterdir()) == []
    _, by_job = jobs_and_attempts(db)
    assert [(a.state, a.error) for a in by_job[jid]] == [("failed", "cancelled by an operator")]

    res = make_batch(db, tmp_path, rows=1, name="c", max_attempts=1)
    (c,) = claim_group(db, "w:1", "c", size=1)
    assert cancel(db, "c") == res.job_ids
    assert render_group(ctx, [c.attempt_id]) == []
    assert not (tmp_path / "out" / "c").exists() or not list((tmp_path / "out" / "c").rglob("*"))
    _, by_job = jobs_and_attempts(db)
    assert [a.state for a in by_job[res.job_ids[0]]] == ["failed"]


def test_cancel_deletes_the_files_of_the_jobs_earlier_attempts_too(db, tmp_path):
    """A job waiting for its QC retry holds its first attempt's clip, poster, sidecar and sheet
    (that attempt is closed, rejected): cancel deleted only the files of open attempts."""
    from clipmill.jobs.core.operations import cancel

    res = make_batch(db, tmp_path, rows=1, max_attempts=2)
    ctx = WorkerContext(db, qc_config=REJECT_ALL)
    (c,) = claim_group(db, "w:1", "b", size=1)
    render_group(ctx, [c.attempt_id])
    assert post_attempt(ctx, c.attempt_id) == "reject"
    folder = tmp_path / "out" / "b" / str(res.job_ids[0])
    jobs, _ = jobs_and_attempts(db)
    assert jobs[0].state == "queued" and sorted(p.name for p in folder.iterdir()) == [
        "a1.jpg", "a1.json", "a1.mp4", "a1.sheet.png"]
    assert cancel(db, "b") == res.job_ids
    assert list(folder.iterdir()) == []


# -- heartbeats ------------------------------------------------------------------------------------

class Steps:
    """Progress events of an embedded run (what the CLI's progress bar gets). At the first
    denoising step it waits until the group's first lease has run out, then lets a concurrent
    process take back what it can (what `run`, `nightly` and `reconcile` all do first)."""

    def __init__(self, db, url):
        self.db, self.url, self.taken_back, self.waited = db, url, None, False

    def group_started(self, size, steps): pass
    def rendered(self, n): pass
    def checked(self, verdict): pass
    def waiting(self, held): pass

    def step(self, done, total):
        if self.waited:
            return
        self.waited = True
        with self.db.session() as s:
            first_lease = min(s.scalars(select(Job.lease_expires_at).where(Job.state == "rendering")))
        if first_lease.tzinfo is None:
            first_lease = first_lease.replace(tzinfo=timezone.utc)
        while datetime.now(timezone.utc) <= first_lease:  # the render outlasts the lease it was claimed with
            time.sleep(0.05)
        time.sleep(0.5)
        other = Database(self.url)  # another process's pool
        try:
            self.taken_back = reclaim(other, "b")
        finally:
            other.dispose()


@pytest.mark.slow
def test_an_embedded_group_longer_than_its_lease_is_never_taken_back(db, tmp_path):
    make_batch(db, tmp_path, rows=2, max_attempts=1)
    events = Steps(db, db.url)
    stats = run_batch(WorkerContext(db, qc_config=REJECT_ALL), "b", group_size=2, events=events, lease_s=3)
    assert events.waited and events.taken_back == []
    jobs, by_job = jobs_and_attempts(db)
    assert stats.groups == 1 and stats.rendered == 2
    assert [(j.state, j.attempts_made, j.attempts_lost) for j in jobs] == [("rejected", 1, 0)] * 2
    assert all([a.state for a in by_job[j.id]] == ["rejected"] for j in jobs)


@pytest.fixture
def blocking(db_url):
    """A real transient database error for the heartbeat: another connection holds the job
    table's write lock, and the heartbeat's own connections give up waiting after 0.2 s
    (PostgreSQL: lock_timeout; SQLite: busy_timeout), as a database restarting or overloaded does."""
    if db_url.startswith("sqlite"):
        hb_db = Database(db_url, upgrade=False)

        @event.listens_for(hb_db.engine, "connect")
        def _short_wait(dbapi_conn, _record):
            dbapi_conn.execute("PRAGMA busy_timeout=200")

        def hold(s):
            s.execute(sa.text("UPDATE jobs SET priority = priority"))  # inside BEGIN IMMEDIATE: the write lock
    else:
        hb_db = Database(db_url.replace("options=", "options=-clock_timeout%3D200%20"), upgrade=False)

        def hold(s):
            s.execute(sa.text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
    yield hb_db, hold
    hb_db.dispose()


def test_a_heartbeat_survives_a_transient_database_error(db, tmp_path, blocking):
    hb_db, hold = blocking
    make_batch(db, tmp_path, rows=1)
    (c,) = claim_group(db, "w:1", "b", size=1, lease_s=60)

    def lease():
        with db.session() as s:
            return s.scalar(select(Job.lease_expires_at).where(Job.id == c.job_id))

    with Heartbeat(hb_db, [c.job_id], "w:1", lease_s=60, every=0.3) as hb:
        wait_until("a first renewal", lambda: hb.beats >= 1)
        with db.session() as s, s.begin():
            hold(s)
            wait_until("a renewal failing on the lock", lambda: hb.errors >= 1)
            before = s.scalar(select(Job.lease_expires_at).where(Job.id == c.job_id))
        assert hb.thread.is_alive()
        beats = hb.beats
        wait_until("renewals again once the database answers", lambda: hb.beats >= beats + 2)
    assert lease() > before


# -- the nightly lock ------------------------------------------------------------------------------

def test_the_nightly_lock_holds_no_transaction_open(pg_url):
    """The lock's session sits `idle`, not `idle in transaction`: a server that ends sessions
    idle in a transaction (here after 0.3 s) cannot drop it, and a second run is still refused
    long after that."""
    from clipmill.jobs.farm.nightly import NIGHTLY_LOCK, NightlyRunning, single_run

    strict = pg_url.replace("options=", "options=-cidle_in_transaction_session_timeout%3D300%20")
    # migrate on the ordinary URL: under load a migration can sit between statements longer than
    # the strict session's 0.3 s, and the server would end it there, which is not what is tested
    other = Database(pg_url)
    db = Database(strict, upgrade=False)
    try:
        with single_run(db):
            with other.session() as s:
                states = s.execute(sa.text(
                    "SELECT a.state FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.classid = :k AND l.granted "
                    "AND l.objid::int = hashtext(current_schema())"), {"k": NIGHTLY_LOCK}).scalars().all()
            assert states == ["idle"]
            time.sleep(1.0)  # past the server's timeout
            with pytest.raises(NightlyRunning, match="another nightly run is in progress on this database"):
                with single_run(other):
                    pass
        with single_run(other):  # released when the first run ends
            pass
    finally:
        db.dispose()
        other.dispose()


@pytest.mark.slow
def test_a_second_nightly_run_on_sqlite_is_refused(sqlite_url, tmp_path):
    from clipmill.jobs.farm.nightly import single_run

    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url)
    env.pop("CLIPMILL_BROKER_URL", None)
    args = [sys.executable, "-m", "clipmill.jobs.cli", "nightly", "--deadline", "+60", "--out", str(tmp_path / "out")]
    db = Database(sqlite_url)
    with single_run(db):
        proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        lock = tmp_path / "clipmill.db.nightly.lock"
        assert (f"another nightly run is in progress on this database (it holds {lock}); this one stops. "
                "On SQLite one nightly run works a database file at a time.") in proc.stderr
        assert "Traceback" not in proc.stderr
    proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # free again once the first run ended
    db.dispose()


# -- one time-zone rule ----------------------------------------------------------------------------

@pytest.mark.slow
def test_nightly_deadline_and_beat_use_one_time_zone(sqlite_url, tmp_path):
    """The host is in New York, CLIPMILL_TIMEZONE says Tokyo: `clipmill nightly --deadline 07:00`
    means 07:00 in Tokyo, the zone beat schedules CLIPMILL_NIGHTLY_AT in and the beat-started
    task reads its deadline in. Without CLIPMILL_TIMEZONE, both use the host's zone."""
    from zoneinfo import ZoneInfo

    from clipmill.jobs.core.settings import Settings
    from clipmill.jobs.farm.app import make_app
    from clipmill.jobs.farm.nightly import parse_deadline

    for zone, host in (("Asia/Tokyo", "America/New_York"), (None, "America/New_York")):
        env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url, TZ=host)
        env.pop("CLIPMILL_BROKER_URL", None)
        env.pop("CLIPMILL_TIMEZONE", None)
        if zone:
            env["CLIPMILL_TIMEZONE"] = zone
        script = ("from clipmill.jobs.core.settings import Settings; from clipmill.jobs.farm.app import make_app; "
                  "s = Settings.from_env(); print(make_app(s).conf.timezone)")
        beat_zone = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip()
        assert beat_zone == (zone or host)
        proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "nightly", "--deadline", "07:00", "--out",
                               str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        line = next(x for x in proc.stderr.splitlines() if x.startswith("nightly run until "))
        until = datetime.fromisoformat(line.split()[3])
        expected = parse_deadline("07:00", beat_zone)
        assert until.utcoffset() == expected.utcoffset() == datetime.now(ZoneInfo(beat_zone)).utcoffset()
        assert (until.hour, until.minute) == (7, 0)
    settings = Settings.from_env({"CLIPMILL_TIMEZONE": "Asia/Tokyo", "CLIPMILL_NIGHTLY_AT": "21:00"})
    app = make_app(settings)
    assert app.conf.timezone == settings.timezone == "Asia/Tokyo"
    with pytest.raises(ValueError, match="time zone 'Mars/Base': not a time zone name"):
        parse_deadline("07:00", "Mars/Base")


# -- counting hooks --------------------------------------------------------------------------------



@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-wan", "tiny"])
def test_counting_hooks_come_off_the_model_after_a_bench_row(model, tiny_cache):
    """A bench row counts the work it skips (DiT blocks run and skipped, K/V projections,
    DeepCache's blocks); the hooks that count are off the model when the row ends, and every
    speed layer's hooks when the renderer closes."""
    from clipmill.jobs.bench.ladder import ladder, requests, run_rows
    from clipmill.pipeline.models import model_info
    from clipmill.pipeline.render import Renderer

    info = model_info(model)
    frames = 9 if model == "tiny-wan" else 8
    renderer = Renderer(info)
    try:
        rows = {r.row: r for r in ladder(info, (64, 64), frames, 1.0, "none")}
        for key in ("2", "4"):  # plain 6 steps, then with the feature cache
            row = rows[key]
            row.clips = 1
            run_rows({False: renderer, True: renderer}, [row], requests(info, (64, 64), frames, 1), "cpu", repeat=1)
            counted = row.out["work"]
            if model == "tiny-wan":
                assert counted["blocks_run"] > 0  # the counters counted ...
            torch_hooks = [h for h in hooks_on(renderer.denoiser) if "_forward" in h]
            assert torch_hooks == []  # ... and are gone after the row
        if model == "tiny":
            assert row.out["work"]["blocks_skipped"] > 0  # DeepCache counted what it skipped
    finally:
        renderer.close()
    assert hooks_on(renderer.denoiser) == []


# -- lost attempts ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_attempt_lost_with_its_worker_does_not_cost_the_qc_retry(db, tmp_path):
    """max_attempts 2: attempt 1 dies with its worker (a dead process's lease), attempt 2 is
    rejected by QC, and the job still gets its QC retry at the quality tier (attempt 3)."""
    res = make_batch(db, tmp_path, rows=1, max_attempts=2)
    claim_group(db, dead_owner(), "b", size=1)
    stats = run_batch(WorkerContext(db, qc_config=REJECT_ALL), "b")
    assert stats.reclaimed == res.job_ids
    jobs, by_job = jobs_and_attempts(db)
    (job,) = jobs
    assert (job.state, job.attempts_made, job.attempts_lost) == ("rejected", 3, 1)
    assert [(a.number, a.state, a.tier) for a in by_job[job.id]] == [
        (1, "failed", "fast"), (2, "rejected", "fast"), (3, "rejected", "quality")]
    assert by_job[job.id][0].error.startswith("abandoned: worker ")
    row = batch_status(db, "b")["rows"][0]
    assert row["out_of_attempts"] and row["attempts_lost"] == 1


def test_a_lease_of_an_earlier_process_with_this_pid_is_taken_back(db, tmp_path):
    """A container restarted on the same host name runs its first process as pid 1 again: a
    crashed run's lease `host:1` would read as held by the resuming process itself. Worker names
    carry the process's start time, so the same pid started at another time is another process."""
    me = worker_name()
    host, _, rest = me.rpartition(":")
    pid, _, start = rest.partition(".")
    if not start:
        pytest.skip("this system has no /proc: worker names carry no start time")
    assert (host, pid) == (socket.gethostname(), str(os.getpid()))
    make_batch(db, tmp_path, rows=2)
    (earlier,) = claim_group(db, f"{host}:{pid}.{int(start) - 1}", "b", size=1)
    (mine,) = claim_group(db, me, "b", size=1)
    assert reclaim(db, "b") == [earlier.job_id]  # taken back at once, not when its lease expires
    jobs, _ = jobs_and_attempts(db)
    assert {j.id: (j.state, j.attempts_lost or 0) for j in jobs} == {
        earlier.job_id: ("queued", 1), mine.job_id: ("rendering", 0)}
    assert reclaim(db, "b") == []  # this process's own lease stands, as does one of the old form
    (old_form,) = claim_group(db, f"{host}:{pid}", "b", size=1)
    assert reclaim(db, "b") == [] and old_form.job_id == earlier.job_id


def test_a_job_that_keeps_losing_its_worker_fails_after_max_lost(db, tmp_path):
    """A poison job that kills its worker every time is not retried for ever: it is failed when
    it has lost the batch's max_lost attempts (3), whatever max_attempts (2) says, with the reason."""
    make_batch(db, tmp_path, rows=1, max_attempts=2)
    for n in (1, 2, 3):
        (c,) = claim_group(db, f"nohost.invalid:{n}", "b", size=1, lease_s=-1)  # a lease already expired
        assert reclaim(db, "b") == [c.job_id]
        jobs, by_job = jobs_and_attempts(db)
        assert (jobs[0].state, jobs[0].attempts_lost) == ("queued" if n < 3 else "failed", n)
    assert jobs[0].error == ("worker lost 3 times (max_lost 3): the job may kill its worker; "
                             "last worker nohost.invalid:3")
    assert [a.state for a in by_job[jobs[0].id]] == ["failed"] * 3
    assert claim_group(db, "w:1", "b") == []  # never claimed again


def test_max_lost_is_an_option_of_submit_and_run(sqlite_url, tmp_path, monkeypatch):
    """`--max-lost N` sets the batch's limit of attempts lost with their worker; status shows it."""
    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", sqlite_url)
    (tmp_path / "b.csv").write_text('prompt\n"a bowl of noodles, orbit"\n')
    res = CliRunner().invoke(main, ["submit", "b.csv", "--batch", "b", "--max-lost", "5", "--size", "64", "--frames", "8"])
    assert res.exit_code == 0, res.output
    status = CliRunner().invoke(main, ["status", "b", "--json"])
    assert json.loads(status.output)["max_lost"] == 5


# -- the post stage: one worker at a time, and a failed post keeps no files -------------------------

@pytest.mark.slow
def test_a_post_message_for_an_attempt_another_worker_is_checking_does_nothing(db, tmp_path):
    """A post message delivered twice (reconcile re-sends what waits): the second post worker
    used to encode, check and store under the same keys too, after the first had recorded its
    verdict (the encode is not bit-identical, so what was stored need not match the verdict)."""
    from clipmill.jobs.core.queue import claim_post

    make_batch(db, tmp_path, rows=1)
    ctx = WorkerContext(db)
    (c,) = claim_group(db, "w:1", "b", size=1)
    assert render_group(ctx, [c.attempt_id]) == [c.attempt_id]
    jobs, _ = jobs_and_attempts(db)
    assert (jobs[0].state, jobs[0].lease_owner) == ("post", None)  # the render lease ends with the render
    assert claim_post(db, c.job_id, "otherhost.invalid:7") == "claimed"  # a live worker elsewhere is checking it
    assert post_attempt(ctx, c.attempt_id) is None
    jobs, by_job = jobs_and_attempts(db)
    assert (jobs[0].state, by_job[c.job_id][0].state) == ("post", "rendered")
    assert not (tmp_path / "out" / "b" / str(c.job_id) / "a1.mp4").exists()
    with db.session() as s, s.begin():  # ... and then its lease ran out (a worker that died elsewhere)
        s.get(Job, c.job_id).lease_expires_at = datetime(2000, 1, 1, tzinfo=timezone.utc)
    assert post_attempt(ctx, c.attempt_id) in ("pass", "reject")
    jobs, _ = jobs_and_attempts(db)
    assert jobs[0].state in ("passed", "rejected", "queued") and jobs[0].lease_owner is None


@pytest.mark.slow
def test_a_post_that_fails_part_way_keeps_none_of_its_files(db, tmp_path):
    """A storage error after the clip and poster were written (the contact sheet's key is a
    folder here): the attempt fails, and its clip, poster and raw frames are deleted, not left
    for good (cancel only cleans open attempts)."""
    make_batch(db, tmp_path, rows=1, max_attempts=2)
    ctx = WorkerContext(db)
    (c,) = claim_group(db, "w:1", "b", size=1)
    render_group(ctx, [c.attempt_id])
    folder = tmp_path / "out" / "b" / str(c.job_id)
    (folder / "a1.sheet.png").mkdir()
    assert post_attempt(ctx, c.attempt_id) is None
    jobs, by_job = jobs_and_attempts(db)
    assert (jobs[0].state, by_job[c.job_id][0].state) == ("queued", "failed")
    assert "a1.sheet.png" in by_job[c.job_id][0].error or "IsADirectoryError" in by_job[c.job_id][0].error
    assert sorted(p.name for p in folder.iterdir()) == ["a1.sheet.png"]  # only what was in the way


# -- a run beside another worker holding jobs of its batch ------------------------------------------

class Waits:
    def __init__(self):
        self.held: list[int] = []
        self.waited = threading.Event()

    def group_started(self, size, steps): pass
    def step(self, done, total): pass
    def rendered(self, n): pass
    def checked(self, verdict): pass

    def waiting(self, held):
        self.held.append(held)
        self.waited.set()


@pytest.mark.slow
def test_a_run_waits_for_the_jobs_another_live_worker_holds_then_ends(db, tmp_path):
    """Before, a run that found nothing to claim ended (exit 0, the summary saying "still open")
    while another live worker still rendered jobs of its batch: a script's `run --resume B &&
    export B` then delivered a partial batch. It now waits until that worker's jobs are done."""
    make_batch(db, tmp_path, rows=3, max_attempts=1)
    ctx = WorkerContext(db, qc_config=REJECT_ALL)
    other = "elsewhere:4242.1"  # a live worker on another host: only its lease's expiry would free its jobs
    (held,) = claim_group(db, other, "b", size=1, lease_s=300)

    events = Waits()

    def the_other_worker():  # finishes once the run has said it waits for it (a fixed sleep lost the race on a loaded machine)
        assert events.waited.wait(120)
        (done,) = render_group(ctx, [held.attempt_id])
        post_attempt(ctx, done, owner=other)

    t = threading.Thread(target=the_other_worker)
    t.start()
    stats = run_batch(ctx, "b", group_size=2, events=events, poll_s=0.1)
    t.join()
    jobs, by_job = jobs_and_attempts(db)
    assert stats.rendered == 2 and stats.reclaimed == []
    assert events.held and set(events.held) == {1}  # the other worker's job, waited for
    assert [j.state for j in jobs] == ["rejected"] * 3 and all(len(a) == 1 for a in by_job.values())
    assert batch_status(db, "b")["states"]["queued"] == 0


@pytest.mark.slow
def test_a_run_waiting_on_a_worker_that_died_takes_its_job_back_when_the_lease_runs_out(db, tmp_path):
    make_batch(db, tmp_path, rows=2, max_attempts=1)
    (held,) = claim_group(db, "elsewhere:4242.1", "b", size=1, lease_s=2)  # a remote worker that then died
    events = Waits()
    stats = run_batch(WorkerContext(db, qc_config=REJECT_ALL), "b", group_size=2, events=events, poll_s=0.2)
    jobs, by_job = jobs_and_attempts(db)
    assert stats.reclaimed == [held.job_id] and stats.rendered == 2 and events.held
    assert [j.state for j in jobs] == ["rejected"] * 2
    lost = by_job[held.job_id]
    assert [a.state for a in lost] == ["failed", "rejected"] and "abandoned: worker elsewhere:4242.1" in lost[0].error


def test_a_post_stage_whose_lease_another_worker_took_stores_and_deletes_nothing(db, tmp_path):
    """A post stage that ran past its lease (nothing renewed it) while another worker took the
    attempt over and delivered it then failed on the raw frames that worker had deleted, and its
    error path deleted the delivered clip. Now a live post stage's lease is renewed as a render's
    is, one that lost it anyway stores nothing, and a failure on an attempt another worker
    finished deletes nothing."""
    from clipmill.jobs.core.queue import holds_post

    make_batch(db, tmp_path, rows=1, max_attempts=1)
    ctx = WorkerContext(db, qc_config=REJECT_ALL)
    (c,) = claim_group(db, "me:1", "b", size=1)
    (done,) = render_group(ctx, [c.attempt_id])
    got = []
    a = threading.Thread(target=lambda: got.append(post_attempt(ctx, done, owner="host-a:1")))
    a.start()

    def held_by(owner):
        with db.session() as s:
            return s.get(Job, c.job_id).lease_owner == owner

    wait_until("A's post lease", lambda: held_by("host-a:1"), 30)
    with db.session() as s, s.begin():  # B takes it over, as claim_post does once A's lease has run out
        s.get(Job, c.job_id).lease_owner = "host-b:1"
    a.join(60)
    out = tmp_path / "out"
    assert got == [None] and not list(out.rglob("*.mp4"))  # A stored nothing
    with db.session() as s:
        assert s.get(Attempt, done).state == "rendered"  # and left the attempt to B
    assert holds_post(db, c.job_id, "host-b:1") and not holds_post(db, c.job_id, "host-a:1")
    assert post_attempt(ctx, done, owner="host-b:1") == "reject"
    clips = list(out.rglob("*.mp4"))
    assert len(clips) == 1 and not list(out.rglob("*.frames.npy"))

    from clipmill.jobs.runner.stages import _fail
    assert _fail(db, done, "a late failure of A") is False  # B's verdict stands
    assert clips[0].exists()


def test_a_post_worker_that_dies_loses_an_attempt_and_the_job_fails_at_max_lost(db, tmp_path):
    """A post worker killed after it took the post lease was taken over without a word: a clip
    that kills its post worker was sent round for ever. Each takeover now counts a lost attempt,
    and at the batch's max_lost the job fails, naming the last worker; its raw frames go."""
    from clipmill.jobs.core.queue import claim_post

    make_batch(db, tmp_path, rows=1, max_attempts=1)  # max_lost 3
    ctx = WorkerContext(db, qc_config=REJECT_ALL)
    (c,) = claim_group(db, "me:1", "b", size=1)
    (done,) = render_group(ctx, [c.attempt_id])
    for k in (0, 1, 2):  # three post workers take it in turn, each then killed (its process gone)
        dead = dead_owner()
        assert claim_post(db, c.job_id, dead, lease_s=60) == "claimed"
        with db.session() as s:
            job = s.get(Job, c.job_id)
            assert (job.state, job.attempts_lost) == ("post", k)
    assert post_attempt(ctx, done, owner="me:3") is None  # the third loss: failed, not taken
    jobs, by_job = jobs_and_attempts(db)
    assert (jobs[0].state, jobs[0].attempts_lost) == ("failed", 3)
    assert jobs[0].error == (f"post worker lost 3 times (max_lost 3): the clip may kill its post worker; last worker "
                             f"{dead}")
    assert [a.state for a in by_job[c.job_id]] == ["failed"]
    assert not list((tmp_path / "out").rglob("*.frames.npy"))


def test_the_raw_frames_a_killed_render_stored_are_swept_when_the_job_is_delivered(db, tmp_path):
    """A render worker killed after it stored an attempt's raw frames but before it recorded
    them left ``a1.frames.npy`` behind for good, though the job was delivered by attempt 2."""
    make_batch(db, tmp_path, rows=1, max_attempts=1)
    (held,) = claim_group(db, dead_owner(), "b", size=1)  # a worker that then died
    orphan = tmp_path / "out" / "b" / str(held.job_id) / "a1.frames.npy"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"raw frames nobody recorded")
    stats = run_batch(WorkerContext(db, qc_config=REJECT_ALL), "b", group_size=1, events=Waits(), poll_s=0.1)
    jobs, by_job = jobs_and_attempts(db)
    assert stats.reclaimed == [held.job_id] and [a.state for a in by_job[held.job_id]] == ["failed", "rejected"]
    assert not orphan.exists() and not list((tmp_path / "out").rglob("*.frames.npy"))
    assert (orphan.parent / "a2.mp4").exists()


def test_the_raw_frames_killed_renders_stored_are_swept_when_the_job_fails_at_max_lost(db, tmp_path):
    """A job failed by reclaim at its max_lost kept what its killed renders had stored
    (``a1.frames.npy`` ... ``a3.frames.npy``) for good: the sweep ran only when a clip was stored."""
    make_batch(db, tmp_path, rows=1, max_attempts=2)
    out = tmp_path / "out" / "b"
    for n in (1, 2, 3):
        (c,) = claim_group(db, f"nohost.invalid:{n}", "b", size=1, lease_s=-1)  # a lease already expired
        orphan = out / str(c.job_id) / f"a{n}.frames.npy"
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"raw frames nobody recorded")
        assert reclaim(db, "b") == [c.job_id]
        assert orphan.exists() == (n < 3)  # kept while the job may still deliver; nothing of it is used
    jobs, _ = jobs_and_attempts(db)
    assert jobs[0].state == "failed" and not [p for p in out.rglob("*") if p.is_file()]


def test_the_raw_frames_a_killed_render_stored_are_swept_when_the_job_fails_on_an_error(db, tmp_path):
    """The same for a job whose later attempt fails with no attempts left (a render or post error)."""
    from clipmill.jobs.runner.stages import _fail

    make_batch(db, tmp_path, rows=1, max_attempts=1)
    (held,) = claim_group(db, dead_owner(), "b", size=1)  # a worker that then died
    orphan = tmp_path / "out" / "b" / str(held.job_id) / "a1.frames.npy"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"raw frames nobody recorded")
    assert reclaim(db, "b") == [held.job_id]
    (again,) = claim_group(db, "me:1", "b", size=1)
    assert _fail(db, again.attempt_id, "Traceback ...\nRuntimeError: the render failed") is True
    jobs, by_job = jobs_and_attempts(db)
    assert (jobs[0].state, jobs[0].error) == ("failed", "RuntimeError: the render failed")
    assert [a.state for a in by_job[held.job_id]] == ["failed", "failed"] and not orphan.exists()


def test_a_post_stage_hung_in_a_live_process_loses_its_lease_past_its_limit(db, tmp_path):
    """A post stage hung for good (a write that never returns) in a live process kept its job's
    lease renewed for ever, and the job sat in `post` for ever. Past the heartbeat's limit its
    renewals stop; once the lease runs out another worker takes the job over (a lost attempt),
    and the hung one, should it go on, stores nothing."""
    from clipmill.jobs.core.queue import claim_post, holds_post

    make_batch(db, tmp_path, rows=1, max_attempts=1)
    ctx = WorkerContext(db, qc_config=REJECT_ALL)
    (c,) = claim_group(db, "me:1", "b", size=1)
    (done,) = render_group(ctx, [c.attempt_id])
    hung = worker_name() + "/hung"  # this (live) process
    assert claim_post(db, c.job_id, hung, lease_s=3.0) == "claimed"
    with Heartbeat(db, [c.job_id], hung, lease_s=3.0, every=0.1, state=JobState.POST, max_s=0.5) as hb:
        assert claim_post(db, c.job_id, "other:1") == "busy"  # renewed while under its limit
        wait_until("the heartbeat giving up", lambda: hb.gave_up, 30)
        beats = hb.beats
        wait_until("the lease running out", lambda: claim_post(db, c.job_id, "other:1") == "claimed", 30)
        assert hb.beats == beats and hb.thread.is_alive() is False
    with db.session() as s:
        job = s.get(Job, c.job_id)
        assert (job.state, job.lease_owner, job.attempts_lost) == ("post", "other:1", 1)
    assert not holds_post(db, c.job_id, hung)
    assert post_attempt(ctx, done, owner="other:1") == "reject"
