"""Claiming work from the job table: groups of compatible jobs, leases and their heartbeat,
and taking back jobs whose worker is gone. Every claim is a compare-and-set move, so a job goes
to one worker.

Attempts are counted two ways. ``Job.attempts_made`` counts every claim (attempts are numbered
by it). Of those, ``Job.attempts_lost`` were lost with their worker (killed, or its lease
expired): they do not count against the batch's ``max_attempts``, which render errors and QC
retries use up, so a crash never costs a job its QC retry at the quality tier. A job that loses
``Batch.max_lost`` attempts (default 3; a poison job that kills its worker) ends failed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import exists, select, update

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Job
from clipmill.jobs.core.operations import LOST, sweep_lost
from clipmill.jobs.core.states import AttemptState, JobState, MoveConflict, move_attempt, move_job
from clipmill.pipeline.choices import TIERS

DEFAULT_LEASE_S = 900

log = logging.getLogger("clipmill.queue")


def worker_name() -> str:
    """``host:pid``, and where the system tells it, ``.start``: the process's start time in clock
    ticks since boot. A container restarted on the same host name gets the same small pids again
    (its first process is pid 1 every time), so a pid alone could read a crashed run's lease as
    held by the process now looking at it."""
    start = _start_ticks(os.getpid())
    return f"{socket.gethostname()}:{os.getpid()}" + (f".{start}" if start else "")


def _start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time since boot), or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 and fields[19].isdigit() else None


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Claimed:
    job_id: int
    attempt_id: int
    steps: int


def attempts_used(job: Job) -> int:
    """The attempts that count against the batch's ``max_attempts``: every claim but those lost
    with their worker."""
    return job.attempts_made - (job.attempts_lost or 0)


def attempts_left(job: Job, batch: Batch) -> bool:
    """True while render errors and QC retries have not used up the batch's ``max_attempts``."""
    return attempts_used(job) < batch.max_attempts


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
                # a lost attempt (its worker died) renders the same clip again: only a QC retry draws anew
                seed=attempt_seed(j.seed, j.attempts_made - (j.attempts_lost or 0) + 1),
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


def renew_lease(db: Database, job_ids: list[int], worker: str, lease_s: float = DEFAULT_LEASE_S,
                state: JobState = JobState.RENDERING) -> int:
    """Push the lease of the jobs this worker still holds in ``state`` (rendering, or post for a
    post stage's lease) ``lease_s`` seconds out; returns how many."""
    if not job_ids:
        return 0
    with db.session() as s, s.begin():
        res = s.execute(
            update(Job)
            .where(Job.id.in_(job_ids), Job.lease_owner == worker, Job.state == state.value)
            .values(lease_expires_at=now() + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)
        )
        return res.rowcount


class Heartbeat:
    """Renews the lease of the jobs a worker is rendering (or post-processing: ``state``), every ``lease_s / 3`` seconds, on a
    thread of its own, for as long as the ``with`` block runs: a group that renders for longer
    than the lease is never taken back by a concurrent ``run``, ``nightly`` or ``reconcile``.

    Both runners use it (the farm's render task and the embedded run). A failed renewal (the
    database restarting, a dropped connection, a lock timeout) is logged and the next beat tries
    again; with two beats left before the lease runs out, a short outage costs nothing.

    With ``max_s``, renewals stop once the block has run that long (said in the log): a stage
    hung for good in a live process (a write that never returns) then loses its lease like a
    dead one, and another worker takes the job over (counting a lost attempt); the hung one, if
    it ever goes on, finds the lease gone and stores nothing.
    """

    def __init__(self, db: Database, job_ids: list[int], worker: str, lease_s: float = DEFAULT_LEASE_S,
                 every: float | None = None, state: JobState = JobState.RENDERING, max_s: float | None = None):
        self.db, self.job_ids, self.worker, self.lease_s, self.state = db, list(job_ids), worker, lease_s, state
        self.every = every if every is not None else lease_s / 3
        if not 0 < self.every < lease_s:
            raise ValueError(f"heartbeat every {self.every:g} s with a lease of {lease_s:g} s: allowed more "
                             "than 0 and less than the lease")
        self.max_s = max_s
        self.beats = 0  # renewals that reached the database
        self.errors = 0  # renewals that failed
        self.gave_up = False  # the block ran past max_s: its lease is no longer renewed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="clipmill-heartbeat", daemon=True)

    def beat(self) -> None:
        try:
            renew_lease(self.db, self.job_ids, self.worker, self.lease_s, self.state)
        except Exception as e:  # noqa: BLE001 - any database error: keep beating
            self.errors += 1
            log.warning("lease renewal of jobs %s failed (%s: %s); retrying in %.3g s", self.job_ids,
                        e.__class__.__name__, str(e).splitlines()[0] if str(e) else "", self.every)
        else:
            self.beats += 1

    def run(self) -> None:
        started = time.monotonic()
        while not self.stop.wait(self.every):
            if self.max_s is not None and time.monotonic() - started > self.max_s:
                self.gave_up = True
                log.warning("jobs %s: %s has run past %g s, its limit: its lease is no longer renewed, and another "
                            "worker takes the jobs over when it runs out", self.job_ids,
                            "post-processing" if self.state is JobState.POST else "rendering", self.max_s)
                return
            self.beat()

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def lease_lost(expires: datetime | None, owner: str | None) -> bool:
    """Whether a lease is no longer held: it has no expiry, its expiry has passed, or its owner is
    a process on this host that no longer exists. (SQLite returns naive UTC datetimes.)"""
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=timezone.utc)
    return expires is None or expires < now() or _owner_dead(owner)


def _owner_dead(owner: str | None) -> bool:
    """True when ``owner`` (:func:`worker_name`) is a process on this host that no longer
    exists, or whose pid now belongs to a process started at another time."""
    if not owner or ":" not in owner:
        return False
    host, _, rest = owner.partition("/")[0].rpartition(":")  # "/..." names a thread of the process
    pid, _, start = rest.partition(".")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    if start.isdigit():
        now_start = _start_ticks(int(pid))
        return now_start is not None and now_start != start
    return False


def reclaim(db: Database, batch_id: str | None = None) -> list[int]:
    """Take back rendering jobs whose lease expired or whose local worker process died.

    Their open attempt is marked failed ('abandoned') and counted as lost, not against the
    batch's ``max_attempts``. The job goes back to queued, or to failed once it has lost the
    batch's ``max_lost`` attempts. Returns the job ids moved.
    """
    moved, failed = [], []
    with db.session() as s, s.begin():
        q = select(Job, Batch).join(Batch).where(Job.state == JobState.RENDERING.value)
        if batch_id is not None:
            q = q.where(Job.batch_id == batch_id)
        # locked: a lease renewed at this moment is seen renewed (or its row skipped), never taken back
        for job, batch in s.execute(_for_update(q, s)).all():
            if not lease_lost(job.lease_expires_at, job.lease_owner):
                continue
            for a in s.scalars(
                select(Attempt).where(Attempt.job_id == job.id, Attempt.state == AttemptState.RENDERING.value)
            ):
                move_attempt(s, a.id, AttemptState.RENDERING, AttemptState.FAILED, finished_at=now(),
                             error=f"{LOST} worker {job.lease_owner} lost its lease")
            lost, error = _lost_once_more(job, batch, "worker")
            try:
                move_job(s, job.id, JobState.RENDERING, JobState.QUEUED if error is None else JobState.FAILED,
                         lease_owner=None, lease_expires_at=None, attempts_lost=lost, error=error)
                moved.append(job.id)
                if error is not None:
                    failed.append(job.id)
            except MoveConflict:
                pass
    for job_id in failed:  # what its lost attempts stored is never delivered
        sweep_lost(db, job_id)
    return moved


def _lost_once_more(job: Job, batch: Batch, who: str) -> tuple[int, str | None]:
    """One more attempt of ``job`` lost with its ``who`` (the rendering 'worker' or the 'post
    worker', ``job.lease_owner``): the job's attempts lost so far, and its failure reason once
    that reaches the batch's ``max_lost`` (a job that kills its worker goes round no more), else None."""
    lost = (job.attempts_lost or 0) + 1
    if lost < batch.max_lost:
        return lost, None
    return lost, (f"{who} lost {lost} times (max_lost {batch.max_lost}): the {'job' if who == 'worker' else 'clip'} "
                  f"may kill its {who}; last worker {job.lease_owner}")


POST_LEASE_S = 600  # a post stage (interpolate, encode, QC, store) takes seconds; a lease past this is lost
# its lease is renewed while it runs, for at most this long: one still running then is hung (a
# minute of 4K at 60 fps takes a few minutes on a CPU), and another worker takes it over
POST_MAX_S = 3600


def claim_post(db: Database, job_id: int, worker: str, lease_s: float = POST_LEASE_S) -> str:
    """Take the post-processing lease of a job waiting in ``post``. Returns "claimed" when this
    worker holds it now (nobody held it, its holder's lease expired or its process is gone, or
    it is this worker's already: then nothing is written), "busy" when another live worker holds
    it, "moved" when the job is no longer in ``post`` (cancelled, say). One post worker at a time
    stores an attempt's files, so they are the ones its verdict was read from."""
    with db.session() as s:
        row = s.execute(select(Job.state, Job.lease_owner, Job.lease_expires_at).where(Job.id == job_id)).one_or_none()
    if row is None or row.state != JobState.POST.value:
        return "moved"
    if row.lease_owner == worker and not lease_lost(row.lease_expires_at, row.lease_owner):
        return "claimed"
    with db.session() as s, s.begin():
        job = s.execute(_for_update(select(Job).where(Job.id == job_id), s, skip_locked=False)).scalar_one_or_none()
        if job is None or job.state != JobState.POST.value:
            return "moved"
        if job.lease_owner not in (None, worker) and not lease_lost(job.lease_expires_at, job.lease_owner):
            return "busy"
        error = None
        if job.lease_owner not in (None, worker):  # its post worker died (or hung past its lease): a lost attempt
            lost, error = _lost_once_more(job, s.get(Batch, job.batch_id), "post worker")
            job.attempts_lost = lost
        if error is None:
            job.lease_owner, job.lease_expires_at = worker, now() + timedelta(seconds=lease_s)
        else:  # the clip kills its post worker: stop sending it round
            for a in s.scalars(select(Attempt).where(Attempt.job_id == job.id,
                                                     Attempt.state == AttemptState.RENDERED.value)):
                move_attempt(s, a.id, AttemptState.RENDERED, AttemptState.FAILED, finished_at=now(),
                             error=f"{LOST} post worker {job.lease_owner} lost its lease")
            move_job(s, job.id, JobState.POST, JobState.FAILED, lease_owner=None, lease_expires_at=None,
                     attempts_lost=lost, error=error)
    if error is not None:  # failed above: what its lost attempts stored is never delivered
        sweep_lost(db, job_id)
        return "moved"
    return "claimed"


def holds_post(db: Database, job_id: int, worker: str) -> bool:
    """Whether ``worker`` still holds the post lease of job ``job_id`` (checked before it stores
    an attempt's files: a worker that stalled past its lease, whose job another worker has
    taken over, stores nothing)."""
    with db.session() as s:
        row = s.execute(select(Job.state, Job.lease_owner).where(Job.id == job_id)).one_or_none()
    return row is not None and row.state == JobState.POST.value and row.lease_owner == worker


def pending_post(db: Database, batch_id: str | None = None) -> list[int]:
    """Attempts that were rendered but not post-processed (their raw frames are stored)."""
    with db.session() as s:
        q = select(Attempt.id).join(Job).where(
            Attempt.state == AttemptState.RENDERED.value, Job.state == JobState.POST.value
        )
        if batch_id is not None:
            q = q.where(Job.batch_id == batch_id)
        return list(s.scalars(q.order_by(Attempt.id)))
