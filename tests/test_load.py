"""Load on PostgreSQL: submitting 10,000 jobs takes seconds, and status on 100,000 job rows
answers in under a second. Real PostgreSQL and Redis; part of `make test` (marker `load`).

No assertion reads the wall clock against a fixed limit, which a busy shared machine can break.
What is asserted is counted or compared within the same run: SQL statements per submit and per
status call (a regression to one round trip per job shows as thousands), the claim's query plan
(no sort of every queued job), and 10,000 jobs against 1,000 submitted just before (a cost that
grows faster than the batch shows as a ratio far above 10). The seconds are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from sqlalchemy import func, select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Job

pytestmark = pytest.mark.load

SCALING_LIMIT = 25.0  # 10x the jobs may cost at most 25x the time (linear: about 10x)
SUBMIT_STATEMENTS_LIMIT = 100  # SQL statements to submit or send 10,000 jobs (measured: about 30)
STATUS_STATEMENTS_LIMIT = 20  # SQL statements of one status or summary call

SUBMIT_SCRIPT = r"""
import json, sys, time
from sqlalchemy import event
from clipmill.jobs.core.batches import SubmitOptions, check_file, submit
from clipmill.jobs.core.db import Database
from clipmill.jobs.farm.dispatch import send_render
from clipmill.jobs.core.prompts import Defaults
db = Database()
statements = [0]
event.listen(db.engine, "before_cursor_execute", lambda *a: statements.__setitem__(0, statements[0] + 1))
open("one.csv", "w").write("prompt\ndish\n")
# build or load the tiny model's tokenizer first: not part of a submit's cost
check_file("one.csv", SubmitOptions(defaults=Defaults(size=(64, 64), frames=8)))
out = {}
for name, path in (("small", "small.csv"), ("load", "jobs.csv")):
    opts = SubmitOptions(batch=name, out="out", defaults=Defaults(size=(64, 64), frames=8))
    statements[0] = 0
    t1 = time.perf_counter()
    res = submit(db, path, opts)
    t2 = time.perf_counter()
    submit_statements = statements[0]
    statements[0] = 0
    sent = send_render(db, res.job_ids)
    t3 = time.perf_counter()
    out[name] = {"jobs": len(res.job_ids), "sent": sent, "submit_s": t2 - t1, "send_s": t3 - t2,
                 "submit_statements": submit_statements, "send_statements": statements[0]}
print(json.dumps(out))
"""


def test_submit_10000_jobs_takes_seconds(pg_url, tmp_path):
    """The submit API validates, cleans and writes 10,000 rows, then sends 10,000 render
    messages to a real Redis: seconds, not minutes."""
    import redis

    from conftest import need_service

    n = 10_000
    r = redis.Redis(host="127.0.0.1", port=6379, db=15)
    try:
        r.ping()
    except Exception as e:  # noqa: BLE001
        need_service("Redis at 127.0.0.1:6379", e)
    r.flushdb()
    for name, count in (("jobs.csv", n), ("small.csv", n // 10)):
        (tmp_path / name).write_text(
            "prompt,seed\n" + "".join(f'"dish {i} on a table, orbit",{i}\n' for i in range(count)))
    env = dict(os.environ, CLIPMILL_DATABASE_URL=pg_url, CLIPMILL_BROKER_URL="redis://127.0.0.1:6379/15")
    try:
        proc = subprocess.run([sys.executable, "-c", SUBMIT_SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        both = json.loads(proc.stdout.strip().splitlines()[-1])
        m, small = both["load"], both["small"]
        print(f"\nsubmit {n} jobs: {m['submit_s']:.2f} s to validate and write, {m['send_s']:.2f} s to send "
              f"({small['submit_s']:.2f} s and {small['send_s']:.2f} s for {small['jobs']}); SQL statements: "
              f"{m['submit_statements']} to submit, {m['send_statements']} to send")
        assert m["jobs"] == m["sent"] == n and small["jobs"] == n // 10
        assert m["submit_statements"] < SUBMIT_STATEMENTS_LIMIT and m["send_statements"] < SUBMIT_STATEMENTS_LIMIT, m
        for step in ("submit_s", "send_s"):
            assert m[step] < SCALING_LIMIT * small[step], (step, m, small)
        assert sum(r.llen(k) for k in r.keys("render*")) == n + n // 10  # every message is in Redis
    finally:
        r.flushdb()
    db = Database(pg_url)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == "load", Job.state == "queued", Job.enqueued_at.is_not(None))) == n
        lines = list(s.scalars(select(Job.line).where(Job.batch_id == "load").order_by(Job.id)))
    assert lines == list(range(2, n + 2))  # in file order
    db.dispose()


def fill(conn, batch: str, n: int, states: list[str], priority: int = 0) -> None:
    """``n`` jobs of ``batch`` in one INSERT ... SELECT, cycling through ``states``; one
    attempt for each job that left the queue."""
    conn.execute(sa.text(
        "INSERT INTO batches (id, source, model, sampler, guidance, out, priority, max_attempts, created_at) "
        "VALUES (:b, 'load.csv', 'tiny', 'lightning', 1.0, '/tmp/out', :p, 2, now())"), {"b": batch, "p": priority})
    conn.execute(sa.text(
        "INSERT INTO jobs (batch_id, line, prompt_raw, prompt, negative_prompt, elements, seed, tier, tier_requested,"
        " frames, fps, width, height, priority, state, version, attempts_made, created_at, updated_at, enqueued_at)"
        " SELECT :b, g + 2, 'dish ' || g, 'dish ' || g, '', '{}', g, 'fast', 'fast', 16, 30, 64, 64, :p,"
        " (CAST(:s AS text[]))[1 + g % cardinality(CAST(:s AS text[]))], 0,"
        " CASE WHEN (CAST(:s AS text[]))[1 + g % cardinality(CAST(:s AS text[]))] = 'queued' THEN 0 ELSE 1 END,"
        " now(), now(), now() FROM generate_series(0, :n - 1) g"), {"b": batch, "n": n, "s": states, "p": priority})
    conn.execute(sa.text(
        "INSERT INTO attempts (job_id, number, state, tier, steps, seed, model, sampler, guidance, worker, group_id,"
        " group_size, timings, started_at, finished_at)"
        " SELECT id, 1, CASE state WHEN 'post' THEN 'rendered' ELSE state END, tier, 6, seed, 'tiny', 'lightning',"
        " 1.0, 'host:1', 'g' || (id / 4), 4, '{\"denoise_s\": 1.0}', now() - interval '1 hour', now()"
        " FROM jobs WHERE batch_id = :b AND attempts_made = 1"), {"b": batch})


def timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def test_status_and_claim_on_100000_jobs_stay_a_few_statements(pg_url, monkeypatch):
    """100,000 job rows (a 70,000-job nightly batch half done, three 10,000-job batches):
    `clipmill status`, `clipmill status BATCH` (table and --watch line) and a claim each run a
    few SQL statements whatever the batch size, and the claim walks the index instead of
    sorting the queue. Their seconds are printed (under 0.1 s each here, README)."""
    from sqlalchemy import event
    from click.testing import CliRunner

    from clipmill.jobs.core.batches import batch_status, batch_summary, list_batches
    from clipmill.jobs.cli import main
    from clipmill.jobs.core.queue import claim_group

    db = Database(pg_url)
    statements = [0]
    event.listen(db.engine, "before_cursor_execute", lambda *a: statements.__setitem__(0, statements[0] + 1))

    def counted(fn, *args, **kw):
        statements[0] = 0
        out, secs = timed(fn, *args, **kw)
        assert statements[0] < STATUS_STATEMENTS_LIMIT, (fn.__name__, statements[0])
        return out, secs

    t = time.perf_counter()
    with db.engine.begin() as c:
        fill(c, "night", 70_000, ["queued", "passed", "rejected", "passed", "rendering", "post", "failed"])
        for i in range(3):
            fill(c, f"day{i}", 10_000, ["passed", "rejected", "passed", "failed"])
        c.execute(sa.text("ANALYZE"))
    filled = time.perf_counter() - t
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 100_000

    batches, list_s = counted(list_batches, db)
    assert sum(b["jobs"] for b in batches) == 100_000
    summary, summary_s = counted(batch_summary, db, "night")
    assert summary["jobs"] == 70_000 and summary["states"]["queued"] == 10_000
    assert summary["progress"]["open"] == 30_000 and summary["progress"]["eta_s"] is not None
    assert summary["out_of_attempts"] == 0 and summary["passed_on_retry"] == 0
    status, status_s = counted(batch_status, db, "night", limit=200)
    assert len(status["rows"]) == 200 and status["jobs"] == 70_000

    monkeypatch.setenv("CLIPMILL_DATABASE_URL", pg_url)
    cli = {}
    for args in (["status"], ["status", "night"], ["status", "night", "--watch", "1"]):
        if args[-1] == "1":  # --watch returns once nothing is open: watch a finished batch
            args = ["status", "day0", "--watch", "1"]
        res, cli[" ".join(args)] = timed(CliRunner().invoke, main, args)
        assert res.exit_code == 0, res.output
    assert "69800 more job(s) not shown (--limit 0 shows all)" in CliRunner().invoke(main, ["status", "night"]).output

    claimed, claim_s = counted(claim_group, db, "w:1", size=4)
    assert len(claimed) == 4
    with db.engine.connect() as c:
        plan = "\n".join(r[0] for r in c.execute(sa.text(
            "EXPLAIN SELECT jobs.id FROM jobs JOIN batches ON batches.id = jobs.batch_id WHERE jobs.state = 'queued'"
            " ORDER BY jobs.priority DESC, jobs.id LIMIT 1 FOR UPDATE OF jobs SKIP LOCKED")))
    db.dispose()

    print(f"\n100k rows written in {filled:.2f} s; list {list_s:.3f} s, summary {summary_s:.3f} s, "
          f"status table rows {status_s:.3f} s, claim {claim_s:.3f} s; CLI in process: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in cli.items()))
    assert "ix_jobs_state_priority_desc" in plan and "Sort" not in plan, plan
