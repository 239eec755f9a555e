"""Sending work to the farm. The database is the source of truth: jobs are committed first and
sent after; a job the broker never got stays queued, and `clipmill reconcile` sends it again."""

from __future__ import annotations

import logging
from datetime import timedelta

from kombu.exceptions import KombuError
from redis.exceptions import RedisError
from sqlalchemy import or_, select, update

from clipmill.jobs.ads.assembly import readiness
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, Attempt, Batch, Job
from clipmill.jobs.core.notify import due, not_sent
from clipmill.jobs.core.queue import lease_lost, now, reclaim
from clipmill.jobs.core.states import AttemptState, JobState
from clipmill.jobs.farm.app import app

log = logging.getLogger("clipmill.dispatch")


class BrokerDown(RuntimeError):
    pass


def broker_priority(priority: int) -> int:
    """The Redis message priority for a job's priority. clipmill: higher goes first, any integer.
    kombu's Redis transport: 0 is served first, 9 last (with ``priority_steps`` 0..9, see
    jobs.celery_app). Priorities 9 and above share the first place, 0 and below the last; the
    job table's claim order (priority, then id) breaks ties within a group."""
    return max(0, min(9, 9 - int(priority or 0)))


SEND_CHUNK = 1000  # messages per Redis round trip


def send_render(db: Database, job_ids: list[int]) -> int:
    """Send one render message per job, with its priority; mark them sent. Messages go out in
    pipelined chunks (one Redis round trip per thousand) and each chunk is marked once Redis
    has it. Raises BrokerDown if Redis is unreachable; chunks sent before stay marked."""
    sent = 0
    try:
        with app.producer_or_acquire() as producer:
            for i in range(0, len(job_ids), SEND_CHUNK):
                chunk = job_ids[i:i + SEND_CHUNK]
                with db.session() as s:
                    prio = dict(s.execute(select(Job.id, Job.priority).where(Job.id.in_(chunk))).all())
                with producer.batch(max_size=SEND_CHUNK):  # flushed to Redis when the block ends
                    for jid in chunk:
                        app.send_task("clipmill.render", (jid,), priority=broker_priority(prio.get(jid, 0)),
                                      queue="render", retry=False, producer=producer)
                mark_sent(db, chunk)
                sent += len(chunk)
    except (KombuError, RedisError, OSError) as e:
        raise BrokerDown(str(e) or e.__class__.__name__) from e
    return sent


def mark_sent(db: Database, job_ids: list[int]) -> None:
    """Record that a message for each job's current stage (render, then post) went out now:
    reconcile sends one again only once ``stale_s`` has passed without the stage taking it."""
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(enqueued_at=now())
                  .execution_options(synchronize_session=False))


def posts_due(db: Database, cutoff) -> list[tuple[int, int]]:
    """(attempt, job) of rendered attempts waiting for post-processing whose post message was
    never sent or sent before ``cutoff``, and whose post lease no live worker holds."""
    with db.session() as s:
        rows = s.execute(select(Attempt.id, Job.id, Job.lease_expires_at, Job.lease_owner).join(Job).where(
            Attempt.state == AttemptState.RENDERED.value, Job.state == JobState.POST.value,
            or_(Job.enqueued_at.is_(None), Job.enqueued_at < cutoff),
        ).order_by(Attempt.id)).all()
    return [(a, j) for a, j, expires, owner in rows if lease_lost(expires, owner)]


def send_post(attempt_id: int) -> None:
    """Send one post-processing message for a rendered attempt."""
    app.send_task("clipmill.post", (attempt_id,), queue="post", retry=False)


def send_assemble(ad_id: int) -> None:
    """Send one assembly message for an ad (on the post queue); one for an ad that is not ready,
    or already assembled, does nothing."""
    app.send_task("clipmill.assemble", (ad_id,), queue="post", retry=False)


def send_notify(batch_id: str) -> None:
    """Send the batch-finished callback's task (post queue); it sends nothing for a batch that
    is not finished, has no URL, or was notified already."""
    app.send_task("clipmill.notify", (batch_id,), queue="post", retry=False)


def unnotified(db: Database) -> list[str]:
    """Finished batches with a callback URL that nobody has sent yet (or whose sender died)."""
    with db.session() as s:
        ids = list(s.scalars(select(Batch.id).where(Batch.notify_url.is_not(None), not_sent())))
    return [b for b in ids if due(db, b)]


def reconcile(db: Database, stale_s: float = 600) -> dict:
    """Take back expired leases; send again queued jobs never sent or sent over ``stale_s`` ago,
    rendered attempts waiting for post-processing whose post message is as old and whose post
    lease no live worker holds, and ads whose shots are all in but which are not assembled (or
    whose assembler's lease expired)."""
    taken_back = reclaim(db)
    cutoff = now() - timedelta(seconds=stale_s)
    with db.session() as s:
        ids = list(s.scalars(select(Job.id).where(
            Job.state == JobState.QUEUED.value, or_(Job.enqueued_at.is_(None), Job.enqueued_at < cutoff)
        ).order_by(Job.priority.desc(), Job.id)))
    sent = send_render(db, ids) if ids else 0
    posted: list[int] = []  # jobs whose post message went out: marked once, also when the broker fails midway
    assembles = notifies = 0
    try:
        # not one a run for each attempt waiting: a post queue with a backlog would fill with repeats
        for attempt_id, job_id in posts_due(db, cutoff):
            send_post(attempt_id)
            posted.append(job_id)
        for ad_id in unassembled(db):
            send_assemble(ad_id)
            assembles += 1
        for batch_id in unnotified(db):
            send_notify(batch_id)
            notifies += 1
    except (KombuError, RedisError, OSError) as e:  # as send_render's: the caller says so and tries again later
        raise BrokerDown(str(e) or e.__class__.__name__) from e
    finally:
        if posted:
            mark_sent(db, posted)
    return {"taken_back": len(taken_back), "render_sent": sent, "post_sent": len(posted), "assemble_sent": assembles,
            "notify_sent": notifies}


def unassembled(db: Database) -> list[int]:
    """Ads that an assembly message should be out for: waiting with every shot delivered (or
    one lost), or assembling under an expired lease."""
    out = []
    with db.session() as s:
        for ad in s.scalars(select(Ad).where(Ad.state.in_(("waiting", "assembling"))).order_by(Ad.id)):
            if ad.state == "assembling" and not lease_lost(ad.lease_expires_at, ad.lease_owner):
                continue
            if readiness(s, ad.id).state != "waiting":
                out.append(ad.id)
    return out
