"""Claiming work from the job table: groups of compatible jobs, leases, and taking back
jobs whose worker is gone. Every claim is a compare-and-set move, so a job goes to one worker."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import exists, select, update

from jobs.db import Database
from jobs.models import Attempt, Batch, Job
from jobs.states import AttemptState, JobState, MoveConflict, move_attempt, move_job
from pipeline.sampler import TIERS

DEFAULT_LEASE_S = 900


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Claimed:
    job_id: int
    attempt_id: int
    steps: int


def _for_update(stmt, session, skip_locked: bool = True):
    if session.bind.dialect.name == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked, of=Job)
    return stmt  # SQLite: BEGIN IMMEDIATE already serialises writers


def attempt_seed(job_seed: int, number: int) -> int:
    """Attempt 1 uses the job's seed; every later attempt a new seed derived from it."""
    if number == 1:
        return job_seed
    digest = hashlib.sha256(f"{job_seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def claim_group(
    db: Database,
    worker: str,
    batch_id: str | None = None,
    size: int = 4,
    lease_s: float = DEFAULT_LEASE_S,
    first_job_id: int | None = None,
) -> list[Claimed]:
    """Claim up to ``size`` queued jobs that can share one render call, and open an attempt each.

    Compatible means same model, sampler, guidance, tier, frames and size. The first job is
    ``first_job_id`` if given (and still queued), else the highest-priority, oldest queued one;
    the rest must match it. A job with a failed attempt (a render error such as out of memory,
    or a worker lost) renders alone: a group of one may fit where the group did not, and a
    poison job takes no healthy jobs down with it.
    """
    with db.session() as s, s.begin():
        base = select(Job, Batch).join(Batch).where(Job.state == JobState.QUEUED.value)
        if batch_id is not None:
            base = base.where(Job.batch_id == batch_id)
        head = base.where(Job.id == first_job_id) if first_job_id is not None else base
        # The job a message names is waited for, not skipped, when its row is locked: the lock may
        # be send_render marking it sent just after the message went out (skipping would drop the
        # message and leave the job queued until reconcile). Another claimer's lock ends with its
        # commit, and the row is then no longer queued. Group members are still skipped if locked.
        first = s.execute(_for_update(head.order_by(Job.priority.desc(), Job.id).limit(1), s,
                                      skip_locked=first_job_id is None)).first()
        if first is None:
            return []
        job, batch = first
        failed_before = exists().where(Attempt.job_id == Job.id, Attempt.state == AttemptState.FAILED.value)
        alone = s.scalar(select(exists().where(
            Attempt.job_id == job.id, Attempt.state == AttemptState.FAILED.value)))
        rest = [] if alone or size <= 1 else s.execute(
            _for_update(
                base.where(
                    ~failed_before,
                    Job.id != job.id,
                    Batch.model == batch.model,
                    Batch.sampler == batch.sampler,
                    Batch.guidance == batch.guidance,
                    Job.tier == job.tier,
                    Job.frames == job.frames,
                    Job.width == job.width,
                    Job.height == job.height,
                )
                .order_by(Job.priority.desc(), Job.id)
                .limit(size - 1),
                s,
            )
        ).all()
        group = [(job, batch)] + [(j, b) for j, b in rest]
        group_id = uuid.uuid4().hex[:12]
        expires = now() + timedelta(seconds=lease_s)
        claimed: list[Claimed] = []
        for j, b in group:
            try:
                move_job(
                    s, j.id, JobState.QUEUED, JobState.RENDERING,
                    lease_owner=worker, lease_expires_at=expires, attempts_made=j.attempts_made + 1, error=None,
                )
            except MoveConflict:
                continue
            attempt = Attempt(
                job_id=j.id,
                number=j.attempts_made + 1,
                state=AttemptState.RENDERING.value,
                tier=j.tier,
                steps=TIERS[j.tier].steps,
                seed=attempt_seed(j.seed, j.attempts_made + 1),
                model=b.model,
                sampler=b.sampler,
                guidance=b.guidance,
                worker=worker,
                group_id=group_id,
                group_size=len(group),
                timings={},
            )
            s.add(attempt)
            s.flush()
            claimed.append(Claimed(j.id, attempt.id, attempt.steps))
        return claimed


def renew_lease(db: Database, job_ids: list[int], worker: str, lease_s: float = DEFAULT_LEASE_S) -> None:
    """Heartbeat: push the lease of jobs this worker holds further out."""
    if not job_ids:
        return
    with db.session() as s, s.begin():
        s.execute(
            update(Job)
            .where(Job.id.in_(job_ids), Job.lease_owner == worker)
            .values(lease_expires_at=now() + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)
        )


def _owner_dead(owner: str | None) -> bool:
    """True when ``owner`` is a process on this host that no longer exists."""
    if not owner or ":" not in owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def reclaim(db: Database, batch_id: str | None = None) -> list[int]:
    """Take back rendering jobs whose lease expired or whose local worker process died.

    Their open attempt is marked failed ('abandoned'); the job goes back to queued if it has
    attempts left, else to failed. Returns the job ids moved.
    """
    moved = []
    with db.session() as s, s.begin():
        q = select(Job, Batch).join(Batch).where(Job.state == JobState.RENDERING.value)
        if batch_id is not None:
            q = q.where(Job.batch_id == batch_id)
        for job, batch in s.execute(q).all():
            expires = job.lease_expires_at
            if expires is not None and expires.tzinfo is None:
                expires = expires.replace(tzinfo=timezone.utc)
            if not (expires is None or expires < now() or _owner_dead(job.lease_owner)):
                continue
            for a in s.scalars(
                select(Attempt).where(Attempt.job_id == job.id, Attempt.state == AttemptState.RENDERING.value)
            ):
                move_attempt(
                    s, a.id, AttemptState.RENDERING, AttemptState.FAILED,
                    error=f"abandoned: worker {job.lease_owner} lost its lease", finished_at=now(),
                )
            dst = JobState.QUEUED if job.attempts_made < batch.max_attempts else JobState.FAILED
            try:
                move_job(
                    s, job.id, JobState.RENDERING, dst, lease_owner=None, lease_expires_at=None,
                    error=None if dst is JobState.QUEUED else "worker lost, out of attempts",
                )
                moved.append(job.id)
            except MoveConflict:
                pass
    return moved


def pending_post(db: Database, batch_id: str | None = None) -> list[int]:
    """Attempts that were rendered but not post-processed (their raw frames are stored)."""
    with db.session() as s:
        q = select(Attempt.id).join(Job).where(
            Attempt.state == AttemptState.RENDERED.value, Job.state == JobState.POST.value
        )
        if batch_id is not None:
            q = q.where(Job.batch_id == batch_id)
        return list(s.scalars(q.order_by(Attempt.id)))
