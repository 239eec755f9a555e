"""Celery tasks: thin wrappers over the stage functions in ``clipmill.jobs.runner.stages``.

Messages carry ids only. Every task is safe to run twice: a render message for a job that is
no longer queued does nothing (another group took it, or it is done), and a post message for
an attempt that already moved on does nothing. Poison jobs stop at the batch's max attempts
(render errors) or its max lost attempts (a job whose worker died is taken back by its expired
lease; see core.queue).

A worker's context (database, warm model, storage) belongs to the task instance, which Celery
creates once per worker process: ``WorkerTask.ctx`` builds it from the app's settings on first
use, so nothing is kept in module globals.
"""

from __future__ import annotations

import logging
import threading

from celery import Task
from celery.signals import worker_shutting_down
from sqlalchemy import select

from clipmill.jobs.core.models import Ad, Attempt, Job
from clipmill.jobs.core.queue import Heartbeat, claim_group, worker_name
from clipmill.jobs.farm.app import app
from clipmill.jobs.ads.assembly import assemble_ad
from clipmill.jobs.core.notify import due, notify_once
from clipmill.jobs.farm.dispatch import (BrokerDown, mark_sent, reconcile as run_reconcile, send_assemble, send_notify,
                                         send_post, send_render)
from clipmill.jobs.farm.preview import client as preview_client, serve as serve_preview
from clipmill.jobs.farm.nightly import (NightlyRunning, Supervisor, parse_deadline, report_name, run_farm, single_run,
                                        write_report)
from clipmill.jobs.runner.stages import WorkerContext, post_attempt, render_group
from clipmill.storage import open_storage

log = logging.getLogger("clipmill.tasks")


class WorkerTask(Task):
    """A clipmill task: its worker context is made once per worker process, from the settings
    the app was built with."""

    abstract = True
    _ctx: WorkerContext | None = None

    @property
    def ctx(self) -> WorkerContext:
        if self._ctx is None:
            self._ctx = WorkerContext.from_settings(self.app.clipmill_settings)
        return self._ctx


@app.task(name="clipmill.render", base=WorkerTask, bind=True)
def render(self: WorkerTask, job_id: int) -> list[int]:
    ctx = self.ctx
    me = worker_name()
    claimed = claim_group(ctx.db, me, size=self.app.clipmill_settings.group_size, first_job_id=job_id)
    if not claimed:
        log.info("job %s: not queued any more; nothing to do", job_id)
        return []
    log.info("group of %s: jobs %s", len(claimed), [c.job_id for c in claimed])
    with Heartbeat(ctx.db, [c.job_id for c in claimed], me):
        done = render_group(ctx, [c.attempt_id for c in claimed])
    for attempt_id in done:
        send_post(attempt_id)
    mark_sent(ctx.db, [c.job_id for c in claimed if c.attempt_id in done])  # reconcile resends after stale_s only
    # a render error sends the group's jobs back to queued while they have attempts left: send
    # them again now (not at the next reconcile); out of attempts, they are failed and stay so
    _send_queued_again(ctx.db, [c.job_id for c in claimed if c.attempt_id not in done])
    return done


def _send_queued_again(db, job_ids: list[int]) -> None:
    """Send a render message for those of ``job_ids`` that are queued again (with their
    priority). If the broker is unreachable, reconcile sends them later."""
    if not job_ids:
        return
    with db.session() as s:
        queued = list(s.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.state == "queued").order_by(Job.id)))
    if queued:
        try:
            send_render(db, queued)
        except BrokerDown as e:
            log.warning("jobs %s queued again, but the broker is unreachable (%s); reconcile will send them", queued, e)


# Acked when it starts: a preview whose worker died is not delivered again later, when its page
# is long gone (the page sees the stream end and can start another).
@app.task(name="clipmill.preview", base=WorkerTask, bind=True, acks_late=False)
def preview(self: WorkerTask, session_id: str) -> dict:
    """Stream one preview on this render worker between its groups (farm.preview.serve)."""
    settings = self.app.clipmill_settings
    return serve_preview(self.ctx, preview_client(settings.broker_url), session_id, worker_name(),
                         settings.preview_max_s)


@app.task(name="clipmill.post", base=WorkerTask, bind=True)
def post(self: WorkerTask, attempt_id: int) -> str | None:
    ctx = self.ctx
    verdict = post_attempt(ctx, attempt_id)
    with ctx.db.session() as s:
        a = s.get(Attempt, attempt_id)
    if a is not None:  # a QC retry (or a post error with attempts left): render it again
        _send_queued_again(ctx.db, [a.job_id])
        with ctx.db.session() as s:
            job = s.get(Job, a.job_id)
        if job is not None and job.ad_id is not None and job.state not in ("queued", "rendering", "post"):
            try:  # the last shot of an ad in: assemble it (an ad not ready yet ignores the message)
                send_assemble(job.ad_id)
            except Exception as e:  # noqa: BLE001 - reconcile sends it later
                log.warning("ad %s: the assembly message could not be sent (%s); reconcile will send it", job.ad_id, e)
        if job is not None:
            _notify_if_finished(ctx.db, job.batch_id)
    return verdict


def _notify_if_finished(db, batch_id: str) -> None:
    """Send the batch's callback task when nothing of it is open (and it has a URL)."""
    if due(db, batch_id):
        try:
            send_notify(batch_id)
        except Exception as e:  # noqa: BLE001 - reconcile sends it later
            log.warning("batch %s: the notify message could not be sent (%s); reconcile will send it", batch_id, e)


@app.task(name="clipmill.assemble", base=WorkerTask, bind=True)
def assemble(self: WorkerTask, ad_id: int) -> str | None:
    """Assemble one ad whose shots are all in (jobs.ads.assembly): safe to run twice."""
    state = assemble_ad(self.ctx, ad_id)
    with self.ctx.db.session() as s:
        ad = s.get(Ad, ad_id)
    if ad is not None:
        _notify_if_finished(self.ctx.db, ad.batch_id)
    return state


@app.task(name="clipmill.notify", base=WorkerTask, bind=True)
def notify(self: WorkerTask, batch_id: str) -> dict | None:
    """The batch-finished callback (core.notify): once per batch, retried with backoff."""
    return notify_once(self.ctx.db, batch_id, self.app.clipmill_settings.notify_secret)


@app.task(name="clipmill.reconcile", base=WorkerTask, bind=True)
def reconcile(self: WorkerTask, stale_s: float = 600) -> dict:
    """Beat's periodic safety net: farm.dispatch.reconcile on this worker's database."""
    res = run_reconcile(self.ctx.db, stale_s)
    log.info("reconcile: %s", res)
    return res


# Set when this worker starts a warm shutdown (SIGTERM: `docker stop`, systemd): the nightly
# task, which would otherwise hold its post thread, and the shutdown, until its deadline hours
# away, writes its report and returns. The post pool runs on threads, so the flag is seen.
SHUTTING_DOWN = threading.Event()


@worker_shutting_down.connect
def _shutting_down(**_kwargs) -> None:
    SHUTTING_DOWN.set()


# Acked when it starts, not when it ends: a run of hours must not come back when the broker's
# visibility timeout expires. If its worker dies, the night goes on without tier changes or a
# report; `clipmill nightly` can be started by hand.
@app.task(name="clipmill.nightly", base=WorkerTask, bind=True, acks_late=False)
def nightly(self: WorkerTask, deadline: str = "07:00", out: str | None = None, interval: float = 30.0) -> dict:
    """The nightly run started by beat: farm.nightly's supervisor until ``deadline`` (HH:MM in
    the settings' timezone, or +SECONDS), then the morning report under ``out`` (default: the
    settings' CLIPMILL_OUT)."""
    settings = self.app.clipmill_settings
    db = self.ctx.db
    when = parse_deadline(deadline, settings.timezone)
    sup = Supervisor(db, when, preview_max_s=settings.preview_max_s)
    try:
        with single_run(db):
            log.info("nightly run until %s", when.isoformat(timespec="minutes"))
            stopped = run_farm(db, sup, interval, stop=SHUTTING_DOWN)
    except NightlyRunning as e:
        log.error("%s", e)
        return {"report": [], "refused": str(e)}
    report = sup.report()
    if stopped:  # the render workers go on with the jobs they hold; the next nightly run continues
        report["stopped"] = "its worker shut down before the deadline"
        log.warning("nightly: its worker is shutting down; the run stops here and writes its report")
    paths = write_report(report, open_storage(out or settings.out), report_name(report))
    log.info("nightly report: %s", paths)
    return {"report": paths, **{k: report[k] for k in ("passed", "rejected", "failed", "not_finished")}}
