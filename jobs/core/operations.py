"""Operator actions on batches and jobs: cancel, retry failed jobs."""

from __future__ import annotations

import logging
import re
from datetime import datetime, timezone

from sqlalchemy import delete, select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Job, attempt_keys
from clipmill.jobs.core.states import AttemptState, JobState, MoveConflict, move_attempt, move_job
from clipmill.storage import open_storage

log = logging.getLogger("clipmill.operations")
OPEN_ATTEMPTS = (AttemptState.RENDERING, AttemptState.RENDERED)

CANCELLABLE = (JobState.QUEUED, JobState.RENDERING, JobState.POST)


class TargetError(ValueError):
    pass


def resolve(db: Database, target: str) -> list[int]:
    """Job ids of a batch name, or of one job id."""
    job_id = int(target) if re.fullmatch(r"[0-9]{1,18}", target) else None  # ASCII digits: "١" and "²" are no id
    with db.session() as s:
        job = s.get(Job, job_id) if job_id is not None else None
        if s.get(Batch, target) is not None:
            if job is not None:  # a batch named with digits only (allowed before; refused since)
                raise TargetError(f"{target!r} names both a batch and job {job_id}; act on the job from the review page, "
                                  "or on the batch's jobs one id at a time")
            return list(s.scalars(select(Job.id).where(Job.batch_id == target).order_by(Job.id)))
        if job is not None:
            return [job_id]
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
    """Cancel the queued and running jobs of ``target``; returns the ids cancelled.

    Their open attempts are closed as failed ('cancelled'), and every file the job's attempts
    wrote (raw frames, and whatever post-processing stored; a job waiting for its QC retry has
    its first attempt's clip) is deleted. A render or post-processing
    still running finds its job cancelled when it records its result, and deletes what it
    wrote after this (see runner.stages), so a cancelled job keeps no clip, sidecar or frames.
    """
    cancelled = []
    for jid in resolve(db, target):
        for _ in range(3):  # a stage that moved the job meanwhile: look again
            try:
                done = _cancel_one(db, jid)
                break
            except MoveConflict:
                continue
        else:
            done = None  # it kept moving; it has most likely finished
        if done is not None:
            cancelled.append(jid)
            out, keys = done
            if keys:
                _delete(out, keys)
    return cancelled


def _cancel_one(db: Database, jid: int) -> tuple[str, list[str]] | None:
    """Cancel one job and close its open attempts in one transaction; returns its storage root
    and the keys to delete, or None if it is not cancellable. Attempts are moved before the job,
    in the order the stages lock them, so a stage committing at the same time cannot deadlock
    with it; if either moved meanwhile, MoveConflict rolls back both."""
    with db.session() as s, s.begin():
        job = s.get(Job, jid)
        if JobState(job.state) not in CANCELLABLE:
            return None
        keys = []
        for a in s.scalars(select(Attempt).where(Attempt.job_id == jid)).all():
            if AttemptState(a.state) in OPEN_ATTEMPTS:
                move_attempt(s, a.id, AttemptState(a.state), AttemptState.FAILED, raw_key=None,
                             finished_at=datetime.now(timezone.utc), error="cancelled by an operator")
            keys += attempt_keys(job, a)  # closed attempts too: a job waiting for its QC retry has a1's clip
        move_job(s, jid, JobState(job.state), JobState.CANCELLED, lease_owner=None, lease_expires_at=None)
        return s.get(Batch, job.batch_id).out, keys


def _delete(out: str, keys: list[str], why: str = "cancelled", storage=None) -> None:
    try:
        storage = storage or open_storage(out)
        for key in keys:
            storage.delete(key)
    except Exception as e:  # noqa: BLE001 - the job's state stands either way; say what is left
        log.warning("%s, but deleting %s in %s failed (%s: %s); delete them by hand", why, ", ".join(keys), out,
                    e.__class__.__name__, e)


LOST = "abandoned:"  # how the error of an attempt lost with its worker starts (core.queue)


def sweep_lost(db: Database, job_id: int, storage=None) -> None:
    """Delete what the job's lost attempts left in storage: a render killed after it stored its
    raw frames but before it recorded them (``raw_key``) left them with no attempt pointing at
    them. A lost attempt's files are never delivered. Called once the job has a clip stored or
    has ended ``failed``; ``storage`` is the batch's, where the caller has it open."""
    with db.session() as s:
        job = s.get(Job, job_id)
        if job is None or not job.attempts_lost:  # only a job that lost an attempt can have left anything
            return
        out = s.get(Batch, job.batch_id).out
        keys = [k for a in s.scalars(select(Attempt).where(
            Attempt.job_id == job_id, Attempt.state == AttemptState.FAILED.value, Attempt.error.like(LOST + "%")))
            for k in attempt_keys(job, a)]
    if keys:
        _delete(out, keys, f"job {job_id}'s lost attempts swept", storage)


RETRY_TIER = "quality"  # a QC-rejected job renders again at this tier (as runner.stages' QC retries do)


def retry(db: Database, target: str, failed: bool = True, cancelled: bool = False, rejected: bool = False) -> list[int]:
    """Queue the failed (and, if asked, cancelled or QC-rejected) jobs of ``target`` again, for
    one more attempt each; returns the ids queued.

    Each job moves with a compare-and-set from the state it was read in, so a job is queued
    once however many operators retry it at the same time, and a job that moved on meanwhile (an
    operator approved a rejected clip, say) is left alone. A rejected job renders again at the
    ``quality`` tier, with a new seed (every attempt after the first gets its own).
    """
    sources = tuple(s for s, on in ((JobState.FAILED, failed), (JobState.CANCELLED, cancelled),
                                    (JobState.REJECTED, rejected)) if on)
    if not sources:
        raise TargetError("nothing to retry: give --failed, --rejected and/or --cancelled")
    ids = resolve(db, target)
    moved = _move_each(db, ids, tuple(s for s in sources if s is not JobState.REJECTED), JobState.QUEUED,
                       error=None, enqueued_at=None)
    if rejected:
        moved += _move_each(db, ids, (JobState.REJECTED,), JobState.QUEUED, error=None, enqueued_at=None,
                            tier=RETRY_TIER)
    return sorted(moved)


def release(db: Database, attempt_ids: list[int]) -> list[int]:
    """Undo the claims of attempts that never started rendering (the model or device could not
    be set up): each attempt row is deleted and its job goes back to queued with its attempt
    count as before the claim, so a setup problem uses up no job's attempts. Attempts that
    moved on meanwhile are left alone. Returns the job ids queued again."""
    released = []
    for aid in attempt_ids:
        with db.session() as s, s.begin():
            a = s.get(Attempt, aid)
            if a is None or a.state != AttemptState.RENDERING.value:
                continue
            job = s.get(Job, a.job_id)
            try:
                move_job(s, job.id, JobState.RENDERING, JobState.QUEUED, lease_owner=None, lease_expires_at=None,
                         attempts_made=max(0, job.attempts_made - 1), enqueued_at=None)
            except MoveConflict:
                continue
            s.execute(delete(Attempt).where(Attempt.id == aid, Attempt.state == AttemptState.RENDERING.value))
            released.append(job.id)
    return released
