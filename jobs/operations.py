"""Operator actions on batches and jobs: cancel, retry failed jobs."""

from __future__ import annotations

from sqlalchemy import select

from jobs.db import Database
from jobs.models import Batch, Job
from jobs.states import JobState, MoveConflict, move_job

CANCELLABLE = (JobState.QUEUED, JobState.RENDERING, JobState.POST)


class TargetError(ValueError):
    pass


def resolve(db: Database, target: str) -> list[int]:
    """Job ids of a batch name, or of one job id."""
    with db.session() as s:
        if s.get(Batch, target) is not None:
            return list(s.scalars(select(Job.id).where(Job.batch_id == target).order_by(Job.id)))
        if target.isdigit() and s.get(Job, int(target)) is not None:
            return [int(target)]
    raise TargetError(f"{target!r}: no batch or job of that name or id")


def _move_each(db: Database, ids: list[int], sources: tuple[JobState, ...], dst: JobState, **values) -> list[int]:
    moved = []
    for jid in ids:
        with db.session() as s, s.begin():
            job = s.get(Job, jid)
            if JobState(job.state) not in sources:
                continue
            try:
                move_job(s, jid, JobState(job.state), dst, **values)
                moved.append(jid)
            except MoveConflict:
                pass  # it moved on meanwhile (finished, or another operator)
    return moved


def cancel(db: Database, target: str) -> list[int]:
    """Cancel the queued and running jobs of ``target``. A render or post-processing already
    running finds its job cancelled when it tries to store, and drops its result."""
    return _move_each(db, resolve(db, target), CANCELLABLE, JobState.CANCELLED, lease_owner=None, lease_expires_at=None)


def retry(db: Database, target: str, failed: bool = True, cancelled: bool = False) -> list[int]:
    """Queue the failed (and, if asked, cancelled) jobs of ``target`` again, for one more attempt."""
    sources = tuple(s for s, on in ((JobState.FAILED, failed), (JobState.CANCELLED, cancelled)) if on)
    if not sources:
        raise TargetError("nothing to retry: give --failed and/or --cancelled")
    return _move_each(db, resolve(db, target), sources, JobState.QUEUED, error=None, enqueued_at=None)
