"""Celery tasks: thin wrappers over the stage functions in jobs.stages.

Messages carry ids only. Every task is safe to run twice: a render message for a job that is
no longer queued does nothing (another group took it, or it is done), and a post message for
an attempt that already moved on does nothing. Poison jobs stop at the batch's max attempts:
every claim counts one, and a job whose worker died is taken back by its expired lease.
"""

from __future__ import annotations

import logging
import os
import threading

from jobs.celery_app import app

log = logging.getLogger("clipmill.tasks")
GROUP_SIZE = int(os.environ.get("CLIPMILL_GROUP_SIZE", 4))
_ctx = None


def context():
    """The worker's context: database, and the model kept warm between tasks."""
    global _ctx
    if _ctx is None:
        from jobs.db import Database
        from jobs.stages import WorkerContext

        device = os.environ.get("CLIPMILL_DEVICE")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        _ctx = WorkerContext(Database(), device=device)
    return _ctx


class Heartbeat:
    """Renews the lease on the jobs being rendered every ``every`` seconds."""

    def __init__(self, db, job_ids: list[int], worker: str, every: float):
        self.db, self.job_ids, self.worker, self.every = db, job_ids, worker, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        from jobs.queue import renew_lease

        while not self.stop.wait(self.every):
            renew_lease(self.db, self.job_ids, self.worker)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@app.task(name="clipmill.render")
def render(job_id: int) -> list[int]:
    from jobs.queue import DEFAULT_LEASE_S, claim_group, worker_name
    from jobs.stages import render_group

    ctx = context()
    me = worker_name()
    claimed = claim_group(ctx.db, me, size=GROUP_SIZE, first_job_id=job_id)
    if not claimed:
        log.info("job %s: not queued any more; nothing to do", job_id)
        return []
    log.info("group of %s: jobs %s", len(claimed), [c.job_id for c in claimed])
    with Heartbeat(ctx.db, [c.job_id for c in claimed], me, DEFAULT_LEASE_S / 3):
        done = render_group(ctx, [c.attempt_id for c in claimed])
    for attempt_id in done:
        post.apply_async((attempt_id,), queue="post")
    # a render error sends the group's jobs back to queued while they have attempts left: send
    # them again now (not at the next reconcile); out of attempts, they are failed and stay so
    _send_queued_again(ctx.db, [c.job_id for c in claimed if c.attempt_id not in done])
    return done


def _send_queued_again(db, job_ids: list[int]) -> None:
    """Send a render message for those of ``job_ids`` that are queued again (with their
    priority). If the broker is unreachable, reconcile sends them later."""
    if not job_ids:
        return
    from sqlalchemy import select

    from jobs.dispatch import BrokerDown, send_render
    from jobs.models import Job

    with db.session() as s:
        queued = list(s.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.state == "queued").order_by(Job.id)))
    if queued:
        try:
            send_render(db, queued)
        except BrokerDown as e:
            log.warning("jobs %s queued again, but the broker is unreachable (%s); reconcile will send them", queued, e)


@app.task(name="clipmill.post")
def post(attempt_id: int) -> str | None:
    from jobs.models import Attempt
    from jobs.stages import post_attempt

    ctx = context()
    verdict = post_attempt(ctx, attempt_id)
    with ctx.db.session() as s:
        a = s.get(Attempt, attempt_id)
    if a is not None:  # a QC retry (or a post error with attempts left): render it again
        _send_queued_again(ctx.db, [a.job_id])
    return verdict


@app.task(name="clipmill.reconcile")
def reconcile(stale_s: float = 600) -> dict:
    """Beat's periodic safety net: jobs.dispatch.reconcile on this worker's database."""
    from jobs.dispatch import reconcile as run_reconcile

    res = run_reconcile(context().db, stale_s)
    log.info("reconcile: %s", res)
    return res


# Acked when it starts, not when it ends: a run of hours must not come back when the broker's
# visibility timeout expires. If its worker dies, the night goes on without tier changes or a
# report; `clipmill nightly` can be started by hand.
@app.task(name="clipmill.nightly", acks_late=False)
def nightly(deadline: str = "07:00", out: str | None = None, interval: float = 30.0) -> dict:
    """The nightly run started by beat: jobs.nightly's farm supervisor until ``deadline``
    (HH:MM in the app's timezone, or +SECONDS), then the morning report under ``out``
    (default: this worker's CLIPMILL_OUT)."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from jobs.nightly import NightlyRunning, Supervisor, parse_deadline, report_name, run_farm, single_run, write_report
    from storage import open_storage

    db = context().db
    when = parse_deadline(deadline, now=datetime.now(ZoneInfo(str(app.conf.timezone or "UTC"))))
    sup = Supervisor(db, when)
    try:
        with single_run(db):
            log.info("nightly run until %s", when.isoformat(timespec="minutes"))
            run_farm(db, sup, interval)
    except NightlyRunning as e:
        log.error("%s", e)
        return {"report": [], "refused": str(e)}
    report = sup.report()
    paths = write_report(report, open_storage(out or os.environ.get("CLIPMILL_OUT", "clipmill-out")), report_name(report))
    log.info("nightly report: %s", paths)
    return {"report": paths, **{k: report[k] for k in ("passed", "rejected", "failed", "not_finished")}}
