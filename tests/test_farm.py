"""The farm: real Redis, real PostgreSQL, real Celery worker processes on this machine."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from conftest import need_service
from jobs.db import Database
from jobs.models import Attempt, Job
from services import stop

REDIS = ("127.0.0.1", 6379)
FINAL = ("passed", "rejected", "failed", "approved", "declined")


@pytest.fixture
def broker():
    """A Redis database of its own, emptied before and after."""
    import redis

    n = random.randint(1, 15)
    r = redis.Redis(*REDIS, db=n)
    try:
        r.ping()
    except Exception as e:  # noqa: BLE001
        need_service(f"Redis at {REDIS[0]}:{REDIS[1]}", e)
    r.flushdb()
    yield f"redis://{REDIS[0]}:{REDIS[1]}/{n}"
    r.flushdb()


@pytest.fixture
def farm(pg_url, broker, tmp_path, tiny_cache):
    env = dict(os.environ, CLIPMILL_DATABASE_URL=pg_url, CLIPMILL_BROKER_URL=broker, CLIPMILL_DEVICE="cpu")
    procs: list[subprocess.Popen] = []

    def start(*args):
        log = open(tmp_path / f"worker-{len(procs)}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", *args, "--loglevel", "INFO"], env=env,
                             cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def cli(*args, extra_env=None, check=True):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], env=dict(env, **(extra_env or {})),
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    db = Database(pg_url)
    yield env, start, cli, db
    for p in procs:
        stop(p)
    db.dispose()


def write_batch(tmp_path, n):
    (tmp_path / "b.csv").write_text("prompt,seed\n" + "".join(f'"dish {i}, orbit",{i}\n' for i in range(n)))


def wait_all_final(db, n, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with db.session() as s:
            done = s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(FINAL)))
        if done == n:
            return
        time.sleep(0.5)
    with db.session() as s:
        states = s.execute(select(Job.id, Job.state)).all()
    raise AssertionError(f"not all jobs finished in {timeout} s: {states}")


def reconcile_until_final(db, n, reconcile, timeout=240):
    """Run ``reconcile()`` every 2 s until all ``n`` jobs are final."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        reconcile()
        with db.session() as s:
            if s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(FINAL))) == n:
                return
        time.sleep(2)
    wait_all_final(db, n, timeout=1)  # raises with the states


def assert_exactly_once(db, out):
    """Every job finished once: its attempts are numbered 1..n without gaps or twins, the last
    one decided the job's state, and the clips on disk are exactly those of checked attempts
    (one file each; none for attempts abandoned or failed)."""
    with db.session() as s:
        jobs = s.scalars(select(Job)).all()
        attempts = s.scalars(select(Attempt).order_by(Attempt.job_id, Attempt.number)).all()
    for j in jobs:
        mine = [a for a in attempts if a.job_id == j.id]
        assert [a.number for a in mine] == list(range(1, len(mine) + 1)) and len(mine) == j.attempts_made
        assert mine[-1].state == j.state, (j.id, j.state, [(a.number, a.state) for a in mine])
        checked = [a for a in mine if a.state in ("passed", "rejected")]
        clips = sorted(p.name for p in (out / j.batch_id / str(j.id)).glob("*.mp4"))
        assert clips == sorted(f"a{a.number}.mp4" for a in checked), (j.id, clips)


def test_broker_down_at_submit_then_reconcile_and_workers_finish(farm, tmp_path):
    env, start, cli, db = farm
    write_batch(tmp_path, 5)
    dead = cli("submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"), "--size", "64", "--frames", "8",
               "--max-attempts", "1", extra_env={"CLIPMILL_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert "unreachable" in dead.stderr and "the jobs stay queued in the database" in dead.stderr
    with db.session() as s:
        assert s.scalars(select(Job.state)).all() == ["queued"] * 5
        assert s.scalar(select(func.count()).select_from(Job).where(Job.enqueued_at.is_not(None))) == 0

    start("--queues", "render")
    start("--queues", "post", "--concurrency", "2")
    res = cli("reconcile", "--stale", "0")
    assert "render messages sent 5" in res.stdout
    wait_all_final(db, 5)
    assert_exactly_once(db, tmp_path / "out")
    with db.session() as s:
        sizes = sorted({a.group_size for a in s.scalars(select(Attempt))})
    assert max(sizes) > 1  # the render worker grouped compatible jobs


def test_kill_9_render_worker_mid_group_loses_and_duplicates_nothing(farm, tmp_path):
    env, start, cli, db = farm
    write_batch(tmp_path, 6)
    first = start("--queues", "render")
    start("--queues", "post", "--concurrency", "2")
    cli("submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"), "--size", "128", "--frames", "16",
        "--max-attempts", "2")
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the worker holds a group, then kill it hard
        with db.session() as s:
            if s.scalar(select(func.count()).select_from(Job).where(Job.state == "rendering")):
                break
        time.sleep(0.02)
    else:
        pytest.fail("the render worker never claimed a group")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    start("--queues", "render")
    # reconcile takes back the dead worker's jobs and sends them again
    reconcile_until_final(db, 6, lambda: cli("reconcile", "--stale", "5"))
    assert_exactly_once(db, tmp_path / "out")
    with db.session() as s:
        abandoned = s.scalars(select(Attempt).where(Attempt.error.like("abandoned:%"))).all()
    assert abandoned  # the killed group's attempts are kept, marked abandoned


def test_redis_restart_mid_batch_then_reconcile_loses_nothing(pg_url, tmp_path, tiny_cache):
    """A Redis of our own on a free port (no persistence), stopped mid-batch and started again
    empty: the messages are gone, the job table is not, and reconcile sends the rest again."""
    from services import free_port, need_program, wait_port

    exe = need_program("redis-server", "redis-server")
    port = free_port()

    def redis_up():
        p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_port(port, p)
        return p

    redis_proc = redis_up()
    env = dict(os.environ, CLIPMILL_DATABASE_URL=pg_url, CLIPMILL_BROKER_URL=f"redis://127.0.0.1:{port}/0",
               CLIPMILL_DEVICE="cpu")
    workers = []
    db = Database(pg_url)
    try:
        for args in (("--queues", "render"), ("--queues", "post", "--concurrency", "2")):
            log = open(tmp_path / f"w{len(workers)}.log", "w")
            workers.append(subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", *args], env=env, cwd=tmp_path,
                                            stdout=log, stderr=subprocess.STDOUT))
        write_batch(tmp_path, 8)
        subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"),
                        "--size", "64", "--frames", "8", "--max-attempts", "1"], env=env, cwd=tmp_path, check=True,
                       capture_output=True, timeout=300)
        deadline = time.time() + 120
        while time.time() < deadline:  # once the first group is done, pull the broker away
            with db.session() as s:
                if s.scalar(select(func.count()).select_from(Job).where(Job.state != "queued")):
                    break
            time.sleep(0.05)
        redis_proc.terminate()
        redis_proc.wait()
        time.sleep(1)
        redis_proc = redis_up()  # empty: every message in it is lost
        reconcile_until_final(db, 8, lambda: subprocess.run(
            [sys.executable, "-m", "jobs.cli", "reconcile", "--stale", "3"], env=env, cwd=tmp_path,
            capture_output=True, timeout=120))
        assert_exactly_once(db, tmp_path / "out")
    finally:
        for w in workers:
            stop(w)
        stop(redis_proc)
        db.dispose()
