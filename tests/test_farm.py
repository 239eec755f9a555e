"""The farm: real Redis, real PostgreSQL, real Celery worker processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from conftest import need_service
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from services import stop

FINAL = ("passed", "rejected", "failed", "approved", "declined")


def write_batch(tmp_path, n, name="b"):
    (tmp_path / f"{name}.csv").write_text("prompt,seed\n" + "".join(f'"dish {i}, orbit",{i}\n' for i in range(n)))


def wait_for(db, what, check, timeout=180, every=0.05):
    """Poll ``check(session)`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with db.session() as s:
            if check(s):
                return
        time.sleep(every)
    with db.session() as s:
        states = s.execute(select(Job.id, Job.batch_id, Job.state, Job.attempts_made)).all()
    pytest.fail(f"{what}: not within {timeout} s; jobs: {states}")


def count(s, *where, of=Job):
    return s.scalar(select(func.count()).select_from(of).where(*where))


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
        jobs = {j.id: j for j in s.scalars(select(Job))}
        attempts = s.scalars(select(Attempt).order_by(Attempt.job_id, Attempt.number)).all()
    assert abandoned  # the killed group's attempts are kept, marked abandoned
    # An attempt lost with its worker does not count against --max-attempts 2: a job whose first
    # attempt died in the crash renders again, and when QC rejects that render (the tiny model's
    # clips are noise, which QC rejects), it still gets its QC retry at the quality tier.
    for a in abandoned:
        assert a.number == 1 and jobs[a.job_id].attempts_lost == 1
        mine = [(x.number, x.state, x.tier, x.verdict) for x in attempts if x.job_id == a.job_id]
        assert mine[1][:2] == (2, "rejected") and mine[1][3] == "reject", mine  # attempt 2, rejected by QC ...
        assert len(mine) == 3 and mine[2][0] == 3 and mine[2][2] == "quality", mine  # ... and retried at quality
        assert jobs[a.job_id].state in ("passed", "rejected")


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
            workers.append(subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "worker", *args], env=env, cwd=tmp_path,
                                            stdout=log, stderr=subprocess.STDOUT))
        write_batch(tmp_path, 8)
        subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"),
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
            [sys.executable, "-m", "clipmill.jobs.cli", "reconcile", "--stale", "3"], env=env, cwd=tmp_path,
            capture_output=True, timeout=120))
        assert_exactly_once(db, tmp_path / "out")
    finally:
        for w in workers:
            stop(w)
        stop(redis_proc)
        db.dispose()


def test_urgent_batch_goes_ahead_of_the_nightly_one(farm, tmp_path):
    """A nightly batch is rendering (QC retries included: tiny clips are noise, so QC rejects
    each and the post worker sends a retry), then an urgent batch is submitted. The one render
    worker (groups of one) renders the urgent jobs next, before the rest of the nightly ones."""
    env, start, cli, db = farm
    out = str(tmp_path / "out")
    start("--queues", "render", extra_env={"CLIPMILL_GROUP_SIZE": "1"})
    start("--queues", "post", "--concurrency", "1")
    write_batch(tmp_path, 12, "nightly")
    cli("submit", "nightly.csv", "--batch", "nightly", "--out", out, "--size", "64", "--frames", "16",
        "--max-attempts", "2")
    wait_for(db, "a nightly QC retry queued", lambda s: count(
        s, Job.batch_id == "nightly", Job.state == "queued", Job.attempts_made >= 1))
    with db.session() as s:
        nightly_left = count(s, Job.batch_id == "nightly", Job.state == "queued")
    assert nightly_left >= 2, "the nightly batch ran out before the urgent one came; nothing to compare"
    write_batch(tmp_path, 3, "urgent")
    cli("submit", "urgent.csv", "--batch", "urgent", "--out", out, "--size", "64", "--frames", "16",
        "--max-attempts", "1", "--priority", "5")

    def urgent_then_nightly(s):
        if count(s, Job.batch_id == "urgent", Job.attempts_made == 1) < 3:
            return False
        last = s.scalar(select(func.max(Attempt.id)).join(Job).where(Job.batch_id == "urgent"))
        return s.scalar(select(func.count()).select_from(Attempt).join(Job).where(
            Job.batch_id == "nightly", Attempt.id > last)) > 0

    wait_for(db, "the urgent jobs rendered, then a nightly one", urgent_then_nightly)
    with db.session() as s:
        sent = s.scalar(select(func.max(Job.enqueued_at)).where(Job.batch_id == "urgent"))  # all in Redis by then
        rows = s.execute(select(Attempt.id, Job.batch_id, Attempt.number, Attempt.started_at).join(Job)
                         .order_by(Attempt.id)).all()  # one worker: ids in claim order
    first = next(i for i, r in enumerate(rows) if r.batch_id == "urgent")
    assert [r.batch_id for r in rows[first:first + 3]] == ["urgent"] * 3, rows
    # no nightly job (first attempt or QC retry) was claimed once the urgent messages were in
    # Redis, but for one popped in the instant they were landing
    jumped = [r for r in rows[:first] if r.started_at > sent]
    assert len(jumped) <= 1, (sent, rows)
    assert any(r.batch_id == "nightly" for r in rows[first + 3:])  # the rest of the nightly batch came after


def wait_log(path, text, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"{path.name} never said {text!r}:\n{path.read_text() if path.exists() else ''}")


def test_two_render_workers_race_for_the_same_jobs_one_attempt_wins(farm, broker, tmp_path):
    """Every job's render message is in the queue twice, one copy after the other (a message
    delivered twice, or sent by two reconcilers), and two idle render workers take them at the
    same time: each job is claimed once, rendered once, one clip."""
    from celery import Celery

    from clipmill.jobs.farm.app import app

    env, start, cli, db = farm
    write_batch(tmp_path, 6)
    cli("submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"), "--size", "64", "--frames", "8",
        "--max-attempts", "1", extra_env={"CLIPMILL_BROKER_URL": "redis://127.0.0.1:1/0"})  # committed, not sent
    for _ in range(2):
        start("--queues", "render", extra_env={"CLIPMILL_GROUP_SIZE": "1"})
    start("--queues", "post", "--concurrency", "2")
    for i in range(3):
        wait_log(tmp_path / f"worker-{i}.log", " ready.")
    with db.session() as s:
        ids = list(s.scalars(select(Job.id).order_by(Job.id)))
    client = Celery("race", broker=broker)
    client.conf.update(broker_transport_options=app.conf.broker_transport_options, task_serializer="json")
    for jid in ids:
        for _ in range(2):
            client.send_task("clipmill.render", args=(jid,), queue="render", priority=9)
    client.close()

    wait_all_final(db, 6)
    assert_exactly_once(db, tmp_path / "out")
    with db.session() as s:
        attempts = s.scalars(select(Attempt)).all()
        assert {j.attempts_made for j in s.scalars(select(Job))} == {1}
    assert len(attempts) == 6 and {a.state for a in attempts} <= {"passed", "rejected"}
    assert len({a.worker for a in attempts}) == 2  # both workers won some of the races
    logs = [(tmp_path / f"worker-{i}.log").read_text() for i in range(2)]
    # the second copy of every message found its job taken and did nothing
    assert sum(log.count("not queued any more; nothing to do") for log in logs) == 6
    assert sum(log.count("group of 1: jobs") for log in logs) == 6


def test_poison_job_always_out_of_memory_fails_after_n_attempts(farm, broker, tmp_path):
    """A job far too big for its worker's memory (a 1536x1536, 32-frame clip on a worker whose
    address space is capped a few hundred MB above its warm size) runs out of memory on every
    attempt: a real allocator error, not a simulated one. It ends failed after --max-attempts
    with that reason, is never sent again, and the worker goes on with the next job."""
    import resource

    import redis

    env, start, cli, db = farm
    out = str(tmp_path / "out")
    worker = start("--queues", "render")
    write_batch(tmp_path, 1, "warm")
    cli("submit", "warm.csv", "--batch", "warm", "--out", out, "--size", "64", "--frames", "8", "--max-attempts", "1")
    wait_for(db, "the warm-up job rendered", lambda s: count(s, Job.batch_id == "warm", Job.state == "post"))
    status = (Path(f"/proc/{worker.pid}/status")).read_text()
    vm_kb = int(next(x for x in status.splitlines() if x.startswith("VmSize:")).split()[1])
    cap = (vm_kb + 600 * 1024) * 1024
    resource.prlimit(worker.pid, resource.RLIMIT_AS, (cap, cap))

    (tmp_path / "huge.csv").write_text('prompt,seed,size,frames\n"dish, orbit",1,1536,32\n')
    cli("submit", "huge.csv", "--batch", "huge", "--out", out, "--max-attempts", "3")
    wait_for(db, "the poison job failed", lambda s: count(s, Job.batch_id == "huge", Job.state == "failed"), timeout=240)
    with db.session() as s:
        job = s.scalars(select(Job).where(Job.batch_id == "huge")).one()
        attempts = s.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.number)).all()
    assert job.attempts_made == 3 and [a.number for a in attempts] == [1, 2, 3]
    assert all(a.state == "failed" and "can't allocate memory" in a.error for a in attempts), [a.error for a in attempts]
    assert "can't allocate memory" in job.error
    assert not list((tmp_path / "out" / "huge").rglob("*.mp4"))

    # never redelivered: no render message left or unacked, and reconcile has nothing to send
    r = redis.Redis.from_url(broker)
    deadline = time.time() + 30
    while time.time() < deadline and (r.keys("render*") or r.hlen("unacked")):
        time.sleep(0.2)
    assert not r.keys("render*") and r.hlen("unacked") == 0, (r.keys("*"), r.hlen("unacked"))
    assert "render messages sent 0" in cli("reconcile", "--stale", "0").stdout
    with db.session() as s:
        assert s.get(Job, job.id).attempts_made == 3

    # the worker survived its out-of-memory errors and renders the next job
    write_batch(tmp_path, 1, "after")
    cli("submit", "after.csv", "--batch", "after", "--out", out, "--size", "64", "--frames", "8", "--max-attempts", "1")
    wait_for(db, "the next job rendered", lambda s: count(s, Job.batch_id == "after", Job.state == "post"))
    assert worker.poll() is None


def test_beat_reconciles_and_its_nightly_task_drains_the_queue_and_reports(farm, broker, tmp_path):
    """`clipmill beat` sends clipmill.reconcile every CLIPMILL_RECONCILE_EVERY seconds: jobs
    committed while the broker was down go out with nothing else running. Then the nightly
    task, as beat sends it at CLIPMILL_NIGHTLY_AT, runs on a post worker, sends a batch nobody
    sent, waits for it to finish and writes the morning report."""
    import json

    from celery import Celery

    from clipmill.jobs.farm.app import app

    env, start, cli, db = farm
    out = tmp_path / "out"
    down = {"CLIPMILL_BROKER_URL": "redis://127.0.0.1:1/0"}
    write_batch(tmp_path, 2)
    cli("submit", "b.csv", "--batch", "b", "--out", str(out), "--size", "64", "--frames", "8", "--max-attempts", "1",
        extra_env=down)
    start("--queues", "render")
    start("--queues", "post", "--concurrency", "2", extra_env={"CLIPMILL_OUT": str(out)})
    log = open(tmp_path / "beat.log", "w")
    beat = subprocess.Popen(
        [sys.executable, "-m", "clipmill.jobs.cli", "beat", "--schedule", str(tmp_path / "beat-schedule")],
        env=dict(env, CLIPMILL_RECONCILE_EVERY="2", CLIPMILL_NIGHTLY_AT="21:30", CLIPMILL_NIGHTLY_DEADLINE="06:45"),
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_all_final(db, 2)
    finally:
        stop(beat)
    assert_exactly_once(db, out)
    beat_log = (tmp_path / "beat.log").read_text()
    assert "beat: reconcile: clipmill.reconcile 2.0 {'stale_s': 600.0}" in beat_log
    assert "beat: nightly: clipmill.nightly <crontab: 30 21 * * *" in beat_log and "'deadline': '06:45'" in beat_log
    assert "Scheduler: Sending due task reconcile (clipmill.reconcile)" in beat_log
    assert "Task clipmill.reconcile[" in (tmp_path / "worker-1.log").read_text()

    write_batch(tmp_path, 2, "n")
    cli("submit", "n.csv", "--batch", "n", "--out", str(out), "--size", "64", "--frames", "8", "--max-attempts", "1",
        extra_env=down)
    client = Celery("beat-like", broker=broker)
    client.conf.update(broker_transport_options=app.conf.broker_transport_options, task_serializer="json")
    client.send_task("clipmill.nightly", kwargs={"deadline": "+300", "interval": 1}, queue="post")
    client.close()
    deadline = time.time() + 180
    while time.time() < deadline and not list((out / "reports").glob("nightly-*.json")):
        time.sleep(0.5)
    reports = list((out / "reports").glob("nightly-*.json"))
    assert reports, (tmp_path / "worker-1.log").read_text()[-3000:]
    report = json.loads(reports[0].read_text())
    assert (report["clips_produced"], report["rejected"], report["not_finished"]) == (2, 2, 0), report  # tiny: QC rejects
    assert reports[0].with_suffix(".md").exists()
    wait_all_final(db, 4, timeout=5)
    assert_exactly_once(db, out)


def test_flower_lists_the_farm_workers(farm, tmp_path):
    """Flower, started as deploy/docker-compose.yml starts it (basic auth from FLOWER_BASIC_AUTH),
    lists a running worker and its tasks through its HTTP API."""
    import base64
    import json
    import socket
    import urllib.error
    import urllib.request

    from services import free_port, wait_port

    env, start, cli, db = farm
    worker = start("--queues", "post", "--concurrency", "1")
    wait_log(tmp_path / "worker-0.log", " ready.")
    port = free_port()
    log = open(tmp_path / "flower.log", "w")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "clipmill.jobs.farm.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=dict(env, FLOWER_BASIC_AUTH="ops:a-long-flower-secret"), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, flower)
        url = f"http://127.0.0.1:{port}/api/workers?refresh=1"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 401  # the API needs the password
        auth = {"Authorization": "Basic " + base64.b64encode(b"ops:a-long-flower-secret").decode()}
        name = f"post-{worker.pid}@{socket.gethostname()}"
        workers: dict = {}
        deadline = time.time() + 60
        while time.time() < deadline and name not in workers:
            with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=30) as r:
                workers = json.loads(r.read())
            time.sleep(0.5)
        assert name in workers, (name, list(workers), (tmp_path / "flower.log").read_text()[-2000:])
        assert {"clipmill.render", "clipmill.post", "clipmill.reconcile", "clipmill.nightly"} <= set(
            workers[name]["registered"])
        assert [q["name"] for q in workers[name]["active_queues"]] == ["post"]
    finally:
        stop(flower)


@pytest.mark.slow
def test_kill_9_post_worker_during_ad_assembly_ends_with_one_file_per_ad_and_format(farm, tmp_path):
    """An ad batch in the farm: shots render on the render queue, the last shot's post task
    sends the ad's assembly to the post queue. The post worker is killed (-9) in the middle of
    an assembly; a new one, sent the ad again by reconcile, takes the dead assembler's ad back
    and finishes it: one file per ad and format, nothing half-written."""
    from clipmill.jobs.core.models import Ad

    font = Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc")
    if not font.exists():
        pytest.skip(f"the Chinese font {font} is not installed (Debian: fonts-wqy-microhei)")
    env, start, cli, db = farm
    root = Path(__file__).resolve().parents[1] / "examples" / "ad"
    (tmp_path / "qc.toml").write_text("boiling_excess = 1000\n")  # shot QC is not under test: let boiling through
    qc = {"CLIPMILL_QC_CONFIG": str(tmp_path / "qc.toml")}
    (tmp_path / "two.csv").write_text("id,merchant,price,cta,colour,shape\n"
                                      "a,老王面馆,¥ 29.9,立即下单,green,square\nb,Golden Lotus,$ 8,Order now,red,circle\n",
                                      encoding="utf-8")
    out = tmp_path / "out"
    start("--queues", "render")
    post = start("--queues", "post", "--concurrency", "1", extra_env=qc)
    cli("submit", "two.csv", "--ad", str(root / "local-life.toml"), "--model", "shapes", "--batch", "ads",
        "--out", str(out))
    wait_for(db, "an ad assembling with its first file stored",
             lambda s: any(a.state == "assembling" and (out / "ads" / "ads" / str(a.id) / "9x16.mp4").exists()
                           for a in s.scalars(select(Ad))), timeout=600, every=0.1)
    os.kill(post.pid, signal.SIGKILL)
    post.wait()
    start("--queues", "post", "--concurrency", "1", extra_env=qc)
    deadline = time.time() + 600
    while time.time() < deadline:  # the killed worker's message is gone: reconcile sends the ad again
        cli("reconcile", "--stale", "5")
        with db.session() as s:
            ads = s.scalars(select(Ad).order_by(Ad.id)).all()
        states = [a.state for a in ads]
        if states == ["done", "done"]:
            break
        time.sleep(3)
    assert states == ["done", "done"], states
    for ad_id in (a.id for a in ads):
        folder = out / "ads" / "ads" / str(ad_id)
        assert sorted(p.name for p in folder.iterdir()) == ["16x9.jpg", "16x9.mp4", "1x1.jpg", "1x1.mp4", "9x16.jpg",
                                                            "9x16.mp4", "ad.json"]
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]

    # re-rendering a shot from the review page in farm mode: the page sends its jobs to the render
    # queue, the post queue assembles the ad again under the same keys, with the shot's new seed
    import json
    import urllib.parse
    import urllib.request

    from services import free_port, wait_port

    with db.session() as s:
        job = s.scalars(select(Job).where(Job.ad_id == ads[0].id, Job.shot == 1)).one()
        old_seed = s.scalars(select(Attempt.seed).where(Attempt.job_id == job.id, Attempt.state == "passed")).one()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", "ads", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_port(port, server)
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/batch/ads") as r:
            cookie = r.headers["set-cookie"].split(";")[0]
        body = urllib.parse.urlencode({"csrf": cookie.split("=", 1)[1], "version": ads[0].version, "shot": 1,
                                       "operator": "carol"}).encode()
        req = urllib.request.Request(f"{url}/ad/{ads[0].id}/rerender", data=body,
                                     headers={"Cookie": cookie, "Accept": "application/json"})
        with urllib.request.urlopen(req) as r:
            answer = json.loads(r.read())
        assert answer["state"] == "waiting" and answer["jobs"] == [job.id]
        assert answer["message"].startswith("sent 1 job(s) to the render queue")
    finally:
        stop(server)
    wait_for(db, "the ad assembled again", lambda s: s.get(Ad, ads[0].id).state == "done"
             and s.get(Ad, ads[0].id).version > ads[0].version + 1, timeout=600, every=0.5)
    with db.session() as s:
        ad = s.get(Ad, ads[0].id)
        new_seed = s.scalars(select(Attempt.seed).where(Attempt.job_id == job.id, Attempt.state == "passed")
                             .order_by(Attempt.number.desc())).first()
    assert new_seed != old_seed
    assert all(next(u["seed"] for u in f["shots"] if u["shot"] == 1) == new_seed for f in ad.outputs["formats"].values())
    folder = out / "ads" / "ads" / str(ad.id)
    assert sorted(p.name for p in folder.iterdir()) == ["16x9.jpg", "16x9.mp4", "1x1.jpg", "1x1.mp4", "9x16.jpg",
                                                        "9x16.mp4", "ad.json"]


def test_a_post_worker_shutting_down_stops_its_nightly_task_and_writes_the_report(farm, broker, tmp_path):
    """The nightly task holds a post thread until its deadline. Before, a warm shutdown (SIGTERM:
    `docker stop`, systemd) waited for it, hours, until the stop grace ran out and the worker was
    killed with no report. Now the task sees the shutdown, writes its report and returns."""
    import json
    import signal

    from celery import Celery

    from clipmill.jobs.farm.app import app

    env, start, cli, db = farm
    out = tmp_path / "out"
    write_batch(tmp_path, 2)
    cli("submit", "b.csv", "--batch", "b", "--out", str(out), "--size", "64", "--frames", "8")  # no render worker
    worker = start("--queues", "post", "--concurrency", "2", extra_env={"CLIPMILL_OUT": str(out)})
    client = Celery("beat-like", broker=broker)
    client.conf.update(broker_transport_options=app.conf.broker_transport_options, task_serializer="json")
    client.send_task("clipmill.nightly", kwargs={"deadline": "+3600", "interval": 1}, queue="post")
    client.close()
    log = tmp_path / "worker-0.log"
    deadline = time.time() + 120
    while time.time() < deadline and "nightly run until" not in log.read_text():
        time.sleep(0.2)
    assert "nightly run until" in log.read_text(), log.read_text()[-3000:]
    t0 = time.time()
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)
    assert time.time() - t0 < 30, log.read_text()[-3000:]
    (report,) = (out / "reports").glob("nightly-*.json")
    r = json.loads(report.read_text())
    assert r["stopped"] == "its worker shut down before the deadline" and r["not_finished"] == 2, r
    assert "Stopped early: its worker shut down before the deadline." in report.with_suffix(".md").read_text()
