"""State moves: the table is the law, and every move is a compare-and-set."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from clipmill.jobs.core.batches import SubmitOptions, submit
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from clipmill.jobs.core.queue import claim_group, reclaim
from clipmill.jobs.core.states import JOB_MOVES, IllegalMove, JobState, MoveConflict, move_job


def make_batch(db, tmp_path, rows=1, name="b"):
    f = tmp_path / f"{name}.csv"
    f.write_text("prompt,size,frames\n" + "".join(f'"clip {i}, orbit",64,8\n' for i in range(rows)))
    return submit(db, f, SubmitOptions(batch=name, out=str(tmp_path / "out")))


def test_every_state_has_a_row_in_the_table():
    assert set(JOB_MOVES) == set(JobState)


def test_legal_move_bumps_version(db, tmp_path):
    res = make_batch(db, tmp_path)
    with db.session() as s, s.begin():
        move_job(s, res.job_ids[0], JobState.QUEUED, JobState.CANCELLED)
    with db.session() as s:
        job = s.get(Job, res.job_ids[0])
        assert (job.state, job.version) == ("cancelled", 1)


def test_illegal_move_is_refused_with_the_allowed_moves(db, tmp_path):
    res = make_batch(db, tmp_path)
    with db.session() as s, s.begin():
        with pytest.raises(IllegalMove) as e:
            move_job(s, res.job_ids[0], JobState.QUEUED, JobState.PASSED)
    assert str(e.value) == (
        f"job {res.job_ids[0]}: queued -> passed is not a legal move; from queued: cancelled, rendering"
    )


def test_stale_move_conflicts(db, tmp_path):
    res = make_batch(db, tmp_path)
    jid = res.job_ids[0]
    with db.session() as s, s.begin():
        move_job(s, jid, JobState.QUEUED, JobState.RENDERING)
    with db.session() as s, s.begin():
        with pytest.raises(MoveConflict, match=f"job {jid}: not in state queued; another process moved it"):
            move_job(s, jid, JobState.QUEUED, JobState.RENDERING)


def test_two_processes_race_for_one_job_exactly_one_wins(db_url, tmp_path):
    """Two engines (separate connection pools, as two processes have) claim at the same time."""
    setup = Database(db_url)
    make_batch(setup, tmp_path, rows=1)
    setup.dispose()
    for _round in range(1):
        dbs = [Database(db_url, upgrade=False) for _ in range(2)]
        barrier = threading.Barrier(2)
        results: list[list] = [[], []]

        def claim(i):
            barrier.wait()
            results[i] = claim_group(dbs[i], f"worker-{i}", "b", size=4)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(len(r) for r in results) == [0, 1]
        with dbs[0].session() as s:
            attempts = s.scalars(select(Attempt)).all()
            job = s.scalars(select(Job)).one()
        assert len(attempts) == 1 and job.state == "rendering" and job.attempts_made == 1
        winner = [i for i in range(2) if results[i]][0]
        assert job.lease_owner == f"worker-{winner}"
        for d in dbs:
            d.dispose()


def test_many_claimers_share_a_batch_without_overlap(db_url, tmp_path):
    setup = Database(db_url)
    make_batch(setup, tmp_path, rows=12)
    setup.dispose()
    dbs = [Database(db_url, upgrade=False) for _ in range(3)]
    got: list[list[int]] = [[], [], []]

    def work(i):
        while True:
            c = claim_group(dbs[i], f"w{i}", "b", size=2)
            if not c:
                return
            got[i].extend(x.job_id for x in c)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = sorted(j for g in got for j in g)
    assert len(all_ids) == 12 and len(set(all_ids)) == 12
    for d in dbs:
        d.dispose()


def test_groups_only_join_compatible_jobs(db, tmp_path):
    f = tmp_path / "mix.csv"
    f.write_text("prompt,size,frames,tier\na,64,8,fast\nb,64,8,quality\nc,64,8,fast\nd,96,8,fast\ne,64,8,fast\n")
    submit(db, f, SubmitOptions(batch="mix", out=str(tmp_path)))
    first = claim_group(db, "w", "mix", size=4)
    with db.session() as s:
        prompts = [s.get(Job, c.job_id).prompt for c in first]
    assert prompts == ["a", "c", "e"]


def test_a_job_whose_attempt_failed_renders_alone(db, tmp_path):
    """After a group's render error (out of memory, say) its jobs are retried one by one: a
    group of one may fit, and a poison job takes no healthy job down with it again."""
    from clipmill.jobs.runner.stages import _fail

    make_batch(db, tmp_path, rows=3)
    group = claim_group(db, "w", "b", size=4)
    assert len(group) == 3
    for c in group:
        _fail(db, c.attempt_id, "Traceback ...\nRuntimeError: CUDA out of memory")
    fresh = make_batch(db, tmp_path, rows=2, name="c")  # compatible with b's jobs
    with db.session() as s:
        assert [j.state for j in s.scalars(select(Job).where(Job.batch_id == "b"))] == ["queued"] * 3
    alone = claim_group(db, "w", None, size=4)  # head: b's first job, which failed before
    assert [c.job_id for c in alone] == [group[0].job_id]
    mates = claim_group(db, "w", None, size=4, first_job_id=fresh.job_ids[0])
    assert [c.job_id for c in mates] == fresh.job_ids  # not joined by b's failed jobs


def test_reclaim_takes_back_jobs_of_a_dead_worker(db, tmp_path):
    make_batch(db, tmp_path, rows=2)
    claim_group(db, "nohost.invalid:1", "b", lease_s=-1)  # an already expired lease
    moved = reclaim(db, "b")
    assert len(moved) == 2
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        attempts = s.scalars(select(Attempt)).all()
    assert [j.state for j in jobs] == ["queued", "queued"]
    assert [a.state for a in attempts] == ["failed", "failed"]
    assert attempts[0].error == "abandoned: worker nohost.invalid:1 lost its lease"


def test_cancel_and_retry_commands(db, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from clipmill.jobs.cli import main
    from clipmill.jobs.core.operations import TargetError, cancel, retry

    res = make_batch(db, tmp_path, rows=3)
    a, b, c = res.job_ids
    claim_group(db, "w", "b", size=1)  # a is rendering
    with db.session() as s, s.begin():
        move_job(s, b, JobState.QUEUED, JobState.RENDERING)
        move_job(s, b, JobState.RENDERING, JobState.FAILED, error="boom")
    assert cancel(db, str(c)) == [c]
    assert cancel(db, "b") == [a]  # b failed, c already cancelled
    assert retry(db, "b") == [b]
    assert sorted(retry(db, "b", failed=False, cancelled=True)) == [a, c]
    with db.session() as s:
        assert [s.get(Job, j).state for j in (a, b, c)] == ["queued", "queued", "queued"]
    with pytest.raises(TargetError, match="'nope': no batch or job of that name or id"):
        cancel(db, "nope")
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", db.url)
    monkeypatch.delenv("CLIPMILL_BROKER_URL", raising=False)
    out = CliRunner().invoke(main, ["cancel", "b"])
    assert out.exit_code == 0 and out.output.strip() == f"cancelled 3 job(s): {a}, {b}, {c}"
    out = CliRunner().invoke(main, ["retry", "b"])
    assert out.exit_code == 2 and "nothing to retry: give --failed, --rejected and/or --cancelled" in out.output


def test_status_progress_and_eta(db, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from clipmill.jobs.core.batches import batch_status
    from clipmill.jobs.cli import main

    make_batch(db, tmp_path, rows=4)
    claimed = claim_group(db, "w", "b", size=2)
    with db.session() as s, s.begin():
        for c in claimed:
            s.get(Attempt, c.attempt_id).started_at = s.get(Attempt, c.attempt_id).started_at.replace(year=2020)
            move_job(s, c.job_id, JobState.RENDERING, JobState.FAILED)
    p = batch_status(db, "b")["progress"]
    assert (p["done"], p["open"]) == (2, 2)
    assert p["eta_s"] == pytest.approx(p["elapsed_s"], rel=0.01)  # two done in elapsed: two more take as long
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", db.url)
    out = CliRunner().invoke(main, ["status", "b"])
    assert out.exit_code == 0 and "progress: 2/4 done, 2 open, elapsed " in out.output
    with db.session() as s, s.begin():
        for j in s.scalars(select(Job).where(Job.state == "queued")):
            move_job(s, j.id, JobState.QUEUED, JobState.CANCELLED)
    out = CliRunner().invoke(main, ["status", "b", "--watch", "1"])
    assert out.exit_code == 0 and "b: 4/4 done (passed 0, rejected 0, failed 2), 0 open" in out.output
